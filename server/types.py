"""Typed values that flow between routes, the slot engine, the caches and the backend.

A leaf module: it imports nothing from the package, so every layer may import it."""

from __future__ import annotations

import ctypes
import enum
import itertools
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple, NewType, Protocol, TypeVar

if TYPE_CHECKING:
    import numpy as np

import numpy as np

# Sequence state bytes live in one buffer (a ctypes array or a bytearray), never a list.
StateBuf = ctypes.Array | bytearray
# A LoRA adapter loaded off the engine thread, opaque above the llama package: only the
# backend that loaded it (LlamaBackend.load_adapter) reads it, in attach_adapter.
AdapterHandle = NewType("AdapterHandle", object)

_task_ids = itertools.count(1)


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


# llama-server's sampler names (common_sampler_type_to_str) and their --sampler-seq letters
SAMPLER_NAMES: dict[str, str] = {
    "dry": "d",
    "top_k": "k",
    "typ_p": "y",
    "top_p": "p",
    "top_n_sigma": "s",
    "min_p": "m",
    "temperature": "t",
    "xtc": "x",
    "infill": "i",
    "penalties": "e",
    "adaptive_p": "a",
}
# llama-server's default chain order (common_params_sampling.samplers)
DEFAULT_SAMPLERS: tuple[str, ...] = (
    "penalties",
    "dry",
    "top_n_sigma",
    "top_k",
    "typ_p",
    "top_p",
    "min_p",
    "xtc",
    "temperature",
)

_SAMPLER_ALIASES = {"nucleus": "top_p", "temp": "temperature", "typ": "typ_p"}
MAX_SAMPLERS = 64  # stages in a ``samplers`` order (llama-server repeats them as given)


def sampler_order(spec: str | list[str]) -> tuple[str, ...]:
    """llama-server's ``samplers``: a list of names (its canonical ones, kebab-case or
    without underscores, ``nucleus``/``temp``/``typ``, any case) or a string of
    --sampler-seq letters, as canonical names in order. Unlike llama-server, which skips
    an unknown one, ValueError names it."""
    if len(spec) > MAX_SAMPLERS:
        raise ValueError(f"at most {MAX_SAMPLERS} samplers")
    if isinstance(spec, str):
        by_letter = {c: n for n, c in SAMPLER_NAMES.items()}
        bad = [c for c in spec if c not in by_letter]
        if bad:
            raise ValueError(f"unknown sampler letter {bad[0]!r} (known: {''.join(by_letter)})")
        return tuple(by_letter[c] for c in spec)
    out = []
    for name in spec:
        key = name.lower()
        key = _SAMPLER_ALIASES.get(key, key)
        found = [n for n in SAMPLER_NAMES if key in (n, n.replace("_", "-"), n.replace("_", ""))]
        if not found:
            raise ValueError(f"unknown sampler {name!r} (known: {', '.join(SAMPLER_NAMES)})")
        out.append(found[0])
    return tuple(out)


@dataclass
class SamplingParams:
    """Sampler settings; defaults are llama-server's."""

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    seed: int = -1
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    # Constrained decoding (a server.constrained.CompiledConstraint): every sampled token
    # must keep the output inside it; None samples freely.
    constraint: TokenConstraint | None = None
    # llama-server's post_sampling_probs: report this many of the candidates the chain
    # leaves (their probabilities after bias, penalties, top-k/p, min-p and temperature)
    # instead of the model's top log-probabilities; 0: off
    post_probs: int = 0
    # the rest of llama-server's samplers (its names and defaults; 0 / 1 / -1: off)
    dry_multiplier: float = 0.0
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = 64  # -1: the slot's context
    dry_sequence_breakers: tuple[str, ...] = ("\n", ":", '"', "*")
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    typical_p: float = 1.0
    top_n_sigma: float = -1.0
    dynatemp_range: float = 0.0
    dynatemp_exponent: float = 1.0
    mirostat: int = 0  # 1: Mirostat, 2: Mirostat 2.0 (then only temperature precedes it)
    mirostat_tau: float = 5.0
    mirostat_eta: float = 0.1
    adaptive_target: float = -1.0  # the adaptive_p sampler, when ``samplers`` names it
    adaptive_decay: float = 0.9
    min_keep: int = 0
    # the chain's order, llama-server's canonical names (SAMPLER_NAMES)
    samplers: tuple[str, ...] = DEFAULT_SAMPLERS
    # llama-server's per-request backend_sampling: False keeps this request's chain on the
    # CPU under -bs
    backend_ok: bool = True

    def penalized(self) -> bool:
        """Whether the repeat / frequency / presence penalties do anything."""
        on = self.repeat_penalty != 1.0 or self.frequency_penalty != 0.0
        return (on or self.presence_penalty != 0.0) and self.repeat_last_n != 0

    def stages(self) -> list[str]:
        """The chain's stages that change anything, in order, between the logit bias and
        the final pick (dist, greedy at temperature 0, or adaptive_p when ``samplers``
        names it): llama-server's chain without its no-op stages. At temperature 0 the
        pick is an argmax: the stages that always keep the likeliest token are left out,
        unless XTC or infill come after them (those two read the probabilities the earlier
        stages leave); penalties, DRY, XTC and infill may move the argmax and stay. With
        ``mirostat`` the chain is temperature then mirostat, as llama-server builds it."""
        if self.mirostat:
            return ["temperature", "mirostat"]
        on = {
            "penalties": self.penalized(),
            "dry": self.dry_multiplier > 0.0 and self.dry_penalty_last_n != 0,
            "top_n_sigma": self.top_n_sigma > 0.0,
            "top_k": self.top_k > 0,
            "typ_p": self.typical_p < 1.0,
            "top_p": self.top_p < 1.0,
            "min_p": self.min_p > 0.0,
            "xtc": self.xtc_probability > 0.0 and self.xtc_threshold <= 0.5,
            "temperature": self.temperature > 0.0,
            "infill": True,
            "adaptive_p": False,  # the final pick, not a stage
        }
        stages = [name for name in self.samplers if on[name]]
        if self.temperature > 0.0:
            return stages
        readers = [i for i, name in enumerate(stages) if name in ("xtc", "infill")]
        last = readers[-1] if readers else -1
        keep = ("penalties", "dry", "xtc", "infill")
        return [n for i, n in enumerate(stages) if i < last or n in keep]


