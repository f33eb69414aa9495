"""Constraints bound to the model's vocabulary, and the per-request matcher the engine drives.

Binding (``ConstraintCompiler.compile``) builds llguidance's lexer and parser tables for the
vocabulary once per constraint key and keeps a pristine matcher in an LRU cache; a request
gets a copy of it (``CompiledConstraint.matcher``), which costs microseconds. Per step the
engine asks ``allows(token)`` for the token it sampled without the constraint, and computes
the full mask (``mask_logits``) only when that token is refused, as llama.cpp's
common/sampling.cpp does."""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from llguidance import LLMatcher, LLTokenizer, TokenizerWrapper

from .spec import Constraint, ConstraintError

if TYPE_CHECKING:  # a ctypes handle's type only: llama.cpp is loaded inside from_llama
    from llama_cpp import llama_vocab_p

CACHE_SIZE = 64  # compiled constraints kept per vocabulary
# The binding thread's stack: eight times a compile child's (worker.CHILD_STACK), so a
# grammar that compiled there cannot overflow here (llguidance builds it again, recursing
# as deep, when it binds it to the vocabulary).
COMPILE_STACK = 64 << 20

_executor: ThreadPoolExecutor | None = None
_executor_lock = threading.Lock()


def compile_executor() -> ThreadPoolExecutor:
    """The one thread that binds constraints to the vocabulary (``ConstraintCompiler.compile``
    is one compile at a time anyway), with a ``COMPILE_STACK`` stack."""
    global _executor
    with _executor_lock:
        if _executor is None:
            old = threading.stack_size(COMPILE_STACK)
            try:
                _executor = ThreadPoolExecutor(1, thread_name_prefix="constraint-compile")
                _executor.submit(lambda: None).result()  # the thread starts now, big stack
            finally:
                threading.stack_size(old)
        return _executor


class ConstraintVocab:
    """The model's vocabulary as llguidance sees it: token bytes, the end-of-generation
    tokens, and the model's tokenizer (for literal text in grammars). Build once per model."""

    def __init__(self, tokenizer: LLTokenizer, n_vocab: int, eog: Sequence[int] = ()) -> None:
        self.tokenizer = tokenizer
        self.n_vocab = n_vocab
        self.n_words = (n_vocab + 31) // 32  # int32 words of one token bitmask
        self.eog = tuple(eog)

    @classmethod
    def from_pieces(
        cls,
        pieces: Sequence[bytes],
        eog: Sequence[int],
        tokenize: Callable[[bytes], list[int]],
        special: Sequence[int] = (),
    ) -> ConstraintVocab:
        """From each token's bytes (``b"\\xff<name>"`` for a special token, llguidance's
        convention), the end-of-generation ids, and a bytes -> ids tokenizer."""
        return cls(
            LLTokenizer(TokenizerWrapper(_Wrapped(pieces, eog, tokenize, special))),
            len(pieces),
            eog,
        )

    @classmethod
    def from_llama(cls, vocab: llama_vocab_p, eog: Sequence[int]) -> ConstraintVocab:
        """From a llama.cpp vocabulary (``llama_model_get_vocab``); ``eog`` are the ids that
        end generation (EOS, end-of-turn). Literal text in grammars is tokenized by llama.cpp
        itself. About a second for a 262k-token vocabulary: build once per model."""
        import ctypes

        import llama_cpp as L

        n = L.llama_vocab_n_tokens(vocab)
        buf = ctypes.create_string_buffer(1024)
        control = L.LLAMA_TOKEN_ATTR_CONTROL
        user = L.LLAMA_TOKEN_ATTR_USER_DEFINED
        tokens: list[bytes] = []
        for t in range(n):
            k = L.llama_token_to_piece(vocab, t, buf, 1024, 0, True)
            piece = buf.raw[: max(k, 0)]
            attr = L.llama_vocab_get_attr(vocab, t)
            # llguidance's convention (its llamacpp.py): special tokens start with 0xff
            if attr & control or (attr & user and piece[:1] == b"<" and piece[-1:] == b">"):
                piece = b"\xff" + piece
            tokens.append(piece)
        fptr = ctypes.cast(L.llama_cpp._lib.llama_tokenize, ctypes.c_void_p).value
        # llguidance's stubs lack from_llamacpp (it is in the extension module)
        tok = LLTokenizer.from_llamacpp(  # type: ignore[attr-defined]
            tokens=tokens, vocab_ptr=vocab, tokenize_fptr=fptr, eos_token=list(eog), slices=None
        )
        return cls(tok, n, eog)


