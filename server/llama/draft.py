"""A draft model's context for speculative decoding (``--spec-type draft-simple``).

It has as many sequences as the target context, one per slot (seq id == slot id), the same
size and KV layout. Without ``-md`` (or with the main model's own path) the target's model
object drafts for itself: one copy of the weights, a second KV cache. Engine thread only.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

import llama_cpp as L
import numpy as np

from .backend import LlamaBackend, LlamaBatch, _context_params
from .memory import SeqMemory, memory_layout
from .params import KV_TYPES

log = logging.getLogger("server.llama.draft")


class DraftContext(SeqMemory):
    def __init__(
        self,
        target: LlamaBackend,
        path: str | None,
        n_gpu_layers: int = -1,
        type_k: str = "f16",
        type_v: str = "f16",
    ) -> None:
        own = bool(path) and os.path.realpath(path) != os.path.realpath(target.opts.path)
        self.path = path if own else target.opts.path
        self._own_model = own
        if own:
            mparams = L.llama_model_default_params()
            mparams.n_gpu_layers = n_gpu_layers if n_gpu_layers >= 0 else 999
            self.model = L.llama_model_load_from_file(path.encode(), mparams)
            if not self.model:
                raise RuntimeError(f"failed to load the draft model {path}")
        else:
            self.model = target.model
        self.n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))
        if self.n_vocab != target.n_vocab:
            self.close()
            raise RuntimeError(
                f"the draft model's vocabulary ({self.n_vocab} tokens) is not the target's "
                f"({target.n_vocab})"
            )
        self.n_swa, recurrent, self.kv_kinds = memory_layout(self.model, target.opts.swa_full)
        if recurrent:
            self.close()
            raise RuntimeError("a recurrent draft model cannot drop rejected tokens")
        # the target's context shape, sampled on the CPU (greedy), one output row per slot;
        # its own KV cache types (-ctkd / -ctvd: f16 unless given, as llama-server)
        opts = dataclasses.replace(
            target.opts,
            n_ctx=target.n_ctx,
            backend_sampling=False,
            outputs_per_seq=1,
            type_k=type_k,
            type_v=type_v,
        )
        cparams, _ = _context_params(opts, L.llama_model_n_ctx_train(self.model))
        self.ctx = L.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            self.close()
            raise RuntimeError("failed to create the draft context (out of memory?)")
        self.mem = L.llama_get_memory(self.ctx)
        self.can_shift = bool(L.llama_memory_can_shift(self.mem))
        self.kv_type_ids = (KV_TYPES[type_k], KV_TYPES[type_v])
        self.n_batch = L.llama_n_batch(self.ctx)
        self.batch = LlamaBatch(self.n_batch)

    def decode(self) -> int:
        """Decode the whole batch; llama_decode's status code."""
        self.batch.raw.n_tokens = self.batch.n
        return L.llama_decode(self.ctx, self.batch.raw)

    def greedy(self, idx: int, want_p: bool) -> tuple[int, float]:
        """The likeliest token of output ``idx``, and its probability when ``want_p`` (else
        1.0): one pass over the vocabulary in numpy."""
        logits = np.ctypeslib.as_array(L.llama_get_logits_ith(self.ctx, idx), shape=(self.n_vocab,))
        tok = int(logits.argmax())
        if not want_p:
            return tok, 1.0
        return tok, float(1.0 / np.exp(logits - logits[tok]).sum())

    def describe(self) -> dict[str, Any]:
        return {"path": self.path, "own_model": self._own_model, "n_swa": self.n_swa}

    def close(self) -> None:
        batch = getattr(self, "batch", None)
        if batch is not None:
            batch.free()
        if getattr(self, "ctx", None):
            L.llama_free(self.ctx)
            self.ctx = None
        if self._own_model and self.model:
            L.llama_model_free(self.model)
        self.model = None