@dataclass(frozen=True)
class ReasoningBudget:
    """A reasoning budget (llama-server's --reasoning-budget, ``reasoning_budget_tokens``):
    once the model has written ``tokens`` tokens inside its reasoning, ``forced`` (the
    budget message, then the end tag, as tokens) replaces what it samples next, one token
    a step, and the answer follows. Reasoning opens where the output writes ``start`` (or
    at once when ``open``: the prompt ended inside it) and closes where it writes ``end``
    (UTF-8 bytes, matched on the token pieces)."""

    tokens: int
    start: bytes
    end: bytes
    forced: tuple[int, ...]
    open: bool = False


@dataclass
class GenParams:
    max_tokens: int = -1  # -1: until EOG or the end of the slot's context
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    n_probs: int = 0  # top log-probabilities per token (0: off)
    logprobs: bool = False  # report the sampled token's log-probability
    # speculative decoding (``speculative.n_max/n_min/p_min``; -1: the server's setting,
    # n_max 0: this request does not speculate)
    spec_n_max: int = -1
    spec_n_min: int = -1
    spec_p_min: float = -1.0
    # --context-shift: prompt tokens kept when a full slot shifts (-1: the whole prompt),
    # and how many after them it drops (0: half of the rest), llama-server's fields
    n_keep: int = 0
    n_discard: int = 0
    # --cache-reuse: least chunk of cached tokens reused by a KV shift (-1: the server's)
    n_cache_reuse: int = -1
    # the reasoning budget (None: unlimited); server.slot.reasoning_budget enforces it
    reasoning_budget: ReasoningBudget | None = None
    # control tokens rendered as their text (llama.cpp renders them empty): the markers of
    # the request's tool-call and reasoning syntax, which its parser reads
    preserved: frozenset[int] = frozenset()


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOG token or stop string
    LENGTH = "length"  # max_tokens or the context is full
    CANCELLED = "cancelled"
    ERROR = "error"


class TokenLogprob(NamedTuple):
    token: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class Timings:
    cache_n: int = 0
    prompt_n: int = 0
    prompt_ms: float = 0.0
    predicted_n: int = 0
    predicted_ms: float = 0.0
    draft_n: int = 0  # speculative decoding: tokens drafted, and of them accepted
    draft_n_accepted: int = 0
    cache_reuse_n: int = 0  # --cache-reuse: cached tokens moved into place (in cache_n)
    cache_reuse_chunks: int = 0
    # --scheduling-policy priority: times the run was preempted, and the tokens (prompt and
    # answer) the RAM cache gave back at its last resume (cache_n: the prompt's part of them)
    preempted: int = 0
    resumed_n: int = 0

    def as_dict(self) -> dict[str, float | int]:
        """llama-server's ``timings``: the generation rate counts decode steps, one fewer
        than the tokens (the first comes from the prompt's last logits, not a decode)."""
        steps = max(self.predicted_n - 1, 0)
        pps = self.prompt_n / self.prompt_ms * 1e3 if self.prompt_ms > 0 else 0.0
        dps = steps / self.predicted_ms * 1e3 if self.predicted_ms > 0 else 0.0
        return {
            "cache_n": self.cache_n,
            "prompt_n": self.prompt_n,
            "prompt_ms": self.prompt_ms,
            "prompt_per_token_ms": self.prompt_ms / self.prompt_n if self.prompt_n else 0.0,
            "prompt_per_second": pps,
            "predicted_n": self.predicted_n,
            "predicted_ms": self.predicted_ms,
            "predicted_per_token_ms": self.predicted_ms / steps if steps else 0.0,
            "predicted_per_second": dps,
            # as llama-server: only when something was drafted
            **(
                {"draft_n": self.draft_n, "draft_n_accepted": self.draft_n_accepted}
                if self.draft_n
                else {}
            ),
            **(
                {"cache_reuse_n": self.cache_reuse_n, "cache_reuse_chunks": self.cache_reuse_chunks}
                if self.cache_reuse_chunks
                else {}
            ),
            **(
                {"preempted": self.preempted, "resumed_n": self.resumed_n} if self.preempted else {}
            ),
        }