@dataclass
class _Wrapped:
    """What llguidance's TokenizerWrapper reads from a tokenizer object."""

    tokens: Sequence[bytes]
    eog: Sequence[int]
    tokenize: Callable[[bytes], list[int]]
    special_token_ids: Sequence[int] = ()
    bos_token_id: int | None = None

    @property
    def eos_token_id(self) -> int:
        return self.eog[0]

    def __call__(self, text: bytes | str) -> list[int]:
        return self.tokenize(text.encode() if isinstance(text, str) else text)


class Matcher:
    """One request's position in its constraint. Not thread-safe: the engine thread owns it.

    Contract: after ``accept(t)`` returned True, ``allows``/``mask_logits`` describe the
    next token. ``is_done()``: nothing may follow (finish with "stop"); ``can_end()``: an
    end-of-generation token is allowed now. A refused ``accept`` puts the matcher in an error
    state for good (``error()`` says why): ask ``allows`` first."""

    def __init__(self, m: LLMatcher, vocab: ConstraintVocab) -> None:
        self._m = m
        self._vocab = vocab
        self._mask = np.zeros(vocab.n_words, dtype=np.int32)
        self._bits = np.arange(32, dtype=np.uint32)

    def allows(self, token: int) -> bool:
        """Whether ``token`` may come next (checks one token; does not advance)."""
        return self._m.validate_tokens([token]) == 1

    def accept(self, token: int) -> bool:
        """Advance over ``token``; False (and the error state) when it is not allowed."""
        return self._m.consume_token(token)

    def forced(self, limit: int) -> list[int]:
        """The tokens that must come next, at most ``limit`` (does not advance): llguidance's
        fast-forward, the canonical tokenization (llama.cpp's tokenizer) of the bytes the
        constraint forces here, less a last token that could merge with what follows. A
        frame's literal parts come out this way as the same text tokenizes in the next
        turn's prompt. Empty where the next bytes are the model's choice."""
        return self._m.compute_ff_tokens()[:limit] if limit > 0 else []

    def allowed_mask(self) -> np.ndarray:
        """A bool array over the vocabulary: True where the token may come next."""
        self._m.unsafe_compute_mask_ptr(self._mask.ctypes.data, self._mask.nbytes)
        bits = (self._mask.view(np.uint32)[:, None] >> self._bits) & 1
        return bits.reshape(-1)[: self._vocab.n_vocab].astype(bool)

    def mask_logits(self, logits: np.ndarray) -> int:
        """Set the logits of refused tokens to -inf in place (``logits`` covers at least the
        vocabulary; entries past it are refused too). Returns how many tokens stay allowed."""
        allowed = self.allowed_mask()
        n = self._vocab.n_vocab
        logits[n:] = -np.inf
        np.putmask(logits[:n], ~allowed, -np.inf)
        return int(allowed.sum())

    def is_done(self) -> bool:
        """The constraint is complete and admits no further token (but end-of-generation)."""
        return self._m.is_stopped() and not self._m.is_error()

    def can_end(self) -> bool:
        """The output so far is complete: generation may end here."""
        return self._m.is_accepting()

    def is_error(self) -> bool:
        return self._m.is_error()

    def error(self) -> str:
        return self._m.get_error()

    def rollback(self, n: int) -> bool:
        """Undo the last ``n`` accepted tokens."""
        return self._m.rollback(n)

    def reset(self) -> bool:
        """Back to the start of the constraint."""
        return self._m.reset()


