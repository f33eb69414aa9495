"""The only module that talks to llama.cpp (through llama-cpp-python's low-level bindings).

Every method must be called from the engine thread that owns the context, except the
tokenizer helpers, which only read the (immutable) vocabulary.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from concurrent.futures import Executor
from dataclasses import dataclass

import llama_cpp as L
import numpy as np

from ..task import SamplingParams, TokenLogprob
from ..types import AdapterHandle, CompilerFactory, FimTokens, TokenMatcher, VocabCompiler
from .chain import ChainEnv, build_chain
from .greedy import GreedyBias
from .logits import check_pick, check_row
from .lora import LoraAdapters
from .memory import SeqMemory, memory_layout
from .mtmd import decode_embeddings
from .own_thread import run_on_own_thread
from .params import KV_TYPES, load_model
from .vocab import SpecialToken, special_tokens, tokenize

log = logging.getLogger("server.llama")

_LOG_LOCK = threading.Lock()
_BACKEND_READY = False
# end-of-generation tokens per model file (path, size, mtime): a model woken from sleep
# (loaded again in the same process) skips the vocabulary pass
_EOG_BY_FILE: dict[tuple[str, int, int], tuple[int, ...]] = {}


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
    # --kv-unified-per-slot: a slot's context is at most this (0: no cap)
    n_ctx_slot_cap: int = 0
    swa_full: bool = False
    # one sequence more than the slots, --cache-reuse's scratch (unified KV only)
    scratch_seq: bool = False
    flash_attn: str = "auto"  # on | off | auto
    seed: int = -1
    # -bs: a slot's sampler chain runs inside the decode graph when every stage of it can
    # (greedy, temperature, top-k, top-p, min-p, dist); only the chosen token comes back
    backend_sampling: bool = False
    # logits rows one sequence may ask for in one decode: 1 + the longest speculative draft
    # (the -bs output buffer is sized by it)
    outputs_per_seq: int = 1
    # --embedding: the context may compute embeddings (switched on per decode by
    # set_embeddings), pooled with ``pooling`` (a llama_pooling_type; -1: the model's own)
    embeddings: bool = False
    pooling: int = -1
    # KV cache data types (-ctk / -ctv: server.llama.params.KV_TYPES names)
    type_k: str = "f16"
    type_v: str = "f16"
    # model placement and loading (llama_model_params; server.llama.params.model_params)
    split_mode: str = "layer"
    tensor_split: tuple[float, ...] = ()
    main_gpu: int = 0
    load_mode: str = "auto"
    tensor_overrides: tuple[tuple[str, str], ...] = ()  # (pattern, buffer type name)
    lora_paths: tuple[str, ...] = ()  # --lora / --lora-scaled files, in id order (llama/lora.py)


class LlamaBatch:
    """A reusable llama_batch of fixed capacity; one sequence id per token.

    Its token, position, sequence and output-flag arrays are filled through numpy views: a
    span or a whole step's generating slots cost a few array copies, not a Python loop over
    tokens. Each token's ``seq_id`` pointer points into one contiguous int32 array (the
    pointers llama_batch_init allocated are kept, and restored before llama_batch_free)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.raw = L.llama_batch_init(capacity, 0, 1)
        self.n = 0
        raw = self.raw
        ones = (ctypes.c_int32 * capacity)(*([1] * capacity))
        ctypes.memmove(raw.n_seq_id, ones, ctypes.sizeof(ones))
        self._tok = np.ctypeslib.as_array(raw.token, shape=(capacity,))
        self._pos = np.ctypeslib.as_array(raw.pos, shape=(capacity,))
        self._logits = np.ctypeslib.as_array(
            ctypes.cast(raw.logits, ctypes.POINTER(ctypes.c_int8)), shape=(capacity,)
        )
        self._seq = np.zeros(capacity, dtype=np.int32)
        assert ctypes.sizeof(ctypes.c_void_p) == 8
        ptrs = np.ctypeslib.as_array(
            ctypes.cast(raw.seq_id, ctypes.POINTER(ctypes.c_uint64)), shape=(capacity,)
        )
        self._own_seq_ptrs = ptrs.copy()
        ptrs[:] = self._seq.ctypes.data + 4 * np.arange(capacity, dtype=np.uint64)
        self._seq_ptrs = ptrs

    def clear(self) -> None:
        self.n = 0

    def add_span(self, tokens: list[int], pos0: int, seq: int, logits_last: bool) -> int:
        """Append tokens at positions pos0.. for seq; returns the batch index of the last one."""
        n = len(tokens)
        i0 = self.n
        i1 = i0 + n
        if i1 > self.capacity:
            raise ValueError("batch overflow")
        self._tok[i0:i1] = tokens
        self._pos[i0:i1] = range(pos0, pos0 + n)
        self._seq[i0:i1] = seq
        self._logits[i0:i1] = 0
        if logits_last:
            self._logits[i1 - 1] = 1
        self.n = i1
        return i1 - 1

    def outputs_all(self) -> None:
        """Mark every token of the batch as an output (embeddings mode wants them all)."""
        self._logits[: self.n] = 1

    def add_tokens(self, tokens: list[int], pos: list[int], seqs: list[int]) -> int:
        """Append one token per entry (token, position, sequence), each with its logits
        requested: a step's generating slots in one go. Returns the index of the first."""
        i0 = self.n
        i1 = i0 + len(tokens)
        if i1 > self.capacity:
            raise ValueError("batch overflow")
        self._tok[i0:i1] = tokens
        self._pos[i0:i1] = pos
        self._seq[i0:i1] = seqs
        self._logits[i0:i1] = 1
        self.n = i1
        return i0

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
            self._seq_ptrs[:] = self._own_seq_ptrs  # llama_batch_free frees these
            L.llama_batch_free(self.raw)
            self.raw = None


