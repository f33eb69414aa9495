"""A sliding-window state widened by a checkpoint's older cells and the checkpoint cut back
out (server.llama.state_bytes), on states in llama.cpp's layout built by hand: every row
names its layer and position, so each cell's bytes can be followed through."""

from __future__ import annotations

import struct

import pytest

from server.kv.audit import seq_state_problem
from server.llama.kv_state import read_caches
from server.llama.state_bytes import narrow, widen, window_shape
from server.tiers import slot_file
from server.types import CacheCells, Checkpoint

K_ROW, V_ROW, N_LAYER, N_SWA = 8, 4, 2, 40
HEADER = struct.pack("<Ii", 0xAF143CD8, 0)


def _k(layer: int, pos: int) -> bytes:
    return struct.pack("<ii", layer, pos)


def _v(layer: int, pos: int) -> bytes:
    return struct.pack("<hh", layer, pos)


def _cache(positions: list[int], k_row: int = K_ROW, v_trans: int = 0) -> bytes:
    """One single-stream cache, its cells in the given (cell index) order."""
    out = struct.pack("<II", 1, len(positions))
    out += b"".join(struct.pack("<iIi", p, 1, 0) for p in positions)
    out += struct.pack("<II", v_trans, N_LAYER)
    for layer in range(N_LAYER):
        rows = b"".join(_k(layer, p).ljust(k_row, b"\0") for p in positions)
        out += struct.pack("<iQ", 1, k_row) + rows
    for layer in range(N_LAYER):
        out += struct.pack("<iQ", 1, V_ROW) + b"".join(_v(layer, p) for p in positions)
    return out


def _rows_by_pos(data: bytes, n_caches: int) -> dict[tuple[str, int, int], bytes]:
    """The window cache's K and V rows, by (K or V, layer, position)."""
    caches, end = read_caches(data, ("full", "swa")[-n_caches:])
    assert end == len(data)
    pos = caches[-1].pos
    rows: dict[tuple[str, int, int], bytes] = {}
    at = data.index(struct.pack("<II", 0, N_LAYER), len(data) - _window_size(len(pos))) + 8
    for kind, size in (("k", K_ROW), ("v", V_ROW)):
        for layer in range(N_LAYER):
            at += 12
            for p in pos:
                rows[(kind, layer, p)] = data[at : at + size]
                at += size
    return rows


def _window_size(n: int) -> int:
    return 8 + 12 * n + 8 + N_LAYER * (24 + n * (K_ROW + V_ROW))


# the live window wrapped in its cell ring: positions 80..99 sit before 60..79
STATE_WINDOW = list(range(80, 100)) + list(range(60, 80))
STATE = HEADER + _cache(list(range(100))) + _cache(STATE_WINDOW)
# a checkpoint 4 tokens before the end: the window of position 95 (cells 56..95)
CKPT = HEADER + _cache(list(range(76, 96)) + list(range(56, 76)))


def _joined(pieces: list) -> bytes:
    return b"".join(bytes(p) for p in pieces)


# the same window, its older cells not side by side in the ring (gathered, not one view)
SCATTERED = [58, 59, *range(60, 96), 56, 57]


@pytest.mark.parametrize(
    ("ckpt", "added"),
    [(CKPT, [56, 57, 58, 59]), (HEADER + _cache(SCATTERED), [58, 59, 56, 57])],
)
def test_widen_adds_the_checkpoints_older_cells_to_the_window(ckpt: bytes, added: list[int]):
    wide = _joined(widen(memoryview(STATE), 2, memoryview(ckpt), max_cells=64))
    caches, end = read_caches(wide, ("full", "swa"))
    assert end == len(wide) and caches[0].pos == list(range(100))
    assert caches[1].pos == STATE_WINDOW + added  # the state's cells, then the added
    rows = _rows_by_pos(wide, 2)
    assert all(rows[("k", lay, p)] == _k(lay, p) for lay in range(N_LAYER) for p in range(56, 100))
    assert all(rows[("v", lay, p)] == _v(lay, p) for lay in range(N_LAYER) for p in range(56, 100))
    # the widened state passes the restore's proof: one run of positions, ending at n - 1
    assert seq_state_problem(caches, 100, N_SWA) is None


def test_narrow_cuts_the_checkpoint_back_out_of_a_widened_state():
    wide = _joined(widen(memoryview(STATE), 2, memoryview(CKPT), max_cells=64))
    got = narrow(memoryview(wide), 2, 96, N_SWA)
    assert got is not None
    (cells,), end = read_caches(bytes(got), ("swa",))
    assert end == len(got) and sorted(cells.pos) == list(range(56, 96))
    assert _rows_by_pos(bytes(got), 1) == _rows_by_pos(CKPT, 1)
    assert narrow(memoryview(STATE), 2, 96, N_SWA) is None  # the plain state lacks 56..59


def test_widen_refuses_what_would_not_be_one_window_or_not_fit():
    state, ckpt = memoryview(STATE), memoryview(CKPT)
    assert widen(state, 2, ckpt, max_cells=43) is None  # 44 cells would not surely fit
    gap = HEADER + _cache(list(range(10, 50)))  # the window of position 49: 50..59 missing
    assert widen(state, 2, memoryview(gap), max_cells=200) is None
    inside = HEADER + _cache(list(range(60, 100)))  # nothing older than the state's window
    assert widen(state, 2, memoryview(inside), max_cells=200) is None
    other_rows = HEADER + _cache(list(range(56, 96)), k_row=16)  # another -ctk
    assert widen(state, 2, memoryview(other_rows), max_cells=200) is None
    transposed = HEADER + _cache(list(range(100))) + _cache(STATE_WINDOW, v_trans=1)
    assert widen(memoryview(transposed), 2, ckpt, max_cells=200) is None


def test_a_slot_file_carries_the_checkpoint_in_its_window_unless_it_has_draft_state():
    shape = window_shape(("full", "swa"), N_SWA, n_ubatch=24)
    assert shape is not None and shape.max_cells == 64
    ck = Checkpoint(96, 56, 95, bytearray(CKPT))
    body, rest = slot_file.widened_body(memoryview(STATE), [ck], shape)
    assert (
        rest == []
        and _joined(body) == _joined(widen(memoryview(STATE), 2, memoryview(CKPT), 64))[8:]
    )
    with_draft = Checkpoint(96, 56, 95, bytearray(CKPT), b"draft")
    body, rest = slot_file.widened_body(memoryview(STATE), [with_draft], shape)
    assert rest == [with_draft] and _joined(body) == STATE[8:]
    assert window_shape(("full",), 0, 512) is None and window_shape(("full", "swa"), 0, 512) is None


def test_a_restored_window_with_a_hole_is_refused():
    holed = [CacheCells("full", list(range(100)), [(0,)] * 100)]
    window = list(range(56, 70)) + list(range(72, 100))
    holed.append(CacheCells("swa", window, [(0,)] * len(window)))
    assert "one run" in seq_state_problem(holed, 100, N_SWA)