@dataclass(frozen=True)
class CompiledConstraint:
    """A constraint bound to one vocabulary; ``matcher()`` gives each request its own copy."""

    constraint: Constraint
    vocab: ConstraintVocab
    _pristine: LLMatcher

    @property
    def key(self) -> str:
        return self.constraint.key

    def matcher(self) -> Matcher:
        """A fresh matcher at the start of the constraint (a copy: microseconds)."""
        return Matcher(self._pristine.deep_copy(), self.vocab)


class ConstraintCompiler:
    """Binds constraints to one vocabulary, each key once (an LRU cache of ``CACHE_SIZE``).
    Thread-safe; compile in a worker thread, never on the engine thread (a large schema
    takes tens of milliseconds). ``n_compiled`` counts actual compilations."""

    def __init__(self, vocab: ConstraintVocab, cache_size: int = CACHE_SIZE) -> None:
        self.vocab = vocab
        self.cache_size = cache_size
        self.n_compiled = 0
        self._cache: collections.OrderedDict[tuple[str, str], CompiledConstraint] = (
            collections.OrderedDict()
        )
        self._lock = threading.Lock()  # the cache
        self._compile_lock = threading.Lock()
        # constraints that failed to bind, so a resent one fails at once (under _compile_lock)
        self._failed: collections.OrderedDict[tuple[str, str], ConstraintError] = (
            collections.OrderedDict()
        )

    def compile(self, c: Constraint) -> CompiledConstraint:
        """``c`` bound to the vocabulary; ConstraintError when that fails (e.g. a grammar
        naming a special token the vocabulary lacks)."""
        k = (c.kind, c.key)
        hit = self._lookup(k)
        if hit is not None:
            return hit
        # one compile at a time: requests that bring the same new schema together wait for
        # the first one's result instead of compiling it again
        with self._compile_lock:
            hit = self._lookup(k)
            if hit is not None:
                return hit
            failed = self._failed.get(k)
            if failed is not None:
                raise ConstraintError(failed.where, failed.reason)
            try:
                out = CompiledConstraint(c, self.vocab, _bound(self.vocab, c))
            except ConstraintError as e:
                self._failed[k] = e
                while len(self._failed) > self.cache_size:
                    self._failed.popitem(last=False)
                raise
            with self._lock:
                self.n_compiled += 1
                self._cache[k] = out
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
            return out

    def _lookup(self, k: tuple[str, str]) -> CompiledConstraint | None:
        with self._lock:
            hit = self._cache.get(k)
            if hit is not None:
                self._cache.move_to_end(k)
            return hit


def _bound(vocab: ConstraintVocab, c: Constraint) -> LLMatcher:
    """A pristine matcher for ``c`` over ``vocab``; ConstraintError when llguidance refuses
    it, or when it admits no output at all (a schema that only refers to itself): a request
    constrained by it could only ever write nothing."""
    where = "grammar" if c.kind in ("gbnf", "lark") else "#"
    m = LLMatcher(vocab.tokenizer, c.grammar, log_level=0)
    if m.is_error():
        raise ConstraintError(where, m.get_error())
    if not m.is_accepting() and not _allows_text(vocab, m):
        raise ConstraintError(where, "it admits no output (no value is valid)")
    return m


def _allows_text(vocab: ConstraintVocab, m: LLMatcher) -> bool:
    """Whether some token other than an end-of-generation one may come first (llguidance
    lets those through even where the output so far is not complete)."""
    mask = np.frombuffer(m.compute_bitmask(), dtype=np.uint32).copy()
    for t in vocab.eog:
        mask[t // 32] &= ~np.uint32(1 << (t % 32))
    return bool(mask.any())


def llama_compiler(vocab: llama_vocab_p, eog: Sequence[int]) -> ConstraintCompiler:
    """The compiler of a llama.cpp vocabulary (``llama_model_get_vocab``): the
    ``server.types.CompilerFactory`` the app gives ``LlamaBackend``."""
    return ConstraintCompiler(ConstraintVocab.from_llama(vocab, eog))
