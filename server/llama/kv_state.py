"""Reading the cell lists out of llama.cpp's KV-cache state bytes, without loading them.

The layout is ``llama_kv_cache::state_write`` (llama-kv-cache.cpp of the pinned llama.cpp):
per cache ``n_stream:u32``, then per stream ``cell_count:u32``, ``cell_count`` cell records
(``pos:i32``, ``n_seq_id:u32``, an optional 12-byte ext, ``n_seq_id`` x ``seq_id:i32``) and
the cells' K/V rows. A one-sequence state (``llama_state_seq_get_data``) starts with a magic
and its sequence id. A sliding-window model (``llama_kv_cache_iswa``) writes its full cache,
then its SWA cache. A whole-context state (``llama_state_get_data``) starts with the model's
architecture name, then the same per-cache records for every sequence.

Two uses: the slot store proves that an untrusted slot file's state describes exactly its
token list before llama.cpp loads it, and the integrity check counts every cell in the KV
cache per sequence (llama.cpp has no API for cell counts). Recurrent and hybrid memories
write another format: callers get None for them.
"""

from __future__ import annotations

import itertools
import struct

import numpy as np

from ..types import CacheCells
from .state_bytes import I32, U32, U64, Reader, StateFormatError

__all__ = ["StateFormatError", "read_caches"]

_CELL = struct.Struct("<iI")
_EXT = 12  # llama_kv_cell_ext: x, y, tok


# One cell record of one sequence, without ext: the common case, read in one numpy pass.
_ONE_SEQ = np.dtype([("pos", "<i4"), ("n_seq", "<u4"), ("seq", "<i4")])


def _cells(r: Reader, count: int, ext: bool, out: CacheCells) -> None:
    if not ext and r.pos + count * _ONE_SEQ.itemsize <= r.end:
        recs = np.frombuffer(r.buf, _ONE_SEQ, count, r.pos)
        if bool((recs["n_seq"] == 1).all()):
            out.pos.extend(recs["pos"].tolist())
            ids = recs["seq"]
            if count and bool((ids == ids[0]).all()):  # a one-sequence state: one tuple
                out.seqs.extend(itertools.repeat((int(ids[0]),), count))
            else:
                out.seqs.extend((s,) for s in ids.tolist())
            r.pos += count * _ONE_SEQ.itemsize
            return
    for _ in range(count):
        if r.pos + _CELL.size > r.end:
            raise StateFormatError("truncated cell list")
        pos, n_seq = _CELL.unpack_from(r.buf, r.pos)
        r.pos += _CELL.size + (_EXT if ext else 0)
        if n_seq > 256:
            raise StateFormatError(f"cell with {n_seq} sequence ids")
        seqs = tuple(r.take(I32) for _ in range(n_seq))
        out.pos.append(pos)
        out.seqs.append(seqs)


def _skip_rows(r: Reader, count: int, out: CacheCells) -> None:
    """Skip a stream's K rows, then its V rows (row-major or transposed), noting each
    layer's K and V type in ``out`` (llama.cpp writes them before the rows)."""
    v_trans, n_layer = r.take(U32), r.take(U32)
    if v_trans > 1 or n_layer > 4096:
        raise StateFormatError("implausible layer header")
    for _ in range(n_layer):
        out.k_types.add(r.take(I32))
        r.skip(count * r.take(U64))
    for _ in range(n_layer):
        out.v_types.add(r.take(I32))
        if v_trans:
            el, n_embd = r.take(U32), r.take(U32)
            r.skip(count * el * n_embd)
        else:
            r.skip(count * r.take(U64))


def _cache(r: Reader, kind: str, ext: bool) -> CacheCells:
    out = CacheCells(kind)
    n_stream = r.take(U32)
    if not 1 <= n_stream <= 256:
        raise StateFormatError(f"{n_stream} streams")
    for _ in range(n_stream):
        count = r.take(U32)
        if count:
            _cells(r, count, ext, out)
            _skip_rows(r, count, out)
    return out


def read_caches(
    buf: bytes | bytearray | memoryview,
    kinds: tuple[str, ...],
    *,
    start: int = 0,
    end: int | None = None,
    whole_context: bool = False,
) -> tuple[list[CacheCells], int]:
    """The cells of each cache in ``kinds`` (``"full"`` / ``"swa"``, in the order llama.cpp
    writes them) and the offset just past them. Raises StateFormatError when the bytes do
    not parse, with or without the cell ext records."""
    end = len(buf) if end is None else end
    last: StateFormatError | None = None
    for ext in (False, True):
        r = Reader(buf, start, end)
        try:
            if whole_context:
                r.skip(r.take(U32))  # the architecture name
            else:
                r.skip(8)  # llama_state_seq_get_data's magic and source sequence id
            return [_cache(r, k, ext) for k in kinds], r.pos
        except StateFormatError as e:
            last = e
    assert last is not None
    raise last
