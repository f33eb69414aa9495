"""What one engine step does, as data: the plan ``schedule`` makes, what ``execute``
reports back to ``update``, and the memory operations the other decisions yield.

Only the runner (engine/runner.py) changes llama.cpp memory or decodes. A step admits
waiting tasks (``Scheduler.admit -> Admission``; ``Placer.place`` yields the operations that
start them: saves of the slots they overwrite, restores, cuts, checkpoint resumes, parked chunks, prefix copies), lets sharing
waiters whose prefix is ready copy it, embeds, then decodes one batch in three phases
(ARCHITECTURE §3):
- ``schedule() -> StepPlan`` decides, touching nothing: per slot, which tokens go into the
  batch, which rows need logits, and which memory operations run first (a context shift, a
  checkpoint, a draft model's proposal);
- ``execute(plan) -> StepOutputs`` (the runner's batch, engine/executor.py) runs the planned
  operations, fills the batch, decodes (retrying a KV-full decode with a smaller plan),
  commits what was decoded to the slot store and samples the rows with logits;
- ``update(plan, outputs)`` does the accounting: tokens taken, text streamed, runs finished.
"""

from __future__ import annotations

import collections
from collections.abc import Generator
from dataclasses import dataclass, field
from typing import TypeVar

from ..image_types import PromptImage
from ..kv.policy import SlotChoice
from ..prefix.prefix_index import Match, SlotBaseline
from ..prefix.reuse import ReuseChunk
from ..slot.slot import Slot
from ..task import FinishReason, Task, TaskError, TokenLogprob


@dataclass(frozen=True)
class Placement:
    """Admission's decision: ``task`` goes to ``slot``, as ``choice`` says (by id,
    similarity or LRU); ``Placer.place`` carries it out."""

    slot: Slot
    task: Task
    choice: SlotChoice


@dataclass
class Placed:
    """What placing an admission's tasks gave, for the engine to send: the tasks that failed
    to start (with their errors) and the started slots whose tasks want prompt progress."""

    failed: list[tuple[Task, TaskError]] = field(default_factory=list)
    progress: list[Slot] = field(default_factory=list)


@dataclass
class Admission:
    """The tasks placed this step, in order, and those that wait (FIFO order kept)."""

    placements: list[Placement] = field(default_factory=list)
    deferred: collections.deque[Task] = field(default_factory=collections.deque)


@dataclass(slots=True)
class SlotWork:
    """One slot's part of the step. ``tokens`` are decoded at positions
    len(slot.tokens)..; a generating slot's are its sampled token and its draft, each row
    with logits; a prefilling slot's are its next prompt chunk, logits on the last row only
    when the chunk ends the prompt."""

    slot: Slot
    tokens: list[int]
    generating: bool
    logits: bool
    checkpoint: bool = False  # take a checkpoint of the slot's state before decoding
    shift: tuple[int, int] | None = None  # (n_keep, n_discard): shift the context first
    model_room: int = 0  # draft-simple: most draft-model tokens to propose (execute)
    reuse: int = 0  # --cache-reuse: parked chunks that move in before ``tokens`` (execute)
    # an image (issue 42): ``tokens`` are its placeholders, its embeddings decoded alone,
    # before the batch (execute); never cut, never in the batch
    image: PromptImage | None = None
    row: int = -1  # the first row of the batch holding this work (execute sets it)
    # a generating slot's tokens after its sampled one that its constraint forced (decoded
    # without sampling: no draft rides behind them, engine/executor.py)
    n_forced: int = 0

    @property
    def draft(self) -> list[int]:
        """The draft riding behind a generating slot's sampled (and forced) tokens."""
        return self.tokens[1 + self.n_forced :] if self.generating else []


@dataclass
class StepPlan:
    """The step's work: generating slots first (a long prefill never starves them of their
    next token), then prompt chunks, oldest first, within ``budget`` tokens."""

    budget: int
    work: list[SlotWork] = field(default_factory=list)
    adapters: tuple[float, ...] = ()  # the LoRA scales every work runs under (adapter_turns)

    @property
    def n_tokens(self) -> int:
        return sum(len(w.tokens) for w in self.work)

    def shrink(self, budget: int) -> None:
        """Fit the plan into ``budget`` tokens for a retried decode: drafts go first (a
        retried step does not speculate), then slots beyond the budget, then prompt chunks
        are cut short (their logits only if they still end the prompt)."""
        self.budget = budget
        kept: list[SlotWork] = []
        used = 0
        for w in self.work:
            room = budget - used
            if room <= 0:
                break
            if w.generating:  # forced tokens stay: they are the answer's, not a guess
                w.tokens, w.model_room = w.tokens[: 1 + w.n_forced], 0
            elif w.image is not None:
                pass  # decoded already, outside the batch (execute's prepare)
            elif len(w.tokens) > room:
                w.tokens, w.logits = w.tokens[:room], False
            used += len(w.tokens)
            kept.append(w)
        self.work = kept

    def drop(self, slot: Slot) -> None:
        self.work = [w for w in self.work if w.slot is not slot]


