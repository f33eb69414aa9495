"""LoRA adapters on the target context (llama_adapter_lora_init, llama_set_adapters_lora).

llama.cpp applies the adapters set on a context to every token of the next decode, whatever
its sequence: the engine decodes one adapter set per step and calls ``apply`` before each
decode. Contracts:

- Every file is checked before llama.cpp reads it (``lora_check.check_fd``: its keys'
  types, its tensors' names, types, shapes and data against the base model's header), at
  start, at a wake's reload and at run time alike: a file that would abort or crash
  llama.cpp is a ValueError naming what is wrong, never a crash.
- The constructor reads each file once (the adapter lives as long as the model) and raises
  ValueError naming the file refused (missing, not a regular file, not an adapter of this
  model).
- ``apply(scales)`` makes the context's adapters exactly those with a non-zero scale, at
  those scales; it calls llama.cpp only when the set differs from the last one applied.
  ``scales`` has one entry per loaded adapter, or is empty (no adapter).
"""

from __future__ import annotations

import ctypes
import os
from typing import TYPE_CHECKING

import llama_cpp as L

from .lora_check import BaseModel, LoraFileError, base_model, check_fd

if TYPE_CHECKING:  # (ctypes' _Pointer is not subscriptable at run time)
    # llama_adapter_lora_init's result (see LoraAdapters.__init__)
    LoraHandle = ctypes._Pointer[ctypes.c_void_p]


class LoraAdapters:
    """The adapters loaded for one model, in ``--lora`` order (their ids)."""

    def __init__(
        self, model: L.llama_model_p, ctx: L.llama_context_p, paths: list[str], model_path: str
    ) -> None:
        """``model_path``: the base model's file, whose header the adapters are checked
        against (read on the first check)."""
        self._ctx = ctx
        self._model = model
        self._model_path = model_path
        self.paths = list(paths)
        # llama_adapter_lora_init's results: POINTER(c_void_p)s (the bindings' restype,
        # llama_adapter_lora_p_ctypes; their annotation says c_void_p), as the array that
        # llama_set_adapters_lora takes holds them; None: an unloaded run-time adapter's id
        self._handles: list[LoraHandle | None] = []
        for p in self.paths:
            if not p:  # an id left empty: a run-time adapter unloaded (service/adapters.py)
                self._handles.append(None)
                continue
            self._handles.append(self._load_path(p))
        self._applied: tuple[tuple[int, float], ...] = ()  # (id, scale) last set

    def rebind(self, ctx: L.llama_context_p) -> None:
        """A new context of the same model (a wake from sleep level 1): nothing is set on it
        yet; the next ``apply`` sets the adapters again."""
        self._ctx = ctx
        self._applied = ()

    def __len__(self) -> int:
        return len(self._handles)

    def _load_path(self, path: str) -> LoraHandle:
        """The adapter at ``path``, opened without blocking (a FIFO is refused, not waited
        on) and loaded by ``load_fd``; ValueError naming the file."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as e:
            raise ValueError(f"failed to load LoRA adapter {path!r}: {e.strerror}") from None
        try:
            return self.load_fd(fd)
        except ValueError as e:
            raise ValueError(f"failed to load LoRA adapter {path!r}: {e}") from None
        finally:
            os.close(fd)

    def base(self) -> BaseModel:
        """The base model's architecture and tensor shapes (its header, read once)."""
        return base_model(self._model_path)

    def check_fd(self, fd: int) -> int:
        """Check the open adapter file ``fd`` (lora_check.check_fd); its size in bytes.
        ValueError naming what is wrong."""
        try:
            base = self.base()
        except OSError as e:
            raise ValueError(f"cannot read the base model's header: {e.strerror}") from None
        try:
            return check_fd(fd, base)
        except OSError as e:
            raise LoraFileError(f"cannot read the file: {e.strerror}") from None

    def load_fd(self, fd: int) -> LoraHandle:
        """Load an adapter from the open file ``fd`` (read from its start), on any thread:
        checked first (``check_fd``), then llama.cpp reads it into buffers of its own and
        registers it with the model, which no decode reads (a decode reads the context's
        adapters, set by ``apply``). At run time ``fd`` is a private copy of the bytes the
        caller hashed (service/lora_runtime.py): nobody can change them between the check
        and the load. ValueError when the check or llama.cpp refuses it."""
        self.check_fd(fd)  # a regular file: blocking or not, its reads never wait
        os.set_blocking(fd, True)
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
