"""The small typed values and protocols the layers share: state buffers, checkpoints and
their cells, the constraint protocols (``TokenMatcher``, ``VocabCompiler``), fill-in-the-middle
tokens, ``lcp``. A request's own types are ``server.task``; an image's, ``server.image_types``.

A leaf module: it imports nothing from the package, so every layer may import it."""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NewType, Protocol, TypeVar

if TYPE_CHECKING:
    import numpy as np

# Sequence state bytes live in one buffer (a ctypes array or a bytearray), never a list.
StateBuf = ctypes.Array | bytearray
# A LoRA adapter loaded off the engine thread, opaque above the llama package: only the
# backend that loaded it (LlamaBackend.load_adapter) reads it, in attach_adapter.
AdapterHandle = NewType("AdapterHandle", object)


def lcp(a: Sequence[object], b: Sequence[object]) -> int:
    """Length of the longest common prefix, compared in 64-token slices at C speed (items
    compared with ``==``: tokens, or whole prompt items, ``prefix.items``)."""
    n = min(len(a), len(b))
    i = 0
    step = 64
    while i + step <= n and a[i : i + step] == b[i : i + step]:
        i += step
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass
class Checkpoint:
    """Partial sequence state (the SWA / recurrent part) taken when the slot held
    ``n_tokens`` tokens; positions [pos_min, pos_max] are covered by ``data``."""

    n_tokens: int
    pos_min: int
    pos_max: int
    data: StateBuf
    data_dft: bytes = b""

    @property
    def nbytes(self) -> int:
        return len(self.data) + len(self.data_dft)


@dataclass
class CacheCells:
    """The cells one KV cache holds (``kind`` "full" or "swa"): cell i is at ``pos[i]`` and
    belongs to the sequences ``seqs[i]``. Read from llama.cpp's state bytes."""

    kind: str
    pos: list[int] = field(default_factory=list)
    seqs: list[tuple[int, ...]] = field(default_factory=list)
    # the ggml types of the K and V rows, every layer's (empty when no rows were read)
    k_types: set[int] = field(default_factory=set)
    v_types: set[int] = field(default_factory=set)

    def positions_of(self, seq: int) -> list[int]:
        return [p for p, ss in zip(self.pos, self.seqs, strict=True) if seq in ss]


@dataclass(frozen=True)
class Constraint:
    """A checked constraint, independent of any vocabulary (server.constrained makes them).
    ``kind`` is ``json_schema``, ``json_object``, ``gbnf`` or ``lark``; ``key`` is the
    canonical text (equal keys, equal constraints: the compile caches key on it);
    ``grammar`` is llguidance's grammar text."""

    kind: str
    key: str
    grammar: str


class TokenMatcher(Protocol):
    """One task's position in its constraint (server.constrained.Matcher): the engine
    thread asks and advances it token by token."""

    def allows(self, token: int) -> bool: ...
    def accept(self, token: int) -> bool: ...
    def forced(self, limit: int) -> list[int]:
        """The tokens the constraint forces next (at most ``limit``; not advanced)."""
        ...

    def mask_logits(self, logits: np.ndarray) -> int: ...
    def is_done(self) -> bool: ...
    def is_error(self) -> bool: ...
    def error(self) -> str: ...


class TokenConstraint(Protocol):
    """A constraint bound to the model's vocabulary; ``matcher()`` starts one task on it."""

    def matcher(self) -> TokenMatcher: ...


class VocabCompiler(Protocol):
    """Binds constraints to one model's vocabulary (server.constrained.ConstraintCompiler).
    ``LlamaBackend.constraint_compiler`` hands one out, built on first use by the factory the
    app passes it: llama/ does not import server.constrained."""

    def compile(self, c: Constraint) -> TokenConstraint: ...


# (the backend's vocabulary handle, end-of-generation token ids) -> that vocabulary's
# compiler; generic in the handle: LlamaBackend takes a CompilerFactory[llama_vocab_p] (this
# leaf module does not name llama_cpp's types)
V = TypeVar("V")
CompilerFactory = Callable[[V, Sequence[int]], VocabCompiler]

TOKEN_NULL = -1  # llama.cpp's LLAMA_TOKEN_NULL


@dataclass(frozen=True)
class FimTokens:
    """The vocabulary's fill-in-the-middle tokens (TOKEN_NULL where it has none): read by
    the backend, used by server.prompts.infill_prompt to build /infill prompts."""

    pre: int = TOKEN_NULL
    suf: int = TOKEN_NULL
    mid: int = TOKEN_NULL
    rep: int = TOKEN_NULL
    sep: int = TOKEN_NULL

    def missing(self) -> str:
        """llama-server's list of the missing required tokens ("" when infill works)."""
        out = ""
        if self.pre == TOKEN_NULL:
            out += "prefix token is missing. "
        if self.suf == TOKEN_NULL:
            out += "suffix token is missing. "
        if self.mid == TOKEN_NULL:
            out += "middle token is missing. "
        return out
