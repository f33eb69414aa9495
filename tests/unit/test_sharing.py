"""Cross-request prefix sharing (seq_cp) against the fake backend."""

from server.kv.share_cost import StepSpeed
from server.slot.slot import SlotState

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


# --- waiting versus computing: the cost model (kv/share_cost.py) ----------------------

# a step costs mostly its tokens (a CPU) or mostly a fixed overhead (a GPU); alpha 0 keeps
# these injected estimates fixed whatever the fake steps measure
PER_TOKEN_BOUND = StepSpeed(per_step=0.001, per_token=0.001, alpha=0.0)
PER_STEP_BOUND = StepSpeed(per_step=1.0, per_token=1e-6, alpha=0.0)


def test_step_speed_fits_fixed_and_per_token_cost():
    sp = StepSpeed(alpha=0.1)
    for _ in range(30):
        sp.observe(4, 0.040)  # decoding steps only: no slope yet, callers keep waiting
    assert sp.seconds(3, 100) is None
    # steps on the line 0.036 s + 1 ms per token, mostly decoding, sometimes a prefill chunk
    for i in range(60):
        n = 1804 if i % 30 == 0 else 17 if i % 10 == 0 else 4
        sp.observe(n, 0.036 + 0.001 * n)
    assert abs(sp.per_token - 0.001) < 1e-4 and abs(sp.per_step - 0.036) < 0.004
    assert abs(sp.seconds(2, 500) - (2 * sp.per_step + 500 * sp.per_token)) < 1e-12


def test_waiting_wins_when_tokens_dominate():
    e, b = make_engine(n_seq=4, n_batch=1024)
    e.sharing.speed = PER_TOKEN_BOUND
    t1, c1 = task(PREFIX + [900], max_tokens=2)
    t2, c2 = task(PREFIX + [901, 902], max_tokens=2)
    e.waiting.extend([t1, t2])
    e.step()  # the source computes the prefix; the other waits for it
    assert [s.state for s in e.slots if s.task is t2] == [SlotState.WAIT]
    run(e)
    r1, r2 = c1.result, c2.result
    assert (r1.timings.cache_n, r1.timings.prompt_n) == (0, 301)
    assert (r2.timings.cache_n, r2.timings.prompt_n) == (300, 2)
    assert e.stats.prefix_waits_skipped == e.stats.prefix_waits_abandoned == 0
    # the prefix once, then the suffix; plus each task's first token, fed back to sample the second
    assert prompt_tokens_decoded(b) == 301 + 2 + 2


def test_computing_wins_when_steps_dominate():
    # the same layout, but one step holds both prompts and a step costs its overhead
    e, b = make_engine(n_seq=4, n_batch=1024)
    e.sharing.speed = PER_STEP_BOUND
    t1, c1 = task(PREFIX + [900], max_tokens=2)
    t2, c2 = task(PREFIX + [901, 902], max_tokens=2)
    e.waiting.extend([t1, t2])
    e.step()
    assert all(s.state is not SlotState.WAIT for s in e.slots)
    assert len(b.decodes) == 1 and len(b.decodes[0]) == 301 + 302  # both prompts at once
    run(e)
    assert (c1.result.timings.cache_n, c1.result.timings.prompt_n) == (0, 301)
    assert (c2.result.timings.cache_n, c2.result.timings.prompt_n) == (0, 302)
    assert e.stats.prefix_waits_skipped == 1 and e.stats.prefix_shared_tokens == 0


