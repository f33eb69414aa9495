"""The only module that talks to llama.cpp (through llama-cpp-python's low-level bindings).

Every method must be called from the engine thread that owns the context, except the
tokenizer helpers, which only read the (immutable) vocabulary.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from array import array
from dataclasses import dataclass
from typing import Any

import llama_cpp as L
import numpy as np

from ..types import SamplingParams, StateBuf, TokenLogprob

log = logging.getLogger("server.llama")

_LOG_LOCK = threading.Lock()
_BACKEND_READY = False


@ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)
def _llama_log(level: int, text: bytes, _user: ctypes.c_void_p) -> None:
    # llama.cpp is chatty at load time; forward only warnings and errors (levels 3, 4).
    if level in (3, 4) and text:
        msg = text.decode("utf-8", "replace").rstrip()
        if msg:
            log.log(logging.WARNING if level == 3 else logging.ERROR, "%s", msg)
    elif text and log.isEnabledFor(logging.DEBUG - 5):
        log.log(logging.DEBUG - 5, "%s", text.decode("utf-8", "replace").rstrip())


def _init_backend() -> None:
    global _BACKEND_READY
    with _LOG_LOCK:
        if not _BACKEND_READY:
            L.llama_log_set(_llama_log, ctypes.c_void_p(0))
            L.llama_backend_init()
            _BACKEND_READY = True


@dataclass(frozen=True)
class ModelOptions:
    path: str
    n_ctx: int = 8192
    n_parallel: int = 4
    n_batch: int = 2048
    n_ubatch: int = 512
    n_threads: int = -1
    n_threads_batch: int = -1
    n_gpu_layers: int = -1
    kv_unified: bool = True
    swa_full: bool = False
    flash_attn: str = "auto"  # on | off | auto
    seed: int = -1


class LlamaBatch:
    """A reusable llama_batch of fixed capacity; one sequence id per token."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.raw = L.llama_batch_init(capacity, 0, 1)
        self.n = 0
        ones = (ctypes.c_int32 * capacity)(*([1] * capacity))
        ctypes.memmove(self.raw.n_seq_id, ones, ctypes.sizeof(ones))

    def clear(self) -> None:
        self.n = 0

    def add_span(self, tokens: list[int], pos0: int, seq: int, logits_last: bool) -> int:
        """Append tokens at positions pos0.. for seq; returns the batch index of the last one."""
        n = len(tokens)
        i0 = self.n
        if i0 + n > self.capacity:
            raise ValueError("batch overflow")
        raw = self.raw
        tok = array("i", tokens)
        pos = array("i", range(pos0, pos0 + n))
        ctypes.memmove(ctypes.addressof(raw.token.contents) + 4 * i0, tok.buffer_info()[0], 4 * n)
        ctypes.memmove(ctypes.addressof(raw.pos.contents) + 4 * i0, pos.buffer_info()[0], 4 * n)
        ctypes.memset(ctypes.addressof(raw.logits.contents) + i0, 0, n)
        seq_ids = raw.seq_id
        for i in range(i0, i0 + n):
            seq_ids[i][0] = seq
        if logits_last:
            raw.logits[i0 + n - 1] = 1
        self.n = i0 + n
        return self.n - 1

    def view(self, start: int, count: int) -> L.llama_batch:
        """A llama_batch over [start, start+count) of this batch's arrays (no copy)."""
        raw = self.raw
        return L.llama_batch(
            n_tokens=count,
            token=ctypes.cast(
                ctypes.addressof(raw.token.contents) + 4 * start, ctypes.POINTER(L.llama_token)
            ),
            embd=None,
            pos=ctypes.cast(
                ctypes.addressof(raw.pos.contents) + 4 * start, ctypes.POINTER(L.llama_pos)
            ),
            n_seq_id=ctypes.cast(
                ctypes.addressof(raw.n_seq_id.contents) + 4 * start, ctypes.POINTER(ctypes.c_int32)
            ),
            seq_id=ctypes.cast(
                ctypes.addressof(raw.seq_id.contents) + ctypes.sizeof(ctypes.c_void_p) * start,
                ctypes.POINTER(ctypes.POINTER(L.llama_seq_id)),
            ),
            logits=ctypes.cast(
                ctypes.addressof(raw.logits.contents) + start, ctypes.POINTER(ctypes.c_int8)
            ),
        )

    def free(self) -> None:
        if self.raw is not None:
            L.llama_batch_free(self.raw)
            self.raw = None


class Sampler:
    """One llama_sampler chain for one task; freed when the task ends."""

    def __init__(self, ptr: L.llama_sampler_p) -> None:
        self.ptr = ptr

    def free(self) -> None:
        if self.ptr:
            L.llama_sampler_free(self.ptr)
            self.ptr = None


