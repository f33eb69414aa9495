"""Cross-request prefix sharing (seq_cp) against the fake backend."""

from server.slots.slot import SlotState

from .helpers import make_engine, run, task

PREFIX = list(range(1, 301))


def prompt_tokens_decoded(b, seq=None) -> int:
    return sum(1 for d in b.decodes for s, _, _ in d if seq is None or s == seq)


def test_held_prefix_of_a_busy_slot_is_shared():
    e, b = make_engine(n_seq=2)
    t1, c1 = task(PREFIX + [900], max_tokens=50)
    e.waiting.append(t1)
    e.step()
    e.step()  # t1 generating, its slot holds the prefix
    t2, c2 = task(PREFIX[:250] + [901, 902], max_tokens=2)
    run(e, t2)
    r = c2.result
    assert (r.timings.cache_n, r.timings.prompt_n) == (250, 2)
    assert e.stats.prefix_shared_tokens == 250
    assert [b.kv[r.id_slot][p] for p in range(250)] == PREFIX[:250]
    run(e)
    assert c1.result.timings.predicted_n == 50


def test_no_sharing_without_unified_kv():
    e, b = make_engine(n_seq=2, kv_unified=False, n_ctx=2048)
    t1, _ = task(PREFIX + [900], max_tokens=20)
    e.waiting.append(t1)
    e.step()
    e.step()
    t2, c2 = task(PREFIX[:250] + [901], max_tokens=2)
    run(e, t2)
    assert c2.result.timings.cache_n == 0 and e.stats.prefix_shared_tokens == 0


def step_until(e, collector, limit=100):
    for _ in range(limit):
        if collector.done:
            return
        e.step()
    raise AssertionError("task did not finish")


def test_swa_guard_refuses_a_source_whose_window_is_gone():
    e, b = make_engine(n_seq=3, n_swa=50, ctx_checkpoints=0)
    t1, c1 = task(PREFIX + [900], max_tokens=200)
    e.waiting.append(t1)
    e.step()
    e.step()  # the source holds 302 tokens; its window keeps positions >= 236
    t2, c2 = task(PREFIX[:100] + [901], max_tokens=1)
    e.waiting.append(t2)
    step_until(e, c2)
    assert c2.result.timings.cache_n == 0
    t3, c3 = task(PREFIX[:290] + [902], max_tokens=1)  # cut inside the source's window
    e.waiting.append(t3)
    step_until(e, c3)
    assert c3.result.timings.cache_n == 290
    assert not c1.done


def test_concurrent_tasks_compute_a_common_prefix_once():
    e, b = make_engine(n_seq=4, n_batch=128)
    tasks = [task(PREFIX + [900 + i, 901 + i], max_tokens=3) for i in range(4)]
    run(e, *(t for t, _ in tasks))
    results = [c.result for _, c in tasks]
    assert all(r.finish.value == "length" for r in results)
    assert sorted(r.timings.cache_n for r in results) == [0, 300, 300, 300]
    assert sum(r.timings.prompt_n for r in results) == 302 + 3 * 2
    # decoded prompt tokens: one prefix plus the suffixes, plus one token per generated step
    prompt_rows = sum(1 for d in b.decodes for _, p, _ in d if p < 302)
    assert prompt_rows == 302 + 3 * 2
    assert e.stats.prefix_shared_tokens == 900


def test_short_common_prefix_does_not_wait():
    e, b = make_engine(n_seq=2, n_batch=64)
    e.sharing.min_wait = 128
    t1, c1 = task(PREFIX[:100] + [900], max_tokens=2)
    t2, c2 = task(PREFIX[:100] + [901], max_tokens=2)
    e.waiting.extend([t1, t2])
    e.step()
    assert all(s.state is not SlotState.WAIT for s in e.slots)
    run(e)


def test_cancelled_computer_is_taken_over_by_a_waiter():
    long_prefix = list(range(1, 601))
    e, b = make_engine(n_seq=3, n_batch=200)
    t1, c1 = task(long_prefix + [900], max_tokens=3)
    t2, c2 = task(long_prefix + [901], max_tokens=3)
    t3, c3 = task(long_prefix + [902], max_tokens=3)
    e.waiting.extend([t1, t2, t3])
    e.step()  # t1 computes 200 tokens; t2, t3 wait
    assert len([s for s in e.slots if s.state is SlotState.WAIT]) == 2
    e.step()  # 400
    t1.cancel()
    run(e)
    r2, r3 = c2.result, c3.result
    assert c1.result.finish.value == "cancelled"
    # one waiter took over from the 400 computed tokens, the other waited for it
    assert sorted([r2.timings.cache_n, r3.timings.cache_n]) == [400, 600]
    assert r2.finish.value == r3.finish.value == "length"


def test_more_waiters_than_slots_never_deadlock():
    e, b = make_engine(n_seq=2, n_batch=64)
    tasks = [task(PREFIX + [900 + i], max_tokens=2) for i in range(6)]
    steps = run(e, *(t for t, _ in tasks), max_steps=500)
    assert steps < 500
    assert all(c.result is not None for _, c in tasks)
    assert all(s.idle for s in e.slots)