@dataclass(slots=True)
class SlotOutput:
    """What the step gave one slot: the tokens it sampled, in order (a drafting slot's
    accepted drafts and the token after them; none for a prompt chunk short of the end),
    and their log-probabilities when the run asks for them (else None: one list less per
    slot and step, which the garbage collector would otherwise count)."""

    work: SlotWork
    tokens: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    n_drafted: int = 0
    n_accepted: int = 0
    n_forced: int = 0  # tokens at the end of ``tokens`` the constraint forced after the last
    # one to decode (``Sequence.n_forced``)


@dataclass(slots=True)
class Ended:
    """A run that ``execute`` could not carry on: ``update`` finishes it so."""

    slot: Slot
    reason: FinishReason
    error: str = ""
    status: int = 500  # an error's HTTP status: 4xx when the request caused it


@dataclass
class StepOutputs:
    """``execute``'s report: per decoded slot, in plan order, and the runs it ended. When
    nothing was decoded ``outputs`` is empty (a failed decode ends at least one run)."""

    outputs: list[SlotOutput] = field(default_factory=list)
    ended: list[Ended] = field(default_factory=list)
    n_tokens: int = 0  # tokens in the decoded batch


# ---- memory operations: what admission, sharing and embedding decide, the runner does ----
# Each is yielded by a decision (a generator: ``Placer.place``, ``resolve_waiters``,
# ``EmbedQueue.step``) to ``Runner.drive``, which carries it out and sends its outcome back
# as the value of the ``yield``: the next decision reads it. Only the runner changes memory.


@dataclass(frozen=True, slots=True)
class Restore:
    """Restore the best RAM-cache entry for ``prompt``, else the disk tier's, into ``slot``
    (``match``: the prompt's walk down the prefix index; ``held``: what the slot holds of
    it, the locator's ``Match.held``, which an entry must beat), then evict the RAM cache
    back within its limits. Outcome: whether one was loaded."""

    slot: Slot
    prompt: list[int]
    tenant: str
    match: Match | None
    held: SlotBaseline


@dataclass(frozen=True, slots=True)
class Cut:
    """Keep the first ``n`` tokens of ``slot``. Outcome: the tokens it holds (``n``, or 0)."""

    slot: Slot
    n: int


@dataclass(frozen=True, slots=True)
class ResumeAt:
    """Resume ``slot`` at its checkpoint ``index`` (its draft follows). Outcome: the tokens
    it holds (0 when the resume failed)."""

    slot: Slot
    index: int


@dataclass(frozen=True, slots=True)
class ParkChunks:
    """--cache-reuse: park ``chunks`` of ``slot`` beyond a cut at ``n_past`` on the scratch
    sequence. Outcome: the tokens the slot kept (``n_past``, or 0)."""

    slot: Slot
    chunks: list[ReuseChunk]
    n_past: int


@dataclass(frozen=True, slots=True)
class CopyPrefix:
    """Make ``dst`` hold ``src``'s first ``n`` tokens (prefix sharing: cells are shared).
    Outcome: the tokens ``dst`` holds."""

    src: Slot
    dst: Slot
    n: int


@dataclass(frozen=True, slots=True)
class CacheIdle:
    """--cache-idle-slots: save every idle slot to the RAM cache (cleared in unified KV)."""


@dataclass(frozen=True, slots=True)
class EvictIdle:
    """An idle slot is lent out: to the RAM cache first when there is one, then cleared."""

    slot: Slot


@dataclass(frozen=True, slots=True)
class SaveIdle:
    """An idle ``slot`` about to lose most of what it holds (a placement's ``save_first``)
    keeps its state in the RAM cache first. Outcome: whether the cache took it."""

    slot: Slot


@dataclass(frozen=True, slots=True)
class SaveRun:
    """--scheduling-policy priority: keep a running ``slot``'s whole state in the RAM cache
    (its run is about to be preempted). Outcome: whether the cache holds it now (saved, or
    covered by a longer entry of its tenant)."""

    slot: Slot


@dataclass(frozen=True, slots=True)
class Clear:
    """Empty ``slot``'s sequence (an embedding's slot after its decode)."""

    slot: Slot


@dataclass(frozen=True, slots=True)
class EmbedDecode:
    """Decode the batch (embeddings on, every row an output), once more after freeing idle
    KV when it found no room. Outcome: llama_decode's return code."""


MemoryOp = (
    Restore
    | Cut
    | ResumeAt
    | ParkChunks
    | CopyPrefix
    | CacheIdle
    | EvictIdle
    | SaveIdle
    | SaveRun
    | Clear
    | EmbedDecode
)
# a decision: yields memory operations, reads each one's outcome (sent back by
# ``Runner.drive``), and returns its own result. Every outcome is an int (a token count, a
# flag, llama_decode's return code; 0 for the operations that have none): a decision reads
# the one its operation's type documents
R = TypeVar("R")
Ops = Generator[MemoryOp, int, R]