_TOKEN_DATA = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])  # llama_token_data


class _Candidates:
    """A reusable llama_token_data_array over the whole vocabulary, filled from a logits
    row with numpy (no Python loop), for sampling from logits the server has modified."""

    def __init__(self, n_vocab: int) -> None:
        assert ctypes.sizeof(L.llama_token_data) == _TOKEN_DATA.itemsize
        self.n = n_vocab
        self.data = (L.llama_token_data * n_vocab)()
        # ctypes arrays export the buffer protocol; typeshed's Array does not declare it
        self.view = np.frombuffer(self.data, dtype=_TOKEN_DATA)  # type: ignore[call-overload]
        self.ids = np.arange(n_vocab, dtype=np.int32)
        self.arr = L.llama_token_data_array(data=self.data, size=n_vocab, selected=-1, sorted=False)

    def sample(self, chain: L.llama_sampler_p, logits: np.ndarray) -> int:
        """What ``llama_sampler_sample`` does, from ``logits``, without accepting the token."""
        v = self.view
        v["id"] = self.ids  # samplers reorder the array in place
        v["logit"] = logits
        v["p"] = 0.0
        a = self.arr
        # the field is a pointer; the bindings annotate it with the array type
        a.data = ctypes.cast(self.data, ctypes.POINTER(L.llama_token_data))  # type: ignore[assignment]
        a.size, a.selected, a.sorted = self.n, -1, False
        L.llama_sampler_apply(chain, ctypes.byref(a))
        return int(a.data[a.selected].id)

    def post_probs(self, tok: int, n: int) -> TokenLogprob:
        """The distribution the chain left after the last ``sample`` (llama-server's
        post_sampling_probs): ``tok``'s log-probability and the ``n`` likeliest candidates',
        those of probability 0 left out as there. numpy over the remaining candidates."""
        a = self.arr
        # a.data is a pointer (annotated as an array), rows a ctypes array (a buffer)
        first = a.data.contents  # type: ignore[attr-defined]
        rows = (L.llama_token_data * a.size).from_address(ctypes.addressof(first))
        v = np.frombuffer(rows, dtype=_TOKEN_DATA)  # type: ignore[call-overload]
        p = v["p"]
        k = min(n, len(p))
        top = np.argpartition(-p, k - 1)[:k] if 0 < k < len(p) else np.arange(k)
        top = top[np.argsort(-p[top], kind="stable")]
        top = top[p[top] > 0.0]
        sel = float(p[a.selected]) if 0 <= a.selected < len(p) else 0.0
        logp = float(np.log(sel)) if sel > 0.0 else float("-inf")
        return TokenLogprob(tok, logp, [(int(v["id"][i]), float(np.log(p[i]))) for i in top])


