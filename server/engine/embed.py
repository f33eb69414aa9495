"""The engine's embedding path (--embedding): prompt-only tasks that read embeddings.

An embedding task never generates, so it holds a slot only inside one engine step: the
step lends it idle slots (empty ones first), decodes the prompts of as many waiting tasks as
fit one physical batch (pooled embeddings are computed per ubatch, so each prompt must lie
whole in one) with the context in embeddings mode, reads each sequence's embedding and
clears the sequences again. Tasks that arrive together share these decodes, and a step
may run several of them; generation decodes follow in the same step, on logits only. As in
llama-server, embedding and generation batches are never mixed (embeddings mode makes
every token an output).

Slots keep their invariant: a lent slot is emptied through the store (saved to the RAM cache
first when there is one) before its sequence is used, and emptied again after.
"""

from __future__ import annotations

import collections
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ..engine_api import EmbedResult, too_large
from ..kv.store import SlotStore
from ..slot.backend_api import Backend
from ..slot.slot import Slot, SlotState
from ..task import TaskError
from .step_plan import Clear, EmbedDecode, EvictIdle, Ops

log = logging.getLogger("server.engine.embed")

_ids = itertools.count(1)


EmbedEvent = EmbedResult | TaskError


@dataclass
class EmbedTask:
    """One prompt to embed. ``emit`` is thread-safe and never blocks; it gets exactly one
    EmbedResult or TaskError."""

    tokens: list[int]
    emit: Callable[[EmbedEvent], None]
    index: int = 0  # the prompt's place in its request
    id: int = field(default_factory=lambda: next(_ids))
    t_enqueued: float = field(default_factory=time.perf_counter)
    cancelled: bool = False
    n_sent: int = 0  # events the engine has sent (the engine's outbox counts them)

    def cancel(self) -> None:
        """Safe from any thread: the engine drops the task if it has not run yet."""
        self.cancelled = True


@dataclass
class _Placed:
    task: EmbedTask
    slot: Slot
    row: int  # the batch row of its first token


class EmbedQueue:
    """Waiting embedding tasks and the step that runs them (engine thread only).

    ``send`` queues an event for delivery (the engine's outbox); ``flush`` delivers the
    queued events (called right before each decode, as the engine does)."""

    def __init__(
        self,
        backend: Backend,
        store: SlotStore,
        send: Callable[[EmbedTask, EmbedEvent], None],
        flush: Callable[[], None],
    ) -> None:
        self.b = backend
        self.store = store
        self.send = send
        self.flush = flush
        self.waiting: collections.deque[EmbedTask] = collections.deque()
        self.n_tasks = 0  # embedded prompts (counters for /metrics and tests)
        self.n_tokens = 0
        self.n_decodes = 0

    def __len__(self) -> int:
        return len(self.waiting)

    def step(self) -> Ops[bool]:
        """Embed waiting tasks on the idle slots, one decode per physical batch, until the
        queue is empty or no slot is idle. True when anything was decoded. Memory changes
        (idle slots evicted, the decode, the slots cleared after) are yielded for the
        runner (``Runner.drive``)."""
        self.waiting = collections.deque(t for t in self.waiting if not t.cancelled)
        decoded = False
        try:
            while self.waiting:
                placed = yield from self._place()
                if not placed:
                    break
                yield from self._run(placed)
                decoded = True
        finally:
            if decoded:
                self.b.set_embeddings(False)
        return decoded

    def fail_all(self, message: str) -> None:
        while self.waiting:
            self.waiting.popleft().emit(TaskError(503, message, "unavailable_error"))

    def _place(self) -> Ops[list[_Placed]]:
        """Lend idle slots (empty first, then least recently used) to the waiting tasks, in
        order, while their prompts fit one physical batch together. A lent slot that holds
        tokens goes to the RAM cache first (when there is one): its prefix is not lost."""
        slots = self.store.slots
        # a slot that a waiting task will copy a prefix from this step is not lent
        held = {
            s.run.wait.src
            for s in slots
            if s.state is SlotState.WAIT and s.run is not None and s.run.wait is not None
        }
        idle = sorted(
            (s for s in slots if s.idle and s.id not in held),
            key=lambda s: (bool(s.tokens), s.last_used),
        )
        budget = min(self.b.n_ubatch, self.b.n_batch)
        batch = self.b.batch
        batch.clear()
        placed: list[_Placed] = []
        for slot in idle:
            while self.waiting and len(self.waiting[0].tokens) > budget:
                # the routes refuse these; never let one block the queue
                n = len(self.waiting[0].tokens)
                self.send(self.waiting.popleft(), TaskError(400, too_large(n, budget)))
            if not self.waiting or batch.n + len(self.waiting[0].tokens) > budget:
                break
            task = self.waiting.popleft()
            if slot.tokens:
                yield EvictIdle(slot)
            row = batch.n
            batch.add_span(task.tokens, 0, slot.id, True)
            placed.append(_Placed(task, slot, row))
        return placed

    def _run(self, placed: list[_Placed]) -> Ops[None]:
        """Decode the placed prompts, hand out their embeddings, empty their slots."""
        self.b.set_embeddings(True)
        self.b.batch.outputs_all()
        self.flush()
        ret = yield EmbedDecode()
        try:
            for p in placed:
                if ret != 0:
                    self.send(p.task, TaskError(500, _decode_error(ret)))
                    continue
                vec = self._read(p)
                if vec is None:
                    self.send(p.task, TaskError(500, "failed to get the embeddings"))
                    continue
                self.send(p.task, EmbedResult(p.task.index, vec, len(p.task.tokens)))
                self.n_tasks += 1
                self.n_tokens += len(p.task.tokens)
        finally:
            for p in placed:
                yield Clear(p.slot)  # the slot never held these tokens for anyone
        self.n_decodes += 1

    def _read(self, p: _Placed) -> np.ndarray | None:
        if self.b.pooling == 0:  # LLAMA_POOLING_TYPE_NONE: one row per token
            return self.b.embedding_rows(p.row, len(p.task.tokens))
        vec = self.b.embedding_of_seq(p.slot.id)
        return None if vec is None else vec.reshape(1, -1)


def _decode_error(ret: int) -> str:
    if ret == 1:
        return "Context size has been exceeded: the KV cache has no room left"
    return f"llama_decode failed ({ret})"
