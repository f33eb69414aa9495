"""--cache-reuse bounds (issue 40), with the fake backend: a placement decodes nothing and
moves at most MOST_CHUNKS chunks, a chunk after a gap only when it saves GAPPED_MIN tokens;
the gaps are decoded by the normal step (one decode per step, batched with the other slots,
which get their token in every one); a cancelled run stops at the next step and leaves the
scratch sequence empty. Integrity is checked after every step (scratch cells included)."""

from __future__ import annotations

from server.engine.cache_reuse import GAPPED_MIN, MOST_CHUNKS
from server.engine.engine import Engine, EngineOptions
from server.slot.slot import SlotState
from server.task import Task
from tests.fake_backend import FakeBackend
from tests.unit.helpers import run, task

N = 3000
CACHED = list(range(1000, 1000 + N))


def engine(n_batch: int = 512) -> tuple[Engine, FakeBackend]:
    b = FakeBackend(n_seq=2, n_ctx=32768, n_batch=n_batch, scratch=True)
    return Engine(b, EngineOptions(cache_reuse=64)), b


def warm(e: Engine, slot: int = 0, tokens: list[int] = CACHED) -> None:
    t, _ = task(tokens, max_tokens=1, id_slot=slot)
    run(e, t)


def steps_of(e: Engine, b: FakeBackend, *tasks: Task, max_steps: int = 500) -> list[int]:
    """Queue ``tasks`` and step until the engine has no work: decodes per step."""
    e.waiting.extend(tasks)
    per_step = []
    while e._has_work() and len(per_step) < max_steps:
        n = len(b.decodes)
        e.step()
        per_step.append(len(b.decodes) - n)
        assert e.check_integrity() == []
    return per_step


def reuse_task(prompt: list[int], n_cache_reuse: int, max_tokens: int = 1, slot: int = 0):
    t, c = task(prompt, max_tokens=max_tokens, id_slot=slot)
    t.gen.n_cache_reuse = n_cache_reuse
    return t, c


def assert_kv_is(b: FakeBackend, slot: int, tokens: list[int]) -> None:
    assert {p: b.kv[slot][p] for p in range(len(tokens))} == dict(enumerate(tokens))