def _context_params(opts: ModelOptions, n_ctx_train: int) -> tuple[Any, int]:
    """llama_context_params from the options, and the decode thread count."""
    cparams = L.llama_context_default_params()
    cparams.n_ctx = opts.n_ctx if opts.n_ctx > 0 else n_ctx_train
    cparams.n_batch = opts.n_batch
    cparams.n_ubatch = min(opts.n_ubatch, opts.n_batch)
    cparams.n_seq_max = opts.n_parallel
    threads = opts.n_threads if opts.n_threads > 0 else max(1, (os.cpu_count() or 2))
    cparams.n_threads = threads
    cparams.n_threads_batch = opts.n_threads_batch if opts.n_threads_batch > 0 else threads
    cparams.kv_unified = opts.kv_unified
    cparams.swa_full = opts.swa_full
    cparams.no_perf = True
    cparams.flash_attn_type = {"on": 1, "off": 0}.get(opts.flash_attn, -1)
    return cparams, threads


class LlamaBackend:
    """Model + context + vocabulary; implements the engine's Backend protocol."""

    def __init__(self, opts: ModelOptions) -> None:
        _init_backend()
        if not os.path.isfile(opts.path):
            raise FileNotFoundError(f"model file not found: {opts.path}")
        self.opts = opts
        mparams = L.llama_model_default_params()
        mparams.n_gpu_layers = opts.n_gpu_layers if opts.n_gpu_layers >= 0 else 999
        self.model = L.llama_model_load_from_file(opts.path.encode(), mparams)
        if not self.model:
            raise RuntimeError(f"failed to load model {opts.path}")
        self.vocab = L.llama_model_get_vocab(self.model)
        self.n_vocab = L.llama_vocab_n_tokens(self.vocab)
        self.n_ctx_train = L.llama_model_n_ctx_train(self.model)

        cparams, threads = _context_params(opts, self.n_ctx_train)
        self.ctx = L.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            raise RuntimeError("failed to create llama context (out of memory?)")
        self.mem = L.llama_get_memory(self.ctx)
        self.n_ctx = L.llama_n_ctx(self.ctx)
        self.n_batch = L.llama_n_batch(self.ctx)
        self.n_ubatch = L.llama_n_ubatch(self.ctx)
        self.n_seq = opts.n_parallel
        self.kv_unified = opts.kv_unified
        self.n_ctx_slot = self.n_ctx if opts.kv_unified else self.n_ctx // opts.n_parallel
        n_swa_model = L.llama_model_n_swa(self.model)
        self.n_swa = 0 if opts.swa_full else n_swa_model
        self.is_recurrent = bool(
            L.llama_model_is_recurrent(self.model) or L.llama_model_is_hybrid(self.model)
        )
        self.n_threads = threads
        self.seed = opts.seed
        self.batch = LlamaBatch(self.n_batch)
        self.state_file_version = L.LLAMA_STATE_SEQ_VERSION
        self._piece_cache: dict[int, bytes] = {}
        self._eog: dict[int, bool] = {}
        self.bos_id = L.llama_vocab_bos(self.vocab)
        self.bos_text = (
            self.token_to_piece(self.bos_id, special=True).decode("utf-8", "replace")
            if self.bos_id >= 0
            else ""
        )
        self.eos_text = ""
        eos = L.llama_vocab_eos(self.vocab)
        if eos >= 0:
            self.eos_text = self.token_to_piece(eos, special=True).decode("utf-8", "replace")
        self.architecture = self.meta("general.architecture") or ""
        self.chat_template = self._model_chat_template()
        self.model_size = L.llama_model_size(self.model)
        self.n_params = L.llama_model_n_params(self.model)

    # ---- metadata -----------------------------------------------------------------

    def meta(self, key: str) -> str | None:
        buf = ctypes.create_string_buffer(4096)
        n = L.llama_model_meta_val_str(self.model, key.encode(), buf, len(buf))
        if n < 0:
            return None
        if n >= len(buf):
            buf = ctypes.create_string_buffer(n + 1)
            L.llama_model_meta_val_str(self.model, key.encode(), buf, len(buf))
        return buf.value.decode("utf-8", "replace")

    def _model_chat_template(self) -> str | None:
        ptr = L.llama_model_chat_template(self.model, None)
        if not ptr:
            return None
        return ptr.decode("utf-8", "replace") if isinstance(ptr, bytes) else None

    # ---- vocabulary (thread-safe: read-only) -------------------------------------

    def tokenize(
        self, text: str, add_special: bool = True, parse_special: bool = True
    ) -> list[int]:
        data = text.encode("utf-8")
        cap = len(data) + 8
        buf = (L.llama_token * cap)()
        n = L.llama_tokenize(self.vocab, data, len(data), buf, cap, add_special, parse_special)
        if n < 0:
            cap = -n
            buf = (L.llama_token * cap)()
            n = L.llama_tokenize(self.vocab, data, len(data), buf, cap, add_special, parse_special)
        return list(buf[:n])

    def token_to_piece(self, token: int, special: bool = False) -> bytes:
        if not special:
            cached = self._piece_cache.get(token)
            if cached is not None:
                return cached
        buf = ctypes.create_string_buffer(256)
        n = L.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = L.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, special)
        piece = buf.raw[:n]
        if not special:
            self._piece_cache[token] = piece
        return piece

    def detokenize(self, tokens: list[int]) -> str:
        return b"".join(self.token_to_piece(t) for t in tokens).decode("utf-8", "replace")

    def is_eog(self, token: int) -> bool:
        v = self._eog.get(token)
        if v is None:
            v = bool(L.llama_vocab_is_eog(self.vocab, token))
            self._eog[token] = v
        return v

    # ---- decoding -----------------------------------------------------------------

    def decode(self, start: int, count: int) -> int:
        """Decode batch entries [start, start+count); returns llama_decode's status code."""
        if start == 0 and count == self.batch.n:
            self.batch.raw.n_tokens = count
            return L.llama_decode(self.ctx, self.batch.raw)
        return L.llama_decode(self.ctx, self.batch.view(start, count))

    def new_sampler(self, p: SamplingParams, history: list[int]) -> Sampler:
        """A sampler chain as llama-server orders it: bias, penalties, top-k, top-p, min-p, temp, dist.

        ``history`` (recent prompt tokens) seeds the penalty window.
        """
        chain = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())
        add = L.llama_sampler_chain_add
        if p.logit_bias:
            arr = (L.llama_logit_bias * len(p.logit_bias))()
            for i, (tok, bias) in enumerate(p.logit_bias.items()):
                arr[i].token = tok
                arr[i].bias = bias
            add(chain, L.llama_sampler_init_logit_bias(self.n_vocab, len(p.logit_bias), arr))
        penalties = (
            p.repeat_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
        )
        if penalties and p.repeat_last_n != 0:
            last_n = self.n_ctx_slot if p.repeat_last_n < 0 else p.repeat_last_n
            pen = L.llama_sampler_init_penalties(
                self.n_vocab, last_n, p.repeat_penalty, p.frequency_penalty, p.presence_penalty
            )
            for t in history[-last_n:]:
                L.llama_sampler_accept(pen, t)
            add(chain, pen)
        if p.temperature <= 0.0:
            add(chain, L.llama_sampler_init_greedy())
        else:
            if p.top_k > 0:
                add(chain, L.llama_sampler_init_top_k(p.top_k))
            if p.top_p < 1.0:
                add(chain, L.llama_sampler_init_top_p(p.top_p, 1))
            if p.min_p > 0.0:
                add(chain, L.llama_sampler_init_min_p(p.min_p, 1))
            add(chain, L.llama_sampler_init_temp(p.temperature))
            seed = p.seed if p.seed >= 0 else (self.seed if self.seed >= 0 else 0xFFFFFFFF)
            add(chain, L.llama_sampler_init_dist(seed & 0xFFFFFFFF))
        return Sampler(chain)

    def sample(self, sampler: Sampler, idx: int) -> int:
        return L.llama_sampler_sample(sampler.ptr, self.ctx, idx)

    def top_logprobs(self, idx: int, token: int, n: int) -> TokenLogprob:
        """Log-probabilities of ``token`` and of the ``n`` likeliest tokens at output ``idx``."""
        ptr = L.llama_get_logits_ith(self.ctx, idx)
        logits = np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))
        m = float(logits.max())
        lse = m + float(np.log(np.exp(logits - m).sum()))
        top: list[tuple[int, float]] = []
        if n > 0:
            ids = np.argpartition(logits, -n)[-n:]
            ids = ids[np.argsort(-logits[ids])]
            top = [(int(i), float(logits[i]) - lse) for i in ids]
        return TokenLogprob(token, float(logits[token]) - lse, top)

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

    def state_save_file(self, path: str, seq: int, tokens: list[int]) -> int:
        arr = (L.llama_token * max(1, len(tokens)))(*tokens)
        return int(L.llama_state_seq_save_file(self.ctx, path.encode(), seq, arr, len(tokens)))

    def close(self) -> None:
        self.batch.free()
        if self.ctx:
            L.llama_free(self.ctx)
            self.ctx = None
        if self.model:
            L.llama_model_free(self.model)
            self.model = None
