"""--cache-reuse with the fake backend: chunks of the cached sequence moved into place (the
fake KV holds each position's token, so the slot's KV is checked cell by cell against the
new prompt), gaps computed, counts in timings and stats, integrity after every step, and
no effect where the memory cannot shift or the option is off."""

from __future__ import annotations

from server.engine.engine import Engine, EngineOptions
from tests.fake_backend import FakeBackend
from tests.unit.helpers import run, task

HEAD = list(range(1, 31))
MID = list(range(400, 440))
TAIL = list(range(500, 560))


def engine(n_reuse: int = 8, scratch: bool = True, can_shift: bool = True):
    b = FakeBackend(n_seq=2, scratch=scratch)
    b.can_shift = can_shift
    return Engine(b, EngineOptions(cache_reuse=n_reuse)), b


def twice(e: Engine, first: list[int], second: list[int]):
    t1, _ = task(first, max_tokens=1, id_slot=0)
    run(e, t1)
    t2, c2 = task(second, max_tokens=1, id_slot=0)
    decodes = len(e.b.decodes)  # type: ignore[attr-defined]
    run(e, t2)
    return c2.result, e.b.decodes[decodes:]  # type: ignore[attr-defined]


def test_deleted_middle_reuses_the_tail():
    e, b = engine()
    r, decodes = twice(e, HEAD + MID + TAIL, HEAD + TAIL)
    t = r.timings
    assert (t.cache_reuse_n, t.cache_reuse_chunks) == (len(TAIL) - 1, 1)
    assert t.cache_n == len(HEAD) + len(TAIL) - 1 and t.prompt_n == 1
    held = e.slots[0].tokens
    assert held[: len(HEAD + TAIL)] == HEAD + TAIL
    assert {p: b.kv[0][p] for p in range(len(held))} == dict(enumerate(held))
    assert b.kv[b.scratch_seq] == {}
    assert e.stats.cache_reuse_tokens == len(TAIL) - 1
    # only the last prompt token and the sampled one were decoded
    assert [len(d) for d in decodes] == [1]


def test_substitution_near_the_start_computes_the_gap():
    e, b = engine()
    first = [1, 2, 47, 11, 12, 13] + MID + TAIL
    second = [1, 2, 9] + MID + TAIL
    r, decodes = twice(e, first, second)
    t = r.timings
    assert t.cache_reuse_chunks == 1 and t.cache_reuse_n == len(MID + TAIL) - 1
    assert t.prompt_n == 2  # the gap (9) and the last prompt token
    assert t.cache_n + t.prompt_n == len(second)
    assert decodes[0] == [(0, 2, 9)]  # the gap decoded before the chunk moved in
    assert dict(list(b.kv[0].items())[: len(second)]) == dict(enumerate(second))


def test_insertion_moves_the_chunk_up():
    e, b = engine()
    ins = list(range(700, 720))
    r, _ = twice(e, HEAD + TAIL, HEAD + ins + TAIL)
    t = r.timings
    assert t.cache_reuse_n == len(TAIL) - 1 and t.prompt_n == len(ins) + 1
    held = e.slots[0].tokens
    assert held[: len(HEAD + ins + TAIL)] == HEAD + ins + TAIL
    assert {p: b.kv[0][p] for p in range(len(held))} == dict(enumerate(held))


def test_off_without_shift_without_scratch_or_per_request_zero():
    for kw in ({"n_reuse": 0}, {"can_shift": False}, {"scratch": False}):
        e, _ = engine(**kw)  # type: ignore[arg-type]
        r, _ = twice(e, HEAD + MID + TAIL, HEAD + TAIL)
        assert r.timings.cache_n == len(HEAD) and r.timings.cache_reuse_n == 0
    e, _ = engine()
    t1, _ = task(HEAD + MID + TAIL, max_tokens=1, id_slot=0)
    run(e, t1)
    t2, c2 = task(HEAD + TAIL, max_tokens=1, id_slot=0)
    t2.gen.n_cache_reuse = 0
    run(e, t2)
    assert c2.result.timings.cache_n == len(HEAD)


def test_other_tenants_tokens_are_not_reused():
    e, _ = engine()
    t1, _ = task(HEAD + MID + TAIL, max_tokens=1, id_slot=0, tenant="a")
    run(e, t1)
    t2, c2 = task(HEAD + TAIL, max_tokens=1, id_slot=0, tenant="b")
    run(e, t2)
    assert c2.result.timings.cache_n == 0 and c2.result.timings.cache_reuse_n == 0


def test_cells_shared_with_another_slot_are_not_moved():
    e, b = engine()
    t1, _ = task(HEAD + MID + TAIL, max_tokens=1, id_slot=0)
    run(e, t1)
    # slot 1 holds the whole sequence too (its cells may be shared): slot 0 keeps its LCP only
    b.seq_cp(0, 1, 0, len(e.slots[0].tokens))
    e.slots[1].seq.assign(list(e.slots[0].tokens))
    t2, c2 = task(HEAD + TAIL, max_tokens=1, id_slot=0)
    run(e, t2)
    assert c2.result.timings.cache_reuse_n == 0
