"""llama.cpp's one-sequence state bytes, read without llama.cpp (a leaf: the slot-file
format and the restore plan use it too): a bounds-checked ``Reader`` (``kv_state`` reads
the cell lists with it), and a sliding-window state widened by a checkpoint's older cells,
and the checkpoint cut back out of it (ARCHITECTURE §8).

Why: llama.cpp writes a sequence's window cells only where its last position still sees them
(llama_kv_cache::state_write), so a state saved at n tokens holds positions n - n_swa .. n-1
and serves a cut only at n. The checkpoint a slot file carries (4 tokens before the prompt's
end, ``checkpoints.file_checkpoints``) holds the window behind that cut: n_swa cells, most
of them the state's own. Written as a second copy it costs a whole window (7.5 MiB for Gemma
3 270M, a third of a 4,000-token file); the cells the state lacks are only the few between
the checkpoint's window and the state's (the answer and 4 prompt tokens).

``widen``: the state with those cells added to its window section (as pieces to write, the
state's bytes not copied). llama.cpp loads any cell list (llama_kv_cache::state_read_meta
places each cell at its position), so the file stays one llama.cpp loads, and the restored
window reaches back to the checkpoint: a cut there is served without it
(``policy.window_intact`` on the sequence's live pos_min). ``narrow``: the checkpoint's own
bytes, rebuilt from a widened state, for a restored slot that later goes to the RAM cache.

Only a single-stream window cache with row-major V (flash attention; llama.cpp's transposed
V would need a piece per embedding element) is widened; anything else gets None and the
caller writes the checkpoint whole, as before.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

U32 = struct.Struct("<I")
I32 = struct.Struct("<i")
U64 = struct.Struct("<Q")


class StateFormatError(ValueError):
    """The bytes do not follow llama_kv_cache's state layout."""


class Reader:
    """Bounds-checked reads of ``buf`` from ``pos`` up to ``end``."""

    def __init__(self, buf: bytes | bytearray | memoryview, pos: int, end: int) -> None:
        self.buf, self.pos, self.end = buf, pos, end

    def take(self, st: struct.Struct) -> int:
        if self.pos + st.size > self.end:
            raise StateFormatError("truncated state")
        (v,) = st.unpack_from(self.buf, self.pos)
        self.pos += st.size
        return v

    def skip(self, n: int) -> None:
        if n < 0 or self.pos + n > self.end:
            raise StateFormatError("truncated state")
        self.pos += n


_HEADER = 8  # llama_state_seq_get_data's magic and sequence id


@dataclass(frozen=True)
class WindowShape:
    """What widening needs of a sliding-window model's context: the caches a state holds
    (the window's last), the window, and the most window cells a restore is sure to find
    free: llama_kv_cache_iswa sizes the window cache for n_swa cells a sequence plus one
    ubatch, and another sequence's cells its last position no longer sees are reused."""

    n_caches: int
    n_swa: int
    max_cells: int


def window_shape(kv_kinds: tuple[str, ...] | None, n_swa: int, n_ubatch: int) -> WindowShape | None:
    """The shape of a context whose state is a full cache then a window cache (None: no
    window, a full-size one (--swa-full, n_swa 0) or recurrent memory)."""
    if kv_kinds != ("full", "swa") or n_swa <= 0:
        return None
    return WindowShape(len(kv_kinds), n_swa, n_swa + n_ubatch)


_LAYER_HEAD = 12  # a layer's ggml type (i32) and row size (u64)


@dataclass
class _Section:
    """One cache's bytes in a state: its single stream's cell count at ``count_at``, its
    cell records from ``meta`` (``rec`` bytes each) at positions ``pos``, its layer
    header at ``layers_at`` and, per K layer then per V layer, (where its 12-byte header
    starts, its row size); it ends at ``end``."""

    count_at: int
    meta: int
    rec: int
    pos: np.ndarray
    layers_at: int = 0
    layers: list[tuple[int, int]] = field(default_factory=list)
    end: int = 0

    @property
    def count(self) -> int:
        return len(self.pos)


def _section(r: Reader, ext: bool) -> _Section | None:
    """The next cache's section (None: several streams, or row-major V it is not)."""
    if r.take(U32) != 1:
        return None
    count_at = r.pos
    count = r.take(U32)
    rec = 12 + (12 if ext else 0)
    meta = r.pos
    r.skip(count * rec)
    kind = np.dtype({"names": ["pos", "n"], "formats": ["<i4", "<u4"], "itemsize": rec})
    recs = np.frombuffer(r.buf, kind, count, meta)
    if count and not bool((recs["n"] == 1).all()):
        return None
    s = _Section(count_at, meta, rec, recs["pos"].copy())
    if not count:
        s.end = r.pos
        return s
    s.layers_at = r.pos
    v_trans, n_layer = r.take(U32), r.take(U32)
    if v_trans or n_layer > 4096:
        return None
    for _ in range(2 * n_layer):
        at = r.pos
        r.take(I32)
        size = r.take(U64)
        r.skip(count * size)
        s.layers.append((at, size))
    s.end = r.pos
    return s


def _sections(buf: memoryview, n_caches: int, end: int) -> list[_Section] | None:
    """Every cache's section of a one-sequence state (from its 8-byte header), with or
    without cell ext records (as kv_state.read_caches tries both)."""
    for ext in (False, True):
        r = Reader(buf, _HEADER, end)
        try:
            out = [_section(r, ext) for _ in range(n_caches)]
        except StateFormatError:
            continue
        sections = [s for s in out if s is not None]
        if r.pos == end and len(sections) == len(out):
            return sections
    return None


