"""A slot: one llama sequence (seq id == slot id), what it holds, and the task it serves."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from ..types import Checkpoint, Task, TokenLogprob
from .text import TextStream


class SlotState(enum.Enum):
    IDLE = "idle"
    WAIT = "wait"  # holds a task; waits for another slot to compute a shared prefix
    PREFILL = "prefill"
    GENERATE = "generate"


@dataclass
class Slot:
    id: int
    n_ctx: int
    # Invariant: the KV cache of sequence ``id`` holds exactly these tokens at positions
    # 0..len-1 (tokens added to the batch being decoded are in ``pending`` until it succeeds).
    tokens: list[int] = field(default_factory=list)
    checkpoints: list[Checkpoint] = field(default_factory=list)
    state: SlotState = SlotState.IDLE
    task: Task | None = None
    last_used: float = 0.0

    # ---- per-task accounting (reset by ``start``) ----
    n_prompt: int = 0
    n_cached: int = 0  # prompt tokens reused from the KV cache (cache_n)
    n_processed: int = 0  # prompt tokens decoded for this task (prompt_n when done)
    n_decoded: int = 0  # tokens sampled (completion tokens)
    generated: list[int] = field(default_factory=list)
    n_emitted: int = 0  # generated tokens already sent in a TextChunk
    next_token: int = -1  # sampled, not yet decoded
    pending: list[int] = field(default_factory=list)
    i_batch: int = -1  # output row of this step's batch, -1 when no logits are wanted
    sampler: object | None = None
    stream: TextStream | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    out_text: list[str] = field(default_factory=list)
    t_start: float = 0.0
    t_first: float = 0.0
    id_task: int = -1
    # prefix sharing: the slot and task this one waits on, and the prefix length it waits for
    wait_src: int = -1
    wait_task: int = -1
    wait_target: int = 0
    share_marks: set[int] = field(default_factory=set)  # waiters' targets: end chunks there

    @property
    def idle(self) -> bool:
        return self.state is SlotState.IDLE

    def start(self, task: Task, n_past: int) -> None:
        self.task = task
        self.id_task = task.id
        self.state = SlotState.PREFILL
        self.n_prompt = len(task.prompt)
        self.n_cached = n_past
        self.n_processed = 0
        self.n_decoded = 0
        self.generated = []
        self.n_emitted = 0
        self.next_token = -1
        self.pending = []
        self.i_batch = -1
        self.stream = TextStream(task.gen.stop)
        self.logprobs = []
        self.out_text = []
        self.t_start = time.perf_counter()
        self.t_first = 0.0
        self.wait_src = -1
        self.wait_task = -1
        self.wait_target = 0
        self.share_marks = set()

    def release(self) -> None:
        self.task = None
        self.state = SlotState.IDLE
        self.pending = []
        self.i_batch = -1
        self.stream = None
        self.last_used = time.perf_counter()

    @property
    def checkpoint_bytes(self) -> int:
        return sum(c.nbytes for c in self.checkpoints)
