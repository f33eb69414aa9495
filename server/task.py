"""One request as the engine runs it: ``Task``, its sampling and generation settings
(``SamplingParams``, ``GenParams``, llama-server's sampler names and order), and the events it
gets back (``TextChunk``, ``PromptProgress``, ``TaskResult`` with its ``Timings``,
``TaskError``). Above the leaves ``server.types`` and ``server.image_types``."""

from __future__ import annotations

import enum
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from .image_types import PromptImage
from .types import TokenConstraint

_task_ids = itertools.count(1)

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