class Sampler:
    """One llama_sampler chain for one task; freed when the task ends."""

    def __init__(
        self, ptr: L.llama_sampler_p, stateful: bool = False, greedy: bool = False
    ) -> None:
        self.ptr = ptr
        # whether accepting a token changes the chain (penalties remember recent tokens)
        self.stateful = stateful
        # the chain is greedy after at most a logit bias (no penalties): its token is the
        # argmax of the logits, biased by ``bias`` when there is one
        self.greedy = greedy
        self.bias: GreedyBias | None = None
        # the context and sequence the chain is attached to for backend sampling (-bs)
        self._ctx: L.llama_context_p | None = None
        self.seq = -1
        # post_sampling_probs: candidates to report per sampled row (0: off), and what the
        # chain left at each row sampled since (Backend.sampled_logprobs takes them)
        self.n_post = 0
        self.argmax_only = False  # temperature 0: the chain picks the largest logit
        self.post: dict[int, TokenLogprob] = {}

    def free(self) -> None:
        if self.ptr:
            if self._ctx is not None:
                # the context holds the chain while attached: detach before freeing it
                L.llama_set_sampler(self._ctx, self.seq, None)
                self._ctx, self.seq = None, -1
            L.llama_sampler_free(self.ptr)
            self.ptr = None  # type: ignore[assignment]  # freed: the chain is not used again


