"""A slot: one llama sequence (seq id == slot id), what it holds, and the run it serves."""

from __future__ import annotations

import collections
import enum
import time
from dataclasses import dataclass, field
from typing import NamedTuple

from ..prefix.reuse import ReuseChunk
from ..task import Task, TokenLogprob
from ..types import Checkpoint, TokenMatcher
from .backend_api import SamplerHandle
from .reasoning_budget import BudgetTracker
from .sequence import Sequence
from .speculative import DraftLimits
from .text import TextStream


class SlotState(enum.Enum):
    IDLE = "idle"
    WAIT = "wait"  # holds a task; waits for another slot to compute a shared prefix
    PREFILL = "prefill"
    GENERATE = "generate"


class ShareWait(NamedTuple):
    """What a waiting run (its slot in ``SlotState.WAIT``) waits for: slot ``src``'s
    prefill of task ``task`` to reach ``target`` tokens, which it then copies
    (engine/sharing.py)."""

    src: int
    task: int
    target: int


@dataclass
class SlotRun:
    """One task's run on a slot: how it samples, what it has sent, and its waits. Its
    token accounting is the slot's ``Sequence`` (read through the properties below). A new
    run replaces the old one whole when a task starts; the last one stays readable
    (``/slots``)."""

    task: Task
    seq: Sequence
    sampler: SamplerHandle | None = None
    matcher: TokenMatcher | None = None  # the task's constraint, when it has one
    backend_sampled: bool = (
        False  # -bs: the chain runs in the decode graph (engine/sampling_paths.py)
    )
    budget: BudgetTracker | None = None  # the task's reasoning budget (slot/reasoning_budget.py)
    stream: TextStream = field(default_factory=lambda: TextStream([]))
    logprobs: list[TokenLogprob] = field(default_factory=list)
    out_text: list[str] = field(default_factory=list)
    t_start: float = field(default_factory=time.perf_counter)
    t_first: float = 0.0
    # prefix sharing: what this run waits for while its slot is in WAIT (None otherwise)
    wait: ShareWait | None = None
    share_marks: set[int] = field(default_factory=set)  # waiters' targets: end chunks there
    # --cache-reuse: parked chunks not moved in yet, in prompt order (engine/cache_reuse.py)
    reuse: collections.deque[ReuseChunk] = field(default_factory=collections.deque)
    # speculative decoding: this run's limits (None: it does not speculate), and counts
    spec: DraftLimits | None = None
    n_drafted: int = 0
    n_draft_accepted: int = 0
    # the constraint is complete and its last tokens were forced: the next step decodes
    # them, samples nothing, and the run finishes (engine/update.py)
    closing: bool = False
    # bytes of the next answer token that are the prompt's (its last token healed into the
    # forced answer's first: engine/executor.py ``_heal``); kept out of the text
    skip: int = 0
    # the context is full: the next step shifts it (--context-shift) before decoding
    shift_due: bool = False
    # the context filled up: the run stopped there, or shifted it (llama-server's truncated)
    truncated: bool = False
    # --scheduling-policy priority: the times the run was preempted and the tokens its last
    # resume restored (engine/preempt.py), and while it recomputes what the RAM cache lost,
    # the tokens its KV must hold again before it generates (None: none missing)
    preempted: int = 0
    resumed_n: int = 0
    refill: list[int] | None = None

    @property
    def n_prompt(self) -> int:
        return len(self.task.prompt)

    @property
    def n_cached(self) -> int:
        """Prompt tokens reused from the KV cache (cache_n)."""
        return self.seq.n_cached

    @property
    def n_processed(self) -> int:
        """Prompt tokens decoded for this task (prompt_n when done)."""
        return self.seq.n_computed

    @property
    def n_decoded(self) -> int:
        """Tokens sampled (completion tokens)."""
        return self.seq.n_sampled

    @property
    def generated(self) -> list[int]:
        return self.seq.generated

    @property
    def next_token(self) -> int:
        return self.seq.next_token


@dataclass
class Slot:
    id: int
    n_ctx: int
    # Invariant: the KV cache of sequence ``id`` holds exactly ``seq.tokens`` at positions
    # 0..len-1. Only SlotStore (kv/store.py) changes them and ``checkpoints``.
    seq: Sequence = field(default_factory=Sequence)
    checkpoints: list[Checkpoint] = field(default_factory=list)
    state: SlotState = SlotState.IDLE
    last_used: float = 0.0
    run: SlotRun | None = None  # the current run, or the last one when idle
    tenant: str = ""  # whose prompt ``tokens`` hold (see Task.tenant)

    @property
    def tokens(self) -> list[int]:
        """What the slot's KV sequence holds (read-only outside SlotStore)."""
        return self.seq.tokens

    @tokens.setter
    def tokens(self, toks: list[int]) -> None:
        self.seq.assign(toks)

    @property
    def idle(self) -> bool:
        return self.state is SlotState.IDLE

    @property
    def live(self) -> SlotRun:
        """The run of a slot known to hold one: busy (waiting, prefilling, generating), or
        idle after a run (the last one stays). ``run`` is None only before the slot's first
        task; this raises RuntimeError there. Per-token paths (the step's passes over the
        slots) read ``run`` into a local narrowed by an assert instead: a property call
        costs them measurably (bench/step_cost.py)."""
        run = self.run
        if run is None:
            raise RuntimeError(f"slot {self.id} holds no run")
        return run

    @property
    def task(self) -> Task | None:
        """The task running on this slot; None when idle."""
        return None if self.idle or self.run is None else self.run.task

    def start(self, task: Task, n_past: int) -> SlotRun:
        self.tenant = task.tenant  # the KV it holds from now on is this tenant's
        self.seq.start(len(task.prompt), n_past)
        self.run = SlotRun(task, self.seq, stream=TextStream(task.gen.stop))
        self.state = SlotState.PREFILL
        return self.run

    def release(self) -> None:
        self.state = SlotState.IDLE
        self.last_used = time.perf_counter()
