from server.slot.slot import SlotState
from server.task import FinishReason
from tests.fake_backend import EOG

from .helpers import make_engine, run, task


def test_single_task_generates_and_accounts_tokens():
    e, b = make_engine()
    t, c = task(range(10), max_tokens=5)
    run(e, t)
    r = c.result
    assert r.finish is FinishReason.LENGTH
    assert (r.timings.cache_n, r.timings.prompt_n, r.timings.predicted_n) == (0, 10, 5)
    assert len(r.tokens) == 5 and r.text == c.text
    # the slot holds the prompt and the 4 generated tokens that were decoded
    assert e.slots[r.id_slot].tokens == list(range(10)) + r.tokens[:4]


def test_second_request_reuses_common_prefix():
    e, b = make_engine()
    t1, c1 = task(range(100), max_tokens=3)
    run(e, t1)
    prompt2 = list(range(60)) + [500, 501]
    t2, c2 = task(prompt2, max_tokens=3)
    run(e, t2)
    assert c2.result.id_slot == c1.result.id_slot
    assert (c2.result.timings.cache_n, c2.result.timings.prompt_n) == (60, 2)


def test_identical_prompt_reevaluates_only_last_token():
    e, b = make_engine()
    t1, _ = task(range(40), max_tokens=1)
    run(e, t1)
    t2, c2 = task(range(40), max_tokens=1)
    run(e, t2)
    assert (c2.result.timings.cache_n, c2.result.timings.prompt_n) == (39, 1)


def test_cache_prompt_false_reprocesses():
    e, _ = make_engine()
    run(e, task(range(40), max_tokens=1)[0])
    t2, c2 = task(range(40), max_tokens=1, cache_prompt=False)
    run(e, t2)
    assert (c2.result.timings.cache_n, c2.result.timings.prompt_n) == (0, 40)


def test_concurrent_tasks_share_decode_steps():
    e, b = make_engine()
    ts = [task([i] * 20, max_tokens=10) for i in range(4)]
    run(e, *(t for t, _ in ts))
    assert all(c.result.timings.predicted_n == 10 for _, c in ts)
    # 1 step prefill for all four + 9 generation steps: each batch carries all four slots
    multi = [d for d in b.decodes if len({s for s, _, _ in d}) == 4]
    assert len(multi) >= 9


def test_long_prefill_does_not_starve_generation():
    e, b = make_engine(n_batch=64)
    t1, c1 = task([1] * 10, max_tokens=30)
    e.waiting.append(t1)
    e.step()  # t1 prefilled, first token sampled
    t2, c2 = task([2] * 600, max_tokens=2)
    e.waiting.append(t2)
    gen_seq = c1_slot = None
    for _ in range(5):
        e.step()
        d = b.decodes[-1]
        seqs = [s for s, _, _ in d]
        c1_slot = e.slots[0] if e.slots[0].task is t1 else e.slots[1]
        gen_seq = c1_slot.id
        assert seqs.count(gen_seq) == 1  # one token for the generating slot in every batch
        assert len(d) == 64  # the rest of the batch goes to the prefill
    run(e)
    assert c1.result.timings.predicted_n == 30 and c2.result.timings.prompt_n == 600


def test_more_tasks_than_slots_wait_fifo():
    e, b = make_engine(n_seq=2)
    ts = [task([i + 1] * 5, max_tokens=3) for i in range(5)]
    for t, _ in ts:
        e.waiting.append(t)
    e.step()
    assert [t.id for t in e.waiting] == [ts[2][0].id, ts[3][0].id, ts[4][0].id]
    assert len(e.waiting) == 3
    run(e)
    assert all(c.result is not None for _, c in ts)
    starts = [c.result.t_queue_ms for _, c in ts]
    assert starts[2] <= starts[3] <= starts[4]


def test_cancel_running_frees_slot_next_step():
    e, b = make_engine(n_seq=1)
    t1, c1 = task([1] * 5, max_tokens=1000)
    t2, c2 = task([2] * 5, max_tokens=2)
    e.waiting.extend([t1, t2])
    for _ in range(3):
        e.step()
    assert e.slots[0].task is t1
    t1.cancel()
    e.step()
    assert c1.result.finish is FinishReason.CANCELLED
    assert e.slots[0].task is t2
    run(e)
    assert c2.result.finish is FinishReason.LENGTH
    assert all(smp.freed for smp in b.samplers)


def test_cancelled_waiting_task_never_takes_a_slot():
    e, b = make_engine(n_seq=1)
    t1, c1 = task([1] * 5, max_tokens=3)
    t2, c2 = task([2] * 5, max_tokens=3)
    e.waiting.extend([t1, t2])
    e.step()
    t2.cancel()
    run(e)
    assert c2.events == [] and not any(2 in [tok for _, _, tok in d] for d in b.decodes)