@dataclass(slots=True)
class TextChunk:
    """Newly released text of a running task (stop-string prefixes are held back)."""

    text: str
    tokens: list[int]
    logprobs: list[TokenLogprob]
    timings: Timings | None = None  # the run's so far, for tasks with timings_per_token


@dataclass
class TaskResult:
    """The end of a task: what a response's final chunk and ``usage`` are made from."""

    id_slot: int
    finish: FinishReason
    text: str  # whole generated text (empty when streaming already released it)
    tokens: list[int]
    n_prompt: int
    timings: Timings
    stop_word: str = ""
    error: str = ""
    t_queue_ms: float = 0.0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    truncated: bool = False  # the context filled up (stopped there, or shifted)


@dataclass
class TaskError:
    status: int
    message: str
    type: str = "server_error"
    extra: dict[str, object] = field(default_factory=dict)


@dataclass
class PromptProgress:
    """Prompt processing progress of a task that asked for it (``return_progress``, streamed
    only): llama-server's ``prompt_progress``. ``processed`` counts the prompt tokens in the
    slot (``cache`` reused ones included); it reaches ``total`` when the prompt is in."""

    total: int
    cache: int
    processed: int
    time_ms: int
    timings: Timings | None = None  # with timings_per_token: the prompt's so far

    def as_dict(self) -> dict[str, int]:
        return {
            "total": self.total,
            "cache": self.cache,
            "processed": self.processed,
            "time_ms": self.time_ms,
        }


Event = TextChunk | TaskResult | TaskError | PromptProgress


# ---- images (issue 42) ----------------------------------------------------------------


class MediaError(ValueError):
    """A client's image that cannot be used: a 400 naming what is wrong."""

    status = 400


@dataclass(frozen=True, eq=False)
class EncodedImage:
    """An image as the projector gave it: ``identity`` (a hash of its decoded pixels and of
    the projector), ``embd`` ((n_tokens, n_embd) float32, numpy), whether its tokens attend
    both ways (``non_causal``: decoded in one ubatch) and whether it was encoded for this
    request (False: the embedding cache had it)."""

    identity: bytes
    embd: np.ndarray
    non_causal: bool
    encoded: bool
    encode_ms: float = 0.0

    @property
    def n_tokens(self) -> int:
        return int(self.embd.shape[0])


def image_placeholders(identity: bytes, n: int) -> list[int]:
    """The ``n`` prompt entries standing for an image's positions: negative (never a token
    id), drawn from its identity. A slot's tokens stay one entry per KV position, and any
    prefix match over them stops at the first entry of a different image (a mismatch there
    has odds 2**-31), so a match covers an image whole or not at all."""
    seed = int.from_bytes(identity[:16].ljust(16, b"\0"), "little") ^ n
    vals = np.random.default_rng(seed).integers(1, 2**31 - 1, size=n)
    out = [-int(v) for v in vals]
    if out:
        IMAGE_NAMES.note(identity, out)
    return out


@dataclass(frozen=True)
class ImageSpan:
    """An image's placeholders in a token list: ``tokens[start:start + n_tokens]``, named by
    ``identity`` (b"": a placeholder run no image of this process is known by)."""

    start: int
    n_tokens: int
    identity: bytes

    @property
    def end(self) -> int:
        return self.start + self.n_tokens


