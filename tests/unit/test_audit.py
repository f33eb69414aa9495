"""Cell-level KV audits: the state reader (llama.cpp's layout, built by hand here) and the
checks that a state or the whole cache holds exactly what the slots account for."""

from __future__ import annotations

import struct

import pytest

from server.kv.audit import kv_problems, seq_state_problem
from server.llama.backend import window_cache_slides
from server.llama.kv_state import StateFormatError, read_caches
from server.types import CacheCells

from .helpers import make_engine, run, task

K_ROW, V_ROW, N_LAYER = 6, 4, 2


def _cache_bytes(cells: list[tuple[int, tuple[int, ...]]], n_stream: int = 1) -> bytes:
    """One cache as llama_kv_cache::state_write lays it out (first stream holds the cells)."""
    out = struct.pack("<I", n_stream)
    for s in range(n_stream):
        group = cells if s == 0 else []
        out += struct.pack("<I", len(group))
        if not group:
            continue
        for pos, seqs in group:
            out += struct.pack("<iI", pos, len(seqs)) + b"".join(struct.pack("<i", q) for q in seqs)
        out += struct.pack("<II", 0, N_LAYER)
        for _ in range(N_LAYER):
            out += struct.pack("<iQ", 1, K_ROW) + b"k" * K_ROW * len(group)
        for _ in range(N_LAYER):
            out += struct.pack("<iQ", 1, V_ROW) + b"v" * V_ROW * len(group)
    return out


def _seq_state(*caches: bytes) -> bytes:
    return struct.pack("<Ii", 0xAF143CD8, 0) + b"".join(caches)


def test_reader_reads_cells_of_both_caches_and_where_the_state_ends():
    full = _cache_bytes([(p, (0,)) for p in range(5)])
    swa = _cache_bytes([(p, (0,)) for p in range(3, 5)], n_stream=2)
    data = _seq_state(full, swa) + b"APPENDIX"
    caches, end = read_caches(data, ("full", "swa"))
    assert [c.kind for c in caches] == ["full", "swa"]
    assert caches[0].pos == [0, 1, 2, 3, 4] and caches[1].pos == [3, 4]
    assert data[end:] == b"APPENDIX"


def test_reader_reads_a_whole_context_state_with_shared_cells():
    arch = b"gemma3"
    cache = _cache_bytes([(0, (0, 1)), (1, (0, 1)), (2, (1,))])
    data = struct.pack("<I", len(arch)) + arch + cache
    (c,), end = read_caches(data, ("full",), whole_context=True)
    assert end == len(data)
    assert c.positions_of(0) == [0, 1] and c.positions_of(1) == [0, 1, 2]


@pytest.mark.parametrize("cut", [3, 10, 20, 40])
def test_reader_refuses_truncated_states(cut):
    data = _seq_state(_cache_bytes([(p, (0,)) for p in range(5)]))
    with pytest.raises(StateFormatError):
        read_caches(data[:cut], ("full",))


def _cells(kind: str, pos: list[int], seq: int = 0) -> CacheCells:
    return CacheCells(kind, list(pos), [(seq,)] * len(pos))


def test_a_state_must_hold_exactly_its_tokens_positions():
    ok = [_cells("full", range(100)), _cells("swa", range(60, 100))]
    assert seq_state_problem(ok, 100, n_swa=40) is None
    # the crafted states of the leak: a real state with an empty or wrong token list
    assert seq_state_problem(ok, 0, n_swa=40) is not None
    assert seq_state_problem(ok, 51, n_swa=40) is not None
    # thousands of cells at repeated positions pass pos_min/pos_max checks, not this one
    repeated = [_cells("full", list(range(51)) * 60), _cells("swa", range(11, 51))]
    assert "3060 cells" in seq_state_problem(repeated, 51, n_swa=40)
    # a window cache that misses what the next token attends to
    assert "window" in seq_state_problem([_cells("swa", range(70, 100))], 100, n_swa=40)


def test_kv_problems_count_cells_per_slot_and_find_cells_of_no_slot():
    full = CacheCells("full")
    for p in range(10):  # slots 0 and 1 share a 10-token prefix
        full.pos.append(p)
        full.seqs.append((0, 1))
    assert kv_problems([full], [10, 10]) == []
    assert kv_problems([full], [10, None]) == []  # a slot mid-decode is not judged
    problems = kv_problems([full], [10, 4])
    assert problems == ["slot 1: the full cache holds 10 cells at 0..9 for 4 tokens"]
    full.pos.append(3)
    full.seqs.append((7,))
    assert "1 full-cache cells belong to no slot" in kv_problems([full], [10, 10])


def test_shared_window_cells_are_a_problem_only_where_the_window_cache_slides():
    swa = CacheCells("swa")
    for p in range(10):  # slots 0 and 1 share a 10-token prefix's window cells
        swa.pos.append(p)
        swa.seqs.append((0, 1))
    assert kv_problems([swa], [10, 10]) == []
    got = kv_problems([swa], [10, 10], window_slides=True)
    assert got == ["10 swa-cache cells belong to several sequences"]


def test_window_cache_slides_where_llama_cpp_makes_it_smaller_than_the_context():
    # GGML_PAD(min(n_ctx, n_swa * n_seq_max + n_ubatch), 256) cells against n_ctx
    assert window_cache_slides(512, 32768, 4, 512, True)  # 2,560 cells
    assert window_cache_slides(512, 8192, 4, 512, True)
    assert not window_cache_slides(512, 2560, 4, 512, True)  # as large as the context
    assert not window_cache_slides(512, 512, 2, 512, True)
    assert not window_cache_slides(0, 8192, 4, 512, True)  # no window, or --swa-full
    assert window_cache_slides(512, 8192, 4, 512, False)  # one sequence's: 1,024 cells
    assert not window_cache_slides(300, 1024, 1, 512, True)  # 812 padded to 1,024


def test_engine_integrity_sees_cells_no_slot_accounts_for():
    e, b = make_engine(n_seq=2)
    t, c = task(range(1, 40), max_tokens=4)
    run(e, t)
    assert c.result is not None and e.check_integrity() == []
    b.stray_cells = [(1, p) for p in range(5)]  # slot 1 holds no tokens
    assert any("slot 1" in p for p in e.check_integrity())