def window_cache_slides(
    n_swa: int, n_ctx: int, n_seq_max: int, n_ubatch: int, unified: bool
) -> bool:
    """Whether a sliding-window cache is smaller than the context (``n_swa`` 0: none, or
    --swa-full). llama_kv_cache_iswa sizes it GGML_PAD(min(n_ctx, n_swa * n_seq_max (one
    sequence's when not unified) + n_ubatch), 256) cells."""
    if n_swa <= 0:
        return False
    want = n_swa * (n_seq_max if unified else 1) + n_ubatch
    return -(-min(n_ctx, want) // 256) * 256 < n_ctx


def _wants_scratch(model: L.llama_model_p, opts: ModelOptions) -> bool:
    """Whether to allocate --cache-reuse's scratch sequence (``scratch_seq``: the sequence
    id engine/cache_reuse.py parks chunks in; -1: none): only under unified KV and where
    positions can move (full attention or --swa-full, not recurrent), so that a
    sliding-window cache keeps its size (it grows with the sequence count)."""
    n_swa, recurrent, _ = memory_layout(model, opts.swa_full)
    return opts.scratch_seq and opts.kv_unified and n_swa == 0 and not recurrent


def context_params(
    opts: ModelOptions, n_ctx_train: int, scratch: bool
) -> tuple[L.llama_context_params, int]:
    """llama_context_params from the options, and the decode thread count; ``scratch``: one
    sequence more than the slots (--cache-reuse)."""
    cparams = L.llama_context_default_params()
    cparams.n_ctx = opts.n_ctx if opts.n_ctx > 0 else n_ctx_train
    cparams.n_batch = opts.n_batch
    cparams.n_ubatch = min(opts.n_ubatch, opts.n_batch)
    cparams.n_seq_max = opts.n_parallel + (1 if scratch else 0)
    threads = opts.n_threads if opts.n_threads > 0 else max(1, (os.cpu_count() or 2))
    cparams.n_threads = threads
    cparams.n_threads_batch = opts.n_threads_batch if opts.n_threads_batch > 0 else threads
    cparams.kv_unified = opts.kv_unified
    cparams.swa_full = opts.swa_full
    cparams.no_perf = True
    cparams.flash_attn_type = {"on": 1, "off": 0}.get(opts.flash_attn, -1)
    cparams.type_k = KV_TYPES[opts.type_k]
    cparams.type_v = KV_TYPES[opts.type_v]
    if opts.backend_sampling:
        # as llama-server: one output per slot per decode (more with speculation: its draft
        # rows). The output buffer then holds that many rows of sampled logits,
        # probabilities and candidates, not n_batch rows (gigabytes for a 262k vocabulary)
        cparams.n_outputs_max = opts.n_parallel * opts.outputs_per_seq
        cparams.n_outputs_max_per_seq = opts.outputs_per_seq
    if opts.embeddings:
        cparams.pooling_type = opts.pooling  # embeddings stay off until set_embeddings(True)
    return cparams, threads


def _slot_context(n_ctx_seq: int, n_ctx_train: int) -> int:
    """As llama-server: a slot never holds more than the model was trained on (the KV cache
    keeps its size: more slots fit at once)."""
    if 0 < n_ctx_train < n_ctx_seq:
        log.warning(
            "the slot context (%d) exceeds the training context of the model (%d) - capping",
            n_ctx_seq,
            n_ctx_train,
        )
        return n_ctx_train
    return n_ctx_seq


def _fim_tokens(vocab: L.llama_vocab_p) -> FimTokens:
    """The vocabulary's fill-in-the-middle tokens (-1, LLAMA_TOKEN_NULL, where it has none)."""
    return FimTokens(
        pre=L.llama_vocab_fim_pre(vocab),
        suf=L.llama_vocab_fim_suf(vocab),
        mid=L.llama_vocab_fim_mid(vocab),
        rep=L.llama_vocab_fim_rep(vocab),
        sep=L.llama_vocab_fim_sep(vocab),
    )


class LlamaBackend(SeqMemory):
    """Model + context + vocabulary; implements the engine's Backend protocol (its
    sequence memory and state through SeqMemory)."""

    # constrained decoding, prepared on first use: the token array of sample_constrained,
    # and the vocabulary's compiler (constraint_compiler; the lock guards its lazy build)
    _candidates: _Candidates | None = None
    _constraints: VocabCompiler | None = None
    _constraints_lock = threading.Lock()
    # llama.cpp's model (its context and memory: SeqMemory's); None once closed
    model: L.llama_model_p | None

    def __init__(
        self, opts: ModelOptions, compiler: CompilerFactory[L.llama_vocab_p] | None = None
    ) -> None:
        """Loads the model and creates the context. ``compiler`` builds the vocabulary's
        constraint compiler on first use (server.constrained's, passed in by the app);
        without it, ``constraint_compiler`` raises."""
        _init_backend()
        self._compiler_factory = compiler
        if not os.path.isfile(opts.path):
            raise FileNotFoundError(f"model file not found: {opts.path}")
        self.opts = opts
        self.model, self._mparams = load_model(opts)  # the params' arrays live with the model
        self.vocab = L.llama_model_get_vocab(self.model)
        self.n_vocab = L.llama_vocab_n_tokens(self.vocab)
        self.n_ctx_train = L.llama_model_n_ctx_train(self.model)
        self.scratch_seq = opts.n_parallel if _wants_scratch(self.model, opts) else -1
        cparams, threads = context_params(opts, self.n_ctx_train, self.scratch_seq >= 0)
        self.ctx = L.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            raise RuntimeError("failed to create llama context (out of memory?)")
        self.mem = L.llama_get_memory(self.ctx)
        self.lora = LoraAdapters(self.model, self.ctx, list(opts.lora_paths), opts.path)
        self.n_ctx = L.llama_n_ctx(self.ctx)
        self.n_batch = L.llama_n_batch(self.ctx)
        self.n_ubatch = L.llama_n_ubatch(self.ctx)
        self.n_seq = opts.n_parallel
        self.kv_unified = opts.kv_unified
        n_ctx_seq = self.n_ctx if opts.kv_unified else self.n_ctx // opts.n_parallel
        if opts.n_ctx_slot_cap > 0:
            n_ctx_seq = min(n_ctx_seq, opts.n_ctx_slot_cap)
        self.n_ctx_slot = _slot_context(n_ctx_seq, self.n_ctx_train)
        self.n_swa, self.is_recurrent, self.kv_kinds = memory_layout(self.model, opts.swa_full)
        self.window_cache_slides = window_cache_slides(
            self.n_swa, self.n_ctx, L.llama_n_seq_max(self.ctx), self.n_ubatch, opts.kv_unified
        )
        # K/V ggml types of every layer (a state of others is refused); --context-shift
        self.kv_type_ids = (KV_TYPES[opts.type_k], KV_TYPES[opts.type_v])
        self.can_shift = bool(L.llama_memory_can_shift(self.mem))
        self.n_threads = threads
        self.seed = opts.seed
        self.backend_sampling = opts.backend_sampling
        self.batch = LlamaBatch(self.n_batch)
        self.state_file_version = L.LLAMA_STATE_SEQ_VERSION
        self._piece_cache: dict[int, bytes] = {}
        self._eog: dict[int, bool] = {}
        self._eog_all: tuple[int, ...] | None = None
        self.bos_id = L.llama_vocab_bos(self.vocab)
        self.bos_text = self._special_text(self.bos_id)
        self.eos_text = self._special_text(L.llama_vocab_eos(self.vocab))
        self.architecture = self.meta("general.architecture") or ""
        self.chat_template = self._model_chat_template()
        self.model_size = L.llama_model_size(self.model)
        self.n_params = L.llama_model_n_params(self.model)
        # --embedding: the pooling the context resolved (-1: embeddings off), the width of
        # an embedding, and what set_embeddings last switched the context to
        self.pooling = L.llama_pooling_type(self.ctx) if opts.embeddings else -1
        self.n_embd_out = L.llama_model_n_embd_out(self.model)
        self.n_cls_out = max(1, L.llama_model_n_cls_out(self.model))
        self._embeddings_on = False

    def _special_text(self, token: int) -> str:
        """A special token's text ('' for -1: the vocabulary has no such token)."""
        if token < 0:
            return ""
        return self.token_to_piece(token, special=True).decode("utf-8", "replace")

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

    @property
    def fim(self) -> FimTokens:
        """The fill-in-the-middle tokens /infill builds its prompt with (server.prompts.infill_prompt)."""
        return _fim_tokens(self.vocab)

    @property
    def add_bos(self) -> bool:
        """Whether the vocabulary starts a text with BOS (llama_vocab_get_add_bos)."""
        return bool(L.llama_vocab_get_add_bos(self.vocab))

    def special_tokens(self) -> list[SpecialToken] | None:
        """The vocabulary's special tokens (``vocab.special_tokens``), for cutting long texts
        before tokenizing; None when one is not UTF-8."""
        return special_tokens(self.vocab, self.n_vocab)

    def tokenize(
        self, text: str, add_special: bool = True, parse_special: bool = True
    ) -> list[int]:
        return tokenize(self.vocab, text, add_special, parse_special)

    def token_to_piece(self, token: int, special: bool = False) -> bytes:
        if not special:
            cached = self._piece_cache.get(token)
            if cached is not None:
                return cached
        if token < 0:  # an image's placeholder (issue 42): no text, and no id for llama.cpp
            return b""
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

    def eog_tokens(self) -> tuple[int, ...]:
        """Every end-of-generation token (``ignore_eos`` bans them all, as llama-server's
        ``logit_bias_eog``); one pass over the vocabulary (0.1-0.7 s on 262k tokens), at the
        first call for a model file in this process."""
        if self._eog_all is None:
            try:
                st = os.stat(self.opts.path)
                key: tuple[str, int, int] | None = (self.opts.path, st.st_size, st.st_mtime_ns)
            except (OSError, TypeError):
                key = None
            known = _EOG_BY_FILE.get(key) if key is not None else None
            if known is None:
                is_eog, v = L.llama_vocab_is_eog, self.vocab
                known = tuple(t for t in range(self.n_vocab) if is_eog(v, t))
                if key is not None:
                    _EOG_BY_FILE[key] = known
            self._eog_all = known
        return self._eog_all

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

    def decode_image(self, seq: int, pos0: int, embd: np.ndarray, non_causal: bool) -> int:
        """Decode an image's embeddings (server/llama/mtmd.py) into ``seq`` at positions
        pos0..; llama_decode's status. The runner's only (a memory operation)."""
        assert self.ctx is not None  # open: the engine decodes only between open and close
        return decode_embeddings(self.ctx, embd, pos0, seq, non_causal)

    def set_adapters(self, scales: tuple[float, ...]) -> None:
        """The LoRA scales the next decodes run under (one per loaded adapter; empty: none)."""
        self.lora.apply(scales)

    def check_adapter(self, fd: int) -> int:
        """Check an open adapter file before anything loads it; its size (LoraAdapters.check_fd)."""
        return self.lora.check_fd(fd)

    def load_adapter(self, fd: int) -> AdapterHandle:
        """Load a LoRA adapter from an open file, off the engine thread (LoraAdapters.load_fd)."""
        return AdapterHandle(self.lora.load_fd(fd))

    def attach_adapter(self, handle: AdapterHandle) -> int:
        """Give a loaded adapter its id; engine thread only (LoraAdapters.attach)."""
        assert isinstance(handle, ctypes._Pointer)  # load_adapter's result
        return self.lora.attach(handle)

    def set_embeddings(self, on: bool) -> None:
        """Switch the context to computing embeddings (every token of a decode is then an
        output, pooled per sequence) or back to logits only. Between decodes."""
        if on != self._embeddings_on:
            L.llama_set_embeddings(self.ctx, on)
            self._embeddings_on = on

    def embedding_of_seq(self, seq: int) -> np.ndarray | None:
        """The pooled embedding (rank pooling: the scores) of ``seq`` from the last decode, a
        copy; None when it has none."""
        ptr = L.llama_get_embeddings_seq(self.ctx, seq)
        if not ptr:
            return None
        n = self.n_cls_out if self.pooling == L.LLAMA_POOLING_TYPE_RANK else self.n_embd_out
        return np.ctypeslib.as_array(ptr, shape=(n,)).copy()

    def embedding_rows(self, start: int, count: int) -> np.ndarray | None:
        """Pooling none: the token embeddings of batch rows [start, start+count) of the last
        decode (every row is an output in embeddings mode), a copy; None when missing."""
        ptr = L.llama_get_embeddings(self.ctx)
        if not ptr:
            return None
        rows = np.ctypeslib.as_array(ptr, shape=(start + count, self.n_embd_out))
        return rows[start:].copy()

    def rerank_parts(self) -> tuple[str | None, int, int, int, bool, bool, bool]:
        """What a rerank prompt is built from (server.protocols.embedding_shapes.RerankParts): the model's
        "rerank" template (None: none), BOS, EOS (SEP without one), SEP, and whether the
        vocabulary adds BOS, EOS and SEP."""
        ptr = L.llama_model_chat_template(self.model, b"rerank")
        template = ptr.decode("utf-8", "replace") if isinstance(ptr, bytes) else None
        v = self.vocab
        eos, sep = L.llama_vocab_eos(v), L.llama_vocab_sep(v)
        adds = (L.llama_vocab_get_add_bos, L.llama_vocab_get_add_eos, L.llama_vocab_get_add_sep)
        add_bos, add_eos, add_sep = (bool(f(v)) for f in adds)
        bos = L.llama_vocab_bos(v)
        return template, bos, eos if eos >= 0 else sep, sep, add_bos, add_eos, add_sep

    def new_sampler(self, p: SamplingParams, history: list[int]) -> Sampler:
        """``p``'s sampler chain, in llama-server's order (server.llama.chain).

        ``history`` (recent prompt tokens) seeds the penalty and DRY windows.
        """
        env = ChainEnv(self.vocab, self.n_vocab, self.n_ctx_slot, self.seed)
        built = build_chain(p, env, history)
        smp = Sampler(built.ptr, stateful=built.stateful, greedy=built.greedy)
        if built.greedy and p.logit_bias:
            smp.bias = GreedyBias(p.logit_bias)
        smp.n_post, smp.argmax_only = p.post_probs, p.temperature <= 0.0
        return smp

    def sample(self, sampler: Sampler, idx: int) -> int:
        """The token ``sampler`` picks from output ``idx``. NonFiniteLogits (a client error,
        server.llama.logits) when the row holds NaN or +inf, or nothing above -inf."""
        if sampler.n_post:
            return self._sample_post(sampler, idx)
        if sampler.greedy and sampler._ctx is None:
            return self.argmax(idx, sampler.bias)
        if sampler._ctx is None:  # on the CPU: refuse a row nothing can be sampled from
            check_row(self._row(idx))
        # a chain attached to the backend returns the token the graph sampled (its logits
        # never leave the device: not checked)
        return L.llama_sampler_sample(sampler.ptr, self.ctx, idx)

    def _row(self, idx: int) -> np.ndarray:
        """Output ``idx``'s logits row, a view of the context's buffer (no copy)."""
        ptr = L.llama_get_logits_ith(self.ctx, idx)
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))

    def _sample_post(self, sampler: Sampler, idx: int, logits: np.ndarray | None = None) -> int:
        """``sample`` (from ``logits`` when given, else output ``idx``'s row) on the server's
        candidates array, keeping what the chain left there in ``sampler.post[idx]``. A
        temperature-0 chain computes no probabilities: its pick had probability 1, as
        llama-server reports it (its chain ends in a temperature-0 dist)."""
        if sampler.greedy and logits is None:
            tok = self.argmax(idx, sampler.bias)
        else:
            if logits is None:
                logits = self._row(idx)
                check_row(logits)
            if self._candidates is None:
                self._candidates = _Candidates(self.n_vocab)
            tok = self._candidates.sample(sampler.ptr, logits)
            L.llama_sampler_accept(sampler.ptr, tok)
        if sampler.argmax_only or self._candidates is None:  # (a greedy chain always is)
            sampler.post[idx] = TokenLogprob(tok, 0.0, [(tok, 0.0)])
        else:
            sampler.post[idx] = self._candidates.post_probs(tok, sampler.n_post)
        return tok

    def sampled_logprobs(self, sampler: Sampler, idx: int, token: int, n: int) -> TokenLogprob:
        """The log-probabilities to report for ``token`` sampled at output ``idx``: those of
        the chain's final distribution for a post_sampling_probs sampler, otherwise the
        model's (``top_logprobs``)."""
        post = sampler.post.pop(idx, None)
        return post if post is not None else self.top_logprobs(idx, token, n)

    def argmax(self, idx: int, bias: GreedyBias | None = None) -> int:
        """What a greedy chain (after ``bias``, if any) samples from output ``idx``: the first
        largest logit (llama.cpp's greedy sampler keeps the first of equal maxima, as numpy's
        argmax does). ~30x cheaper than ``llama_sampler_sample``, which first copies the whole
        vocabulary (262k entries on the default model) into a candidates array: that was ~1 ms
        per row, and a speculative verify of a 48-token draft samples up to 49 rows."""
        row = self._row(idx)
        best = int(row.argmax())
        check_pick(row, best)  # NaN is numpy's argmax; +inf a maximum
        return best if bias is None else bias.pick(row, best)

    def attach_sampler(self, sampler: Sampler, seq: int) -> bool:
        """Run ``sampler``'s chain inside the decode graph for sequence ``seq`` (-bs) until
        it is freed. The caller checks that every stage can run there (no penalties, grammar
        or logprobs: see server.engine.sampling_paths); False when llama.cpp refuses it (the chain then
        samples on the CPU as before)."""
        if not self.backend_sampling or not sampler.ptr:
            return False
        if not L.llama_set_sampler(self.ctx, seq, sampler.ptr):
            return False
        sampler._ctx, sampler.seq = self.ctx, seq
        return True

    def sample_many(self, items: list[tuple[Sampler, int]], pool: Executor | None) -> list[int]:
        """``sample`` for each (sampler, output) pair, concurrently on ``pool`` when given:
        ctypes releases the GIL during llama_sampler_sample, and distinct chains share no
        state. What the context does lazily on the first read of an output (synchronize, and
        put the output rows back in batch order) is done first, on this thread: the workers
        then only read the context. A greedy chain is an argmax (``sample``), on this thread
        when every chain is greedy: a hop to the pool would cost more than it."""
        # post_sampling_probs chains share the candidates array: this thread only
        one_thread = any(s.n_post for s, _ in items)
        if (
            pool is None
            or len(items) < 2
            or one_thread
            or all(s.greedy and s._ctx is None for s, _ in items)
        ):
            return [self.sample(s, i) for s, i in items]
        L.llama_get_logits_ith(self.ctx, items[0][1])  # synchronize + output_reorder
        return list(pool.map(lambda it: self.sample(it[0], it[1]), items))

    def sample_constrained(
        self, sampler: Sampler, idx: int, matcher: TokenMatcher, full_mask: bool = False
    ) -> int:
        """A token of output ``idx`` that ``matcher`` allows, sampled by ``sampler`` from the
        distribution restricted to the allowed tokens; -1 when none is allowed. The matcher is
        not advanced. As llama.cpp's common_sampler does: sample without the constraint first
        and compute the full mask only when that token is refused (the result has the same
        distribution); ``full_mask`` masks first, so that the logits that ``top_logprobs``
        reads afterwards are the constrained ones. NonFiniteLogits (server.llama.logits)
        for a row nothing can be sampled from, as ``sample``."""
        logits = self._row(idx)
        check_row(logits)  # before masking: a NaN row would admit no token
        if sampler.n_post:  # post_sampling_probs: report the constrained chain's distribution
            if matcher.mask_logits(logits) == 0:
                return -1
            return self._sample_post(sampler, idx, logits)
        if not sampler.stateful:
            # accepting a token is a no-op for this chain: llama_sampler_sample may accept
            # the refused first pick, and resamples from the masked row in place
            if not full_mask:
                tok = L.llama_sampler_sample(sampler.ptr, self.ctx, idx)
                if matcher.allows(tok):
                    return tok
            if matcher.mask_logits(logits) == 0:
                return -1
            return L.llama_sampler_sample(sampler.ptr, self.ctx, idx)
        # penalties count accepted tokens: sample without accepting, accept the final pick
        if self._candidates is None:
            self._candidates = _Candidates(self.n_vocab)
        cand = self._candidates
        if not full_mask:
            tok = cand.sample(sampler.ptr, logits)
            if matcher.allows(tok):
                L.llama_sampler_accept(sampler.ptr, tok)
                return tok
        # masked in place: the context's logits row now holds the constrained distribution
        if matcher.mask_logits(logits) == 0:
            return -1
        tok = cand.sample(sampler.ptr, logits)
        L.llama_sampler_accept(sampler.ptr, tok)
        return tok

    def accept_forced(self, sampler: Sampler, token: int) -> None:
        """A forced token joins the answer: the chains that remember tokens accept it (a
        stateless chain's accept is a no-op: skipped)."""
        if sampler.stateful and sampler.ptr:
            L.llama_sampler_accept(sampler.ptr, token)

    def constraint_compiler(self) -> VocabCompiler:
        """The vocabulary's constraint compiler, built on first use by the factory given to
        the constructor (about 1.3 s for a 262k-token vocabulary: only servers that get
        constrained requests pay). Any thread. RuntimeError without a factory."""
        with self._constraints_lock:
            if self._constraints is None:
                if self._compiler_factory is None:
                    raise RuntimeError("this backend was built without a constraint compiler")
                eog = [t for t in range(self.n_vocab) if L.llama_vocab_is_eog(self.vocab, t)]
                self._constraints = self._compiler_factory(self.vocab, eog)
            return self._constraints

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
            # a constrained row holds -inf for refused tokens: they are no alternatives
            top = [(int(i), float(logits[i]) - lse) for i in ids if logits[i] > -np.inf]
        return TokenLogprob(token, float(logits[token]) - lse, top)

    def warmup(self) -> None:
        """llama-server's --warmup: decode BOS and EOS once and clear the memory, so the first
        request does not pay for first-use costs (buffer allocation, page faults, graph
        setup). Before the engine starts (the loader thread owns the context then). The
        decode runs on a thread of its own (server.llama.own_thread: libgomp's pools)."""
        ret = run_on_own_thread(self._warmup_decode, "warmup")
        if ret != 0:
            log.warning("warm-up decode failed (%d)", ret)

    def _warmup_decode(self) -> int:
        vocab = self.vocab
        toks = [t for t in (L.llama_vocab_bos(vocab), L.llama_vocab_eos(vocab)) if t >= 0] or [0]
        self.batch.clear()
        self.batch.add_span(toks, 0, 0, logits_last=True)
        ret = self.decode(0, self.batch.n)
        self.batch.clear()
        L.llama_memory_clear(self.mem, True)
        L.llama_synchronize(self.ctx)
        return ret

    def free_context(self) -> None:
        """Sleep level 1: the context and its KV cache freed, the model (weights) kept;
        ``open_context`` makes a new context before the next use."""
        if self.ctx:
            L.llama_free(self.ctx)
            self.ctx = None
            self.mem = None

    def open_context(self) -> None:
        """A new context for the kept model, with the options of the first (its sizes are
        those already read: the same parameters give the same context)."""
        cparams, _ = context_params(self.opts, self.n_ctx_train, self.scratch_seq >= 0)
        ctx = L.llama_init_from_model(self.model, cparams)
        if not ctx:
            raise RuntimeError("failed to create llama context (out of memory?)")
        self.ctx, self.mem = ctx, L.llama_get_memory(ctx)
        self.lora.rebind(ctx)
        self._embeddings_on = False

    def close(self) -> None:
        self.batch.free()
        if self.ctx:
            L.llama_free(self.ctx)
            self.ctx = None
        if self.model:
            L.llama_model_free(self.model)
            self.model = None