class ImageNames:
    """Which image a placeholder run stands for (issue 42): the tiers that keep a slot's
    tokens past this process (disk files, slot files) and the KV events name each image by
    its identity, which the placeholders alone do not give back. Every image whose
    placeholders were drawn (``image_placeholders``) or proven from a file is noted here:
    its first placeholder -> (identity, length, last placeholder), least recently used
    first out past ``max_items``. Any thread."""

    def __init__(self, max_items: int = 1 << 15) -> None:
        self.max_items = max_items
        self._lock = threading.Lock()
        self._by_first: OrderedDict[int, tuple[bytes, int, int]] = OrderedDict()

    def note(self, identity: bytes, placeholders: Sequence[int]) -> None:
        with self._lock:
            self._by_first[placeholders[0]] = (identity, len(placeholders), placeholders[-1])
            self._by_first.move_to_end(placeholders[0])
            while len(self._by_first) > self.max_items:
                self._by_first.popitem(last=False)

    def spans(self, tokens: Sequence[int]) -> list[ImageSpan]:
        """The images among ``tokens`` (runs of negative entries), in order. A run whose
        first entry names no known image (or whose length or last entry disagree) is one
        span with an empty identity up to the run's end; an image cut short by the end of
        ``tokens`` keeps its whole ``n_tokens`` (its ``end`` then lies past them)."""
        if not tokens or min(tokens) >= 0:
            return []
        arr = np.asarray(tokens, dtype=np.int64)
        neg = np.flatnonzero(arr < 0)
        out: list[ImageSpan] = []
        i = 0
        while i < len(neg):
            pos = int(neg[i])
            with self._lock:
                got = self._by_first.get(int(arr[pos]))
            end = pos + got[1] if got is not None else len(arr)
            if got is not None and (end > len(arr) or int(arr[end - 1]) == got[2]):
                out.append(ImageSpan(pos, got[1], got[0]))
            else:  # unknown: the whole run of negative entries
                after = np.flatnonzero(arr[pos:] >= 0)
                end = pos + int(after[0]) if len(after) else len(arr)
                out.append(ImageSpan(pos, end - pos, b""))
            i = int(np.searchsorted(neg, end))
        return out


IMAGE_NAMES = ImageNames()


@dataclass(frozen=True, eq=False)
class PromptImage:
    """An image of a task's prompt at positions ``start``..``start + n_tokens - 1``: the
    prompt holds its placeholders there, the runner decodes its embeddings."""

    start: int
    image: EncodedImage

    @property
    def n_tokens(self) -> int:
        return self.image.n_tokens

    @property
    def end(self) -> int:
        return self.start + self.image.n_tokens


class ImageProjector(Protocol):
    """A loaded projector (server.llama.mtmd.Projector) as the front end uses it."""

    marker: str
    key: bytes  # the projector's own hash: images' identities and files name it
    vision: bool
    audio: bool

    def tokenize(
        self,
        text: str,
        images: list[bytes],
        scope: bytes = b"",
        between: Callable[[], None] = ...,
    ) -> list[list[int] | EncodedImage]:
        """``text`` with one ``marker`` per image as text token runs and encoded images
        (add_special, special tokens parsed), its caches keyed within ``scope`` (the
        request's tenant); ``between`` is called before each image is decoded (it may
        raise to stop the work); raises MediaError."""
        ...

    def close(self) -> None: ...


@dataclass
class Task:
    """One completion request for one slot. ``emit`` is thread-safe and never blocks."""

    prompt: list[int]
    sampling: SamplingParams
    gen: GenParams
    emit: Callable[[Event], None]
    id_slot: int = -1
    cache_prompt: bool = True
    stream: bool = True
    # Token index where the last user message starts (chat), a good checkpoint position.
    user_start: int = -1
    # send PromptProgress events while the prompt is processed (streamed tasks only)
    return_progress: bool = False
    timings_per_token: bool = False  # TextChunks carry the run's timings so far (streamed)
    id: int = field(default_factory=lambda: next(_task_ids))
    t_enqueued: float = field(default_factory=time.perf_counter)
    cancelled: bool = False
    # Whose cached prefixes the task may reuse (--cache-isolation): KV, RAM-cache entries and
    # prefix sharing match only within one tenant. "" is the shared default tenant.
    tenant: str = ""
    # LoRA adapter scales, one per loaded adapter (empty: none). A step decodes one set
    # (engine/adapter_turns.py); its cache key is part of ``tenant`` (tiers/tenancy.py).
    lora: tuple[float, ...] = ()
    # True while the task's reader lags too far behind its events (a slow client): the
    # engine then skips the task's next tokens, so its queue stays bounded. Any thread.
    # Called with ``n_sent``, so it needs no reference to the task (no cycle).
    lagging: Callable[[int], bool] | None = None
    n_sent: int = 0  # events the engine has sent (engine thread only writes it)
    # the prompt's images, in order (their placeholders are in ``prompt``; issue 42)
    images: tuple[PromptImage, ...] = ()
    # vLLM's ``priority`` (--scheduling-policy priority): lower is served first, ties by
    # arrival (its aging counts from ``t_enqueued``, preempted or not: engine/priority.py);
    # ``t_waiting``: when it last entered the wait queue (its arrival, or its preemption),
    # from which its queue time counts (metrics)
    priority: int = 0
    t_waiting: float = 0.0

    def cancel(self) -> None:
        """Safe from any thread: the engine drops the task at its next step."""
        self.cancelled = True
