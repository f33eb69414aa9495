"""A llama context's sequences: memory edits and state bytes. The target context
(``LlamaBackend``) and a draft model's context (``server.llama.draft``) share these; engine
thread only, except ``state_cells``."""

from __future__ import annotations

import ctypes
import mmap

import llama_cpp as L

from ..types import CacheCells, StateBuf
from .kv_state import StateFormatError, read_caches


def memory_layout(
    model: L.llama_model_p, swa_full: bool
) -> tuple[int, bool, tuple[str, ...] | None]:
    """A model's memory as the engine sees it: the sliding window (0: none, or a full-size
    SWA cache), whether it is recurrent (or hybrid), and the caches a sequence state holds
    in llama.cpp's order (None: recurrent memory's format)."""
    n_swa_model = L.llama_model_n_swa(model)
    recurrent = bool(L.llama_model_is_recurrent(model) or L.llama_model_is_hybrid(model))
    kinds = None if recurrent else ("full", "swa") if n_swa_model > 0 else ("full",)
    return (0 if swa_full else n_swa_model), recurrent, kinds


class SeqMemory:
    """Needs ``ctx`` (a llama context), ``mem`` (its memory) and ``kv_kinds`` (the caches a
    state holds, in llama.cpp's order; None for recurrent memory)."""

    # llama.cpp's pointers (ints, as the bindings return them); None once the context is
    # freed (LlamaBackend.free_context, close): nothing is called on them then
    ctx: L.llama_context_p | None
    mem: L.llama_memory_t | None
    kv_kinds: tuple[str, ...] | None

    # ---- memory -------------------------------------------------------------------

    def seq_rm(self, seq: int, p0: int, p1: int = -1) -> bool:
        return bool(L.llama_memory_seq_rm(self.mem, seq, p0, p1))

    def seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None:
        L.llama_memory_seq_cp(self.mem, src, dst, p0, p1)

    def seq_pos_min(self, seq: int) -> int:
        return L.llama_memory_seq_pos_min(self.mem, seq)

    def seq_pos_max(self, seq: int) -> int:
        return L.llama_memory_seq_pos_max(self.mem, seq)

    def seq_clear(self, seq: int) -> None:
        L.llama_memory_seq_rm(self.mem, seq, -1, -1)

    def seq_add(self, seq: int, p0: int, p1: int, delta: int) -> None:
        """Move the positions [p0, p1) of ``seq`` by ``delta`` (a context shift). Only for a
        memory that can shift (llama_memory_can_shift): llama.cpp aborts at the next decode
        otherwise."""
        L.llama_memory_seq_add(self.mem, seq, p0, p1, delta)

    # ---- sequence state -----------------------------------------------------------

    def state_size(self, seq: int, partial: bool = False) -> int:
        flags = L.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY if partial else L.LLAMA_STATE_SEQ_FLAGS_NONE
        return int(L.llama_state_seq_get_size_ext(self.ctx, seq, flags))

    def state_get(self, seq: int, partial: bool = False, size: int | None = None) -> StateBuf:
        """The sequence's state in one new buffer; ``size`` when the caller already knows it."""
        flags = L.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY if partial else L.LLAMA_STATE_SEQ_FLAGS_NONE
        if size is None:
            size = L.llama_state_seq_get_size_ext(self.ctx, seq, flags)
        buf = (ctypes.c_uint8 * size)()
        n = L.llama_state_seq_get_data_ext(self.ctx, buf, size, seq, flags)
        if n != size:
            raise RuntimeError(f"state_seq_get_data returned {n} of {size} bytes")
        return buf

    def state_get_into(self, seq: int, buf: bytearray | mmap.mmap | memoryview, size: int) -> int:
        """Copy the sequence's state (``size`` bytes: ``state_size``) into the start of
        ``buf`` (at least that long: a reused buffer of ours, so the copy faults in no
        pages); the bytes copied, 0 when they are not exactly ``size``."""
        if size <= 0 or len(buf) < size:
            return 0
        dst = (ctypes.c_uint8 * size).from_buffer(buf)
        try:
            n = L.llama_state_seq_get_data_ext(self.ctx, dst, size, seq, 0)
        finally:
            del dst  # the export ends here: the buffer may be reused or closed
        return int(n) if n == size else 0

    def state_set(
        self, seq: int, data: StateBuf, partial: bool = False, nbytes: int | None = None
    ) -> int:
        """Restore a sequence from ``data``; returns the bytes consumed, 0 on failure."""
        flags = L.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY if partial else L.LLAMA_STATE_SEQ_FLAGS_NONE
        size = len(data) if nbytes is None else nbytes
        if size == 0:
            return 0
        ptr = data if isinstance(data, ctypes.Array) else (ctypes.c_uint8 * size).from_buffer(data)
        return int(L.llama_state_seq_set_data_ext(self.ctx, ptr, size, seq, flags))

    def state_cells(
        self, data: StateBuf | bytes | mmap.mmap | memoryview, nbytes: int, start: int = 0
    ) -> tuple[list[CacheCells], int] | None:
        """The cells a one-sequence state's bytes (from ``start``) describe, read without
        loading them, and the offset where the state ends; None when this memory's format is
        not a KV cache's. Raises StateFormatError (a ValueError). Any thread."""
        if self.kv_kinds is None:
            return None
        return read_caches(memoryview(data).cast("B"), self.kv_kinds, start=start, end=nbytes)

    def kv_cells(self) -> list[CacheCells] | None:
        """Every cell of the KV cache, per cache (a copy of the whole context's state: for
        integrity checks, not for the hot path); None for recurrent memory."""
        if self.kv_kinds is None:
            return None
        size = L.llama_state_get_size(self.ctx)
        buf = (ctypes.c_uint8 * size)()
        n = L.llama_state_get_data(self.ctx, buf, size)
        try:
            return read_caches(memoryview(buf).cast("B"), self.kv_kinds, end=n, whole_context=True)[
                0
            ]
        except StateFormatError as e:
            raise RuntimeError(f"cannot read the KV cache's state: {e}") from e