def _items(buf: memoryview | bytearray, start: int, size: int, count: int) -> np.ndarray:
    """The ``count`` items of ``size`` bytes at ``start`` in ``buf`` (a view, no copy)."""
    return np.frombuffer(buf, np.dtype((np.void, size)), count, start)


def _same_layout(a: _Section, b: _Section) -> bool:
    """Both sections' layers carry the same types and row sizes (one model, one -ctk/-ctv)."""
    if a.rec != b.rec or len(a.layers) != len(b.layers):
        return False
    return all(sa == sb for (_, sa), (_, sb) in zip(a.layers, b.layers, strict=True))


def widen(
    state: memoryview, n_caches: int, checkpoint: memoryview, max_cells: int
) -> list[bytes | memoryview] | None:
    """``state`` (a one-sequence state of ``n_caches`` caches, its window cache last, with
    its 8-byte header) as pieces to write whose window also holds ``checkpoint``'s cells
    below the state's window; None when the checkpoint's cells do not join the state's
    window without a gap, when the widened window would pass ``max_cells`` (what the
    window cache is sure to have free for a restore), or for a layout this does not widen.
    The state's bytes are views, never copied; the added cells are gathered."""
    body = _sections(state, n_caches, len(state))
    ck = _sections(checkpoint, 1, len(checkpoint))
    if not body or not ck or not body[-1].count or not ck[0].count:
        return None
    win, old = body[-1], ck[0]
    first = int(win.pos.min())
    idx = np.flatnonzero(old.pos < first)
    have = np.sort(old.pos[idx])
    if not len(idx) or win.count + len(idx) > max_cells or not _same_layout(win, old):
        return None
    if not np.array_equal(have, np.arange(first - len(have), first)):
        return None  # a gap or repeats between the two windows: not one window
    pick = _picker(checkpoint, idx)
    pieces: list[bytes | memoryview] = [
        state[: win.count_at],
        struct.pack("<I", win.count + len(idx)),
        state[win.meta : win.meta + win.count * win.rec],
        pick(old.meta, old.rec, old.count),
        state[win.layers_at : win.layers[0][0]],
    ]
    for (at, size), (ck_at, _) in zip(win.layers, old.layers, strict=True):
        pieces.append(state[at : at + _LAYER_HEAD + win.count * size])
        pieces.append(pick(ck_at + _LAYER_HEAD, size, old.count))
    pieces.append(state[win.end :])
    return pieces


def _picker(buf: memoryview, idx: np.ndarray) -> Callable[[int, int, int], bytes | memoryview]:
    """``pick(start, size, count)``: items ``idx`` of the ``count`` of ``size`` bytes at
    ``start`` in ``buf``. A run of consecutive items (a checkpoint's cells below a window
    usually are) is one view of ``buf``, no copy; others are gathered."""
    lo, hi = int(idx[0]), int(idx[-1]) + 1  # idx ascends, no repeats (flatnonzero's)
    if hi - lo == len(idx):
        return lambda start, size, count: buf[start + lo * size : start + hi * size]
    return lambda start, size, count: _items(buf, start, size, count)[idx].tobytes()


def narrow(state: memoryview, n_caches: int, n_tokens: int, n_swa: int) -> bytearray | None:
    """The window-only state a checkpoint at ``n_tokens`` holds (its ``data``: the 8-byte
    header and the window section of the cells at n_tokens - n_swa .. n_tokens - 1, those
    its next token sees), cut out of a widened ``state`` in one copy; None when ``state``
    is not a layout ``widen`` handles or lacks any of those cells."""
    body = _sections(state, n_caches, len(state))
    if not body or n_swa <= 0:
        return None
    win = body[-1]
    idx = np.flatnonzero((win.pos < n_tokens) & (win.pos >= n_tokens - n_swa))
    if len(idx) != min(n_swa, n_tokens):
        return None
    rows = sum(size for _, size in win.layers) * len(idx)
    head = state[win.layers_at : win.layers[0][0]]
    out = bytearray(
        _HEADER + 8 + len(idx) * win.rec + len(head) + len(win.layers) * _LAYER_HEAD + rows
    )
    at = _put(out, 0, state[:_HEADER])
    at = _put(out, at, struct.pack("<II", 1, len(idx)))
    at = _take_into(out, at, state, win.meta, win.rec, win.count, idx)
    at = _put(out, at, head)
    for lat, size in win.layers:
        at = _put(out, at, state[lat : lat + _LAYER_HEAD])
        at = _take_into(out, at, state, lat + _LAYER_HEAD, size, win.count, idx)
    assert at == len(out)
    return out


def _put(out: bytearray, at: int, raw: bytes | memoryview) -> int:
    out[at : at + len(raw)] = raw
    return at + len(raw)


def _take_into(
    out: bytearray, at: int, buf: memoryview, start: int, size: int, count: int, idx: np.ndarray
) -> int:
    """Copy the ``size``-byte items ``idx`` of the ``count`` at ``start`` in ``buf`` into
    ``out`` at ``at`` (no intermediate copy); the offset after them."""
    np.take(_items(buf, start, size, count), idx, axis=0, out=_items(out, at, size, len(idx)))
    return at + len(idx) * size
