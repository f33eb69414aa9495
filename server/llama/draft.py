"""A draft model's context for speculative decoding (``--spec-type draft-simple``).

It has as many sequences as the target context, one per slot (seq id == slot id), the same
size and KV layout. Without ``-md`` (or with the main model's own path) the target's model
object drafts for itself: one copy of the weights, a second KV cache. Engine thread only.
"""

from __future__ import annotations

import dataclasses
import logging
import os

import llama_cpp as L
import numpy as np

from .backend import LlamaBackend, LlamaBatch, context_params
from .memory import SeqMemory, memory_layout
from .params import KV_TYPES, model_params

log = logging.getLogger("server.llama.draft")


@dataclasses.dataclass(frozen=True)
class DraftOptions:
    """The draft model's own settings (llama-server's ``--spec-draft-*`` / ``*-draft`` flags);
    what is not here is the target's."""

    path: str | None = None  # -md; None or the main model's path: the target drafts itself
    n_gpu_layers: int = -1  # -ngld (-1: all)
    type_k: str = "f16"  # -ctkd
    type_v: str = "f16"  # -ctvd
    # -otd, and the CPU overrides of -cmoed / -ncmoed (llama.params.tensor_overrides)
    tensor_overrides: tuple[tuple[str, str], ...] = ()
    n_threads: int = -1  # -td (-1: the target's)
    n_threads_batch: int = -1  # -tbd (-1: the target's)


class DraftContext(SeqMemory):
    def __init__(self, target: LlamaBackend, o: DraftOptions) -> None:
        path = o.path or ""
        own = bool(path) and os.path.realpath(path) != os.path.realpath(target.opts.path)
        self.path = path if own else target.opts.path
        self._own_model = own
        if own:
            # ValueError (an unknown buffer type in -otd) before anything is loaded
            self._mparams = model_params(o.n_gpu_layers, overrides=o.tensor_overrides)
            self.model = L.llama_model_load_from_file(path.encode(), self._mparams.params)
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
            type_k=o.type_k,
            type_v=o.type_v,
            n_threads=o.n_threads if o.n_threads > 0 else target.opts.n_threads,
            n_threads_batch=o.n_threads_batch
            if o.n_threads_batch > 0
            else target.opts.n_threads_batch,
        )
        cparams, _ = context_params(opts, L.llama_model_n_ctx_train(self.model), False)
        self.ctx = L.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            self.close()
            raise RuntimeError("failed to create the draft context (out of memory?)")
        self.mem = L.llama_get_memory(self.ctx)
        self.can_shift = bool(L.llama_memory_can_shift(self.mem))
        self.kv_type_ids = (KV_TYPES[o.type_k], KV_TYPES[o.type_v])
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

    def describe(self) -> dict[str, object]:
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