def test_id_slot_busy_waits_but_others_proceed():
    e, b = make_engine(n_seq=2)
    t1, c1 = task([1] * 5, max_tokens=5, id_slot=0)
    t2, c2 = task([2] * 5, max_tokens=2, id_slot=0)
    t3, c3 = task([3] * 5, max_tokens=2)
    e.waiting.extend([t1, t2, t3])
    e.step()
    assert e.slots[0].task is t1 and e.slots[1].task is t3
    run(e)
    assert c2.result.id_slot == 0


def test_eog_ends_with_stop_and_is_not_text():
    e, b = make_engine()
    b.scripts[5] = [3, 4, EOG]
    t, c = task([1] * 5, max_tokens=10)
    run(e, t)
    assert c.result.finish is FinishReason.STOP
    assert c.result.timings.predicted_n == 3 and c.result.tokens == [3, 4]
    assert c.text == "de"


def test_stop_string_ends_and_is_not_emitted():
    e, b = make_engine()
    b.scripts[5] = [0, 1, 2, 3, 4, 5]  # "abcdef"
    t, c = task([1] * 5, max_tokens=10, stop=["cd"])
    run(e, t)
    assert c.result.finish is FinishReason.STOP and c.result.stop_word == "cd"
    assert c.text == "ab" and c.result.text == "ab"


def test_context_full_ends_with_length():
    e, b = make_engine(n_ctx=64, n_seq=1)
    t, c = task([1] * 50, max_tokens=-1)
    run(e, t)
    assert c.result.finish is FinishReason.LENGTH
    assert len(e.slots[0].tokens) <= 64


def test_no_kv_room_frees_idle_slot_then_retries():
    e, b = make_engine(n_ctx=120, n_seq=2)
    t1, c1 = task(range(100), max_tokens=1)
    run(e, t1)
    assert len(e.slots[0].tokens) == 100
    t2, c2 = task([7] * 60, max_tokens=2, id_slot=1)
    run(e, t2)
    assert c2.result.finish is FinishReason.LENGTH and c2.result.timings.predicted_n == 2
    assert e.slots[0].tokens == [] and e.slots[0].idle  # the idle slot gave its cells


def test_decode_error_fails_only_that_task():
    e, b = make_engine(n_seq=1)
    b.fail_next = [-1]
    t1, c1 = task([1] * 5, max_tokens=2)
    run(e, t1)
    assert c1.error is not None and c1.error.status == 500
    t2, c2 = task([1] * 5, max_tokens=2)
    run(e, t2)
    assert c2.result.finish is FinishReason.LENGTH
    assert e.slots[0].state is SlotState.IDLE


def test_decode_exception_fails_one_task_and_engine_keeps_running():
    e, b = make_engine(n_seq=1)
    calls = {"n": 0}
    orig = b.decode

    def flaky(start, count):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("boom")
        return orig(start, count)

    b.decode = flaky
    t1, c1 = task([1] * 5, max_tokens=2)
    run(e, t1)
    assert c1.error.status == 500
    t2, c2 = task([1] * 5, max_tokens=2)
    run(e, t2)
    assert c2.result.finish is FinishReason.LENGTH


def test_dead_engine_fails_pending_tasks_and_refuses_new_ones():
    import time as _time

    import pytest

    from server.engine.engine import EngineDead

    e, b = make_engine(n_seq=1)

    def broken():
        raise RuntimeError("scheduler bug")

    e._admit = broken
    e.start()
    t1, c1 = task([1] * 5, max_tokens=2)
    e.submit(t1)
    deadline = _time.time() + 5
    while e.alive and _time.time() < deadline:
        _time.sleep(0.01)
    assert not e.alive
    assert c1.error is not None and c1.error.status in (500, 503)
    with pytest.raises(EngineDead):
        e.submit(task([1], max_tokens=1)[0])


def test_max_tokens_zero_processes_the_prompt_only():
    e, b = make_engine()
    t, c = task(range(1, 30), max_tokens=0)
    run(e, t)
    r = c.result
    assert (r.finish, r.timings.prompt_n, r.timings.predicted_n, c.text) == (
        FinishReason.LENGTH,
        29,
        0,
        "",
    )
    assert e.slots[r.id_slot].tokens == list(range(1, 30))


def test_stream_chunks_carry_each_token_once_even_when_text_is_held():
    from server.task import TextChunk

    e, b = make_engine()
    b.scripts[5] = [0, 1, 2, 3, 4]  # "abcde"; "c" is held as a prefix of "cx", then released
    t, c = task([1] * 5, max_tokens=5, stop=["cx", "ez"])
    t.gen.logprobs = True
    run(e, t)
    chunks = [ev for ev in c.events if isinstance(ev, TextChunk)]
    assert [ch.text for ch in chunks] == ["a", "b", "cd", "e"]
    assert [ch.tokens for ch in chunks] == [[0], [1], [2, 3], [4]]
    assert [lp.token for ch in chunks for lp in ch.logprobs] == [0, 1, 2, 3, 4]


def test_llama_cpp_python_pin_agrees():
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    pins = [
        re.search(r"llama-cpp-python==([\w.]+)", (root / f).read_text()).group(1)
        for f in ("requirements.txt", "pyproject.toml")
    ]
    assert pins[0] == pins[1]
