"""A slot: one llama sequence (seq id == slot id), what it holds, and the run it serves."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from ..types import Checkpoint, Task, TokenLogprob, TokenMatcher
from .speculative import DraftLimits, TokenHistory
from .text import TextStream


class SlotState(enum.Enum):
    IDLE = "idle"
    WAIT = "wait"  # holds a task; waits for another slot to compute a shared prefix
    PREFILL = "prefill"
    GENERATE = "generate"


@dataclass
class SlotRun:
    """One task's run on a slot: its accounting and generation state. A new run replaces
    the old one whole when a task starts; the last one stays readable (``/slots``)."""

    task: Task
    n_cached: int  # prompt tokens reused from the KV cache (cache_n)
    n_processed: int = 0  # prompt tokens decoded for this task (prompt_n when done)
    n_decoded: int = 0  # tokens sampled (completion tokens)
    generated: list[int] = field(default_factory=list)
    n_emitted: int = 0  # generated tokens already sent in a TextChunk
    next_token: int = -1  # sampled, not yet decoded
    sampler: Any = None
    matcher: TokenMatcher | None = None  # the task's constraint, when it has one
    backend_sampled: bool = False  # -bs: the chain runs in the decode graph (slots/sampling.py)
    stream: TextStream = field(default_factory=lambda: TextStream([]))
    logprobs: list[TokenLogprob] = field(default_factory=list)
    out_text: list[str] = field(default_factory=list)
    t_start: float = field(default_factory=time.perf_counter)
    t_first: float = 0.0
    # prefix sharing: the slot and task this one waits on, and the prefix length it waits for
    wait_src: int = -1
    wait_task: int = -1
    wait_target: int = 0
    share_marks: set[int] = field(default_factory=set)  # waiters' targets: end chunks there
    # speculative decoding: this run's limits (None: it does not speculate), its context as
    # an array for n-gram lookups, the draft riding in the batch being decoded, and counts
    spec: DraftLimits | None = None
    history: TokenHistory | None = None
    draft: list[int] = field(default_factory=list)
    n_drafted: int = 0
    n_draft_accepted: int = 0
    # the context filled up: the run stopped there, or shifted it (llama-server's truncated)
    truncated: bool = False

    @property
    def n_prompt(self) -> int:
        return len(self.task.prompt)


@dataclass
class Slot:
    id: int
    n_ctx: int
    # Invariant: the KV cache of sequence ``id`` holds exactly these tokens at positions
    # 0..len-1 (tokens added to the batch being decoded are in ``pending`` until it
    # succeeds). Only SlotStore (slots/store.py) changes ``tokens`` and ``checkpoints``.
    tokens: list[int] = field(default_factory=list)
    checkpoints: list[Checkpoint] = field(default_factory=list)
    state: SlotState = SlotState.IDLE
    last_used: float = 0.0
    run: SlotRun | None = None  # the current run, or the last one when idle
    pending: list[int] = field(default_factory=list)
    i_batch: int = -1  # output row of this step's batch, -1 when no logits are wanted
    tenant: str = ""  # whose prompt ``tokens`` hold (see Task.tenant)
    # with a draft model: its sequence holds tokens[:n_dft] (SlotStore keeps it so)
    n_dft: int = 0

    @property
    def idle(self) -> bool:
        return self.state is SlotState.IDLE

    @property
    def task(self) -> Task | None:
        """The task running on this slot; None when idle."""
        return None if self.idle or self.run is None else self.run.task

    def start(self, task: Task, n_past: int) -> SlotRun:
        self.tenant = task.tenant  # the KV it holds from now on is this tenant's
        self.run = SlotRun(task, n_cached=n_past, stream=TextStream(task.gen.stop))
        self.state = SlotState.PREFILL
        self.pending = []
        self.i_batch = -1
        return self.run

    def release(self) -> None:
        self.state = SlotState.IDLE
        self.pending = []
        self.i_batch = -1
        self.last_used = time.perf_counter()
