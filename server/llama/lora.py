"""LoRA adapters on the target context (llama_adapter_lora_init, llama_set_adapters_lora).

llama.cpp applies the adapters set on a context to every token of the next decode, whatever
its sequence: the engine decodes one adapter set per step and calls ``apply`` before each
decode. Contracts:

- ``load`` reads each file once (the adapter lives as long as the model) and raises
  ValueError naming the file that llama.cpp refuses (missing, not an adapter, another
  model's tensors).
- ``apply(scales)`` makes the context's adapters exactly those with a non-zero scale, at
  those scales; it calls llama.cpp only when the set differs from the last one applied.
  ``scales`` has one entry per loaded adapter, or is empty (no adapter).
"""

from __future__ import annotations

import ctypes
import os
from typing import TYPE_CHECKING

import llama_cpp as L

if TYPE_CHECKING:  # (ctypes' _Pointer is not subscriptable at run time)
    # llama_adapter_lora_init's result (see LoraAdapters.__init__)
    LoraHandle = ctypes._Pointer[ctypes.c_void_p]


class LoraAdapters:
    """The adapters loaded for one model, in ``--lora`` order (their ids)."""

    def __init__(self, model: L.llama_model_p, ctx: L.llama_context_p, paths: list[str]) -> None:
        self._ctx = ctx
        self._model = model
        self.paths = list(paths)
        # llama_adapter_lora_init's results: POINTER(c_void_p)s (the bindings' restype,
        # llama_adapter_lora_p_ctypes; their annotation says c_void_p), as the array that
        # llama_set_adapters_lora takes holds them; None: an unloaded run-time adapter's id
        self._handles: list[LoraHandle | None] = []
        for p in self.paths:
            if not p:  # an id left empty: a run-time adapter unloaded (service/adapters.py)
                self._handles.append(None)
                continue
            h = L.llama_adapter_lora_init(model, p.encode())
            if not h:
                raise ValueError(f"failed to load LoRA adapter {p!r} (not a LoRA of this model?)")
            self._handles.append(h)
        self._applied: tuple[tuple[int, float], ...] = ()  # (id, scale) last set

    def rebind(self, ctx: L.llama_context_p) -> None:
        """A new context of the same model (a wake from sleep level 1): nothing is set on it
        yet; the next ``apply`` sets the adapters again."""
        self._ctx = ctx
        self._applied = ()

    def __len__(self) -> int:
        return len(self._handles)

    def load_fd(self, fd: int) -> LoraHandle:
        """Load an adapter from the open file ``fd`` (read from its start), on any thread:
        llama.cpp reads it into buffers of its own and registers it with the model, which
        no decode reads (a decode reads the context's adapters, set by ``apply``). The
        caller hashed these very bytes (runtime loading: service/lora_runtime.py), so no
        path is opened twice. ValueError when llama.cpp refuses it."""
        libc = ctypes.CDLL(None, use_errno=True)
        libc.fdopen.restype = ctypes.c_void_p
        libc.fdopen.argtypes = [ctypes.c_int, ctypes.c_char_p]
        libc.fclose.argtypes = [ctypes.c_void_p]
        os.lseek(fd, 0, os.SEEK_SET)
        dup = os.dup(fd)
        fp = libc.fdopen(dup, b"rb")
        if not fp:
            os.close(dup)
            raise OSError(ctypes.get_errno(), "fdopen failed")
        try:
            h = L.llama_adapter_lora_init_from_file_ptr(self._model, ctypes.c_void_p(fp))
        finally:
            libc.fclose(fp)
        if not h:
            raise ValueError("not a LoRA adapter of this model")
        return h

    def attach(self, handle: LoraHandle) -> int:
        """Add a loaded adapter (``load_fd``'s) under the next id; engine thread only (the
        ids are the scales' indices the next ``apply`` reads)."""
        self._handles.append(handle)
        return len(self._handles) - 1

    def apply(self, scales: tuple[float, ...]) -> None:
        """Set the adapters with a non-zero scale on the context (see module docstring)."""
        handles = self._handles
        active = tuple(
            (i, s)
            for i, s in enumerate(scales)
            if s != 0.0 and i < len(handles) and handles[i] is not None
        )
        if active == self._applied:
            return
        n = len(active)
        chosen = [h for i, _ in active if (h := handles[i]) is not None]  # all: see active
        arr = (L.llama_adapter_lora_p_ctypes * max(n, 1))(*chosen)
        sc = (ctypes.c_float * max(n, 1))(*[s for _, s in active])
        ret = L.llama_set_adapters_lora(self._ctx, arr if n else None, n, sc if n else None)
        if ret != 0:
            raise RuntimeError(f"llama_set_adapters_lora failed ({ret})")
        self._applied = active