def test_a_waiter_gives_up_when_computing_becomes_faster():
    e, b = make_engine(n_seq=4, n_batch=1024)
    e.sharing.min_wait = 100
    src, c_src = task(PREFIX + [900], max_tokens=2)
    short, c_short = task(PREFIX[:150] + [901, 903], max_tokens=2)  # waits for 150 tokens
    late, c_late = task(PREFIX + [902], max_tokens=2)  # waits for 300
    e.waiting.extend([src, short, late])
    e.step()  # nothing measured yet: both wait; the source stops at the first mark
    s_src = next(s for s in e.slots if s.task is src)
    assert len(s_src.tokens) == 150 and s_src.run.share_marks == {150, 300}
    assert sum(s.state is SlotState.WAIT for s in e.slots) == 2
    e.sharing.speed = PER_STEP_BOUND
    e.step()
    # waiting would take this step and the next; computing the rest takes this one
    assert e.stats.prefix_waits_abandoned == 1
    assert 300 not in s_src.run.share_marks
    assert len(b.decodes[1]) == 151 + 2 + 151  # all three prompts done in one decode
    run(e)
    assert (c_src.result.timings.cache_n, c_src.result.timings.prompt_n) == (0, 301)
    assert (c_short.result.timings.cache_n, c_short.result.timings.prompt_n) == (150, 2)
    assert (c_late.result.timings.cache_n, c_late.result.timings.prompt_n) == (150, 151)
    assert e.stats.prefix_shared_tokens == 300


def test_a_wait_counts_the_step_it_costs_its_source():
    # 800 tokens a step: the source's prompt fits in the first step, the second waiter's does
    # not. Waiting would take that waiter two steps, computing also two, but waiting would
    # stop the source at the shared prefix and delay its first token by a step.
    e, b = make_engine(n_seq=4, n_batch=800)
    e.sharing.speed = PER_STEP_BOUND
    src, c_src = task(PREFIX + [900], max_tokens=2)
    tasks = [task(PREFIX + [901 + i, 902 + i], max_tokens=2) for i in (0, 2)]
    e.waiting.extend([src, *(t for t, _ in tasks)])
    e.step()
    assert all(s.state is not SlotState.WAIT for s in e.slots)
    assert next(s for s in e.slots if s.task is src).state is SlotState.GENERATE
    assert len(b.decodes[0]) == 800  # 301 + 302 + 197
    run(e)
    assert e.stats.prefix_waits_skipped == 2
    assert [c.result.timings.prompt_n for _, c in tasks] == [302, 302]


def test_one_lookup_serves_the_tier_load_and_both_sharing_sources(monkeypatch):
    """Issue 41: a placement takes one match (slots, in-flight prefills, the RAM index) and
    the tier load, held_source and inflight_source all read it; the index is walked once."""
    from server.prefix.prefix_index import PrefixIndex
    from server.tiers.prompt_cache import PromptCache

    e, b = make_engine(n_seq=2)
    e.cache = PromptCache(-1, 0)
    e.opts.cache_idle_slots = False
    t1, c1 = task(PREFIX + [900], max_tokens=30)
    e.waiting.append(t1)
    e.step()
    e.step()  # t1 generating: its slot holds the prefix
    matches, walks = [], []
    real_match, real_walk = e.sharing.locator.match, PrefixIndex.match
    monkeypatch.setattr(
        e.sharing.locator, "match", lambda *a, **k: matches.append(a) or real_match(*a, **k)
    )
    monkeypatch.setattr(
        PrefixIndex, "match", lambda self, *a: walks.append(a) or real_walk(self, *a)
    )
    seen = []
    for name in ("held_source", "inflight_source"):
        real = getattr(e.sharing, name)

        def spy(*a, _real=real, _name=name, **k):
            seen.append((_name, a[-1] if len(a) > 4 else k.get("match")))
            return _real(*a, **k)

        monkeypatch.setattr(e.sharing, name, spy)
    t2, c2 = task(PREFIX[:250] + [901], max_tokens=2)
    e.waiting.append(t2)
    e.step()
    assert len(matches) == 1 and len(walks) == 1  # one lookup, one walk of the index
    assert [n for n, _ in seen] == ["held_source", "inflight_source"]
    assert all(m is not None for _, m in seen) and seen[0][1] is seen[1][1]
    run(e, t2)
    assert c2.result.timings.cache_n == 250