def test_every_other_token_substituted_costs_no_placement_decodes():
    # the case: 1-token chunks between 1-token gaps, n_cache_reuse 1
    e, b = engine()
    warm(e)
    prompt = [t if i % 2 == 0 else 7 for i, t in enumerate(CACHED)]
    t, c = reuse_task(prompt, 1)
    per_step = steps_of(e, b, t)
    assert max(per_step) == 1  # main: one decode per gap, all in the admission step
    r = c.result
    assert r is not None and r.timings.cache_reuse_n == 0  # nothing worth a step
    assert r.timings.cache_n == 1 and r.timings.prompt_n == N - 1
    assert sum(per_step) == -(-(N - 1) // b.n_batch)  # the prompt in batches, as a cold one
    assert b.kv[b.scratch_seq] == {}
    assert_kv_is(b, 0, prompt)


def test_many_gapped_chunks_are_capped_and_decoded_by_the_step():
    # an insertion every 48 tokens: ~62 chunks of 47 (>= GAPPED_MIN), n_cache_reuse 16
    assert GAPPED_MIN <= 47
    e, b = engine()
    warm(e)
    prompt: list[int] = []
    for i in range(0, N, 47):
        prompt += [5] + CACHED[i : i + 47]
    t, c = reuse_task(prompt, 16)
    per_step = steps_of(e, b, t)
    r = c.result
    assert r is not None
    assert r.timings.cache_reuse_chunks == MOST_CHUNKS  # main: every chunk, ~62
    assert r.timings.cache_reuse_n == MOST_CHUNKS * 47
    assert r.timings.cache_n + r.timings.prompt_n == len(prompt)
    assert max(per_step) == 1  # main: the gaps decoded one by one at placement
    # one step per gap before a moved chunk, then the rest of the prompt in batches
    rest = len(prompt) - (MOST_CHUNKS * 48)
    assert sum(per_step) == MOST_CHUNKS + -(-rest // b.n_batch)
    assert b.kv[b.scratch_seq] == {}
    assert_kv_is(b, 0, prompt)


def test_a_window_cache_moves_one_run_of_chunks():
    # --swa-full: parked cells a window below the scratch's end may be given away
    e, b = engine()
    b.kv_kinds = ("full", "swa")
    e = Engine(b, EngineOptions(cache_reuse=64))
    warm(e)
    prompt: list[int] = []
    for i in range(0, N, 47):
        prompt += [5] + CACHED[i : i + 47]
    t, c = reuse_task(prompt, 16)
    per_step = steps_of(e, b, t)
    assert c.result is not None and c.result.timings.cache_reuse_chunks == 1
    assert max(per_step) == 1
    assert_kv_is(b, 0, prompt)


def test_another_slot_gets_a_token_in_every_decode_while_chunks_move_in():
    e, b = engine()
    warm(e)
    other, oc = task(list(range(50, 80)), max_tokens=400, id_slot=1)
    e.waiting.append(other)
    while e.slots[1].state is not SlotState.GENERATE:
        e.step()
    prompt: list[int] = []
    for i in range(0, 40 * 47, 47):
        prompt += [5] + CACHED[i : i + 47]
    t, c = reuse_task(prompt, 16)
    first = len(b.decodes)
    per_step = steps_of(e, b, t)
    assert max(per_step) == 1
    assert c.result is not None and c.result.timings.cache_reuse_chunks == MOST_CHUNKS
    assert oc.result is not None
    # slot 1 generated one token in every decode until it ended, slot 0's prompt (and
    # its gaps) were all decoded meanwhile (main: the gaps at placement, without slot 1)
    mine = b.decodes[first:]
    ones = [sum(1 for s, _, _ in d if s == 1) for d in mine]
    end = ones.index(0) if 0 in ones else len(mine)
    assert set(ones[:end]) == {1}
    zeros = [i for i, d in enumerate(mine) if any(s == 0 for s, _, _ in d)]
    assert len(zeros) > MOST_CHUNKS and zeros[-1] < end


def test_a_cancelled_run_stops_at_the_next_step():
    e, b = engine()
    warm(e)
    prompt: list[int] = []
    for i in range(0, N, 47):
        prompt += [5] + CACHED[i : i + 47]
    t, c = reuse_task(prompt, 16)
    decode = b.decode
    cancelled_at: list[int] = []

    def decode_then_leave(start: int, count: int) -> int:
        ret = decode(start, count)
        if not cancelled_at and any(s == 0 for s, _, _ in b.decodes[-1]):
            t.cancel()  # the client leaves after the first decode of its prompt
            cancelled_at.append(len(b.decodes))
        return ret

    b.decode = decode_then_leave  # type: ignore[method-assign]
    steps_of(e, b, t)
    assert cancelled_at == [len(b.decodes)]  # main: the placement went on decoding gaps
    assert e.slots[0].idle and c.result is not None
    assert c.result.timings.cache_reuse_chunks <= 1
    assert e.stats.cache_reuse_chunks <= 1
    assert b.kv[b.scratch_seq] == {} and e.reuse.owner is None
    held = e.slots[0].tokens
    assert held == prompt[: len(held)]
    assert_kv_is(b, 0, held)


def test_one_run_holds_the_scratch_sequence_at_a_time():
    e, b = engine()
    other = list(range(9000, 9000 + 600))
    warm(e, 0)
    warm(e, 1, other)
    p0 = [1000, 5] + CACHED[1:500]
    p1 = [9000, 5] + other[1:500]
    t0, c0 = reuse_task(p0, 16, slot=0)
    t1, c1 = reuse_task(p1, 16, slot=1)
    steps_of(e, b, t0, t1)
    assert c0.result is not None and c1.result is not None
    assert c0.result.timings.cache_reuse_n == 498  # its chunk, but the last prompt token
    assert c1.result.timings.cache_reuse_n == 0  # the scratch was busy: prefix only
    assert c1.result.timings.cache_n == 1
    assert b.kv[b.scratch_seq] == {}
    assert_kv_is(b, 0, p0)
    assert_kv_is(b, 1, p1)


def test_integrity_sees_a_stray_scratch_cell():
    e, b = engine()
    warm(e)
    b.kv[b.scratch_seq][5] = 1
    assert any("sequence 2" in p for p in e.check_integrity())


def test_a_failed_move_computes_the_rest_and_frees_the_scratch():
    e, b = engine()
    warm(e)
    prompt: list[int] = []
    for i in range(0, 10 * 47, 47):
        prompt += [5] + CACHED[i : i + 47]
    place = e.store.place_chunk
    calls: list[int] = []

    def fail_second(*args):
        calls.append(1)
        return len(calls) != 2 and place(*args)

    e.store.place_chunk = fail_second  # type: ignore[method-assign]
    t, c = reuse_task(prompt, 16)
    per_step = steps_of(e, b, t)
    assert max(per_step) == 1 and len(calls) == 2
    r = c.result
    assert r is not None and r.timings.cache_reuse_chunks == 1
    assert r.timings.cache_n + r.timings.prompt_n == len(prompt)
    assert b.kv[b.scratch_seq] == {} and e.reuse.owner is None
    assert_kv_is(b, 0, prompt)
