"""TaskGroup: a request's tasks on the engine, their events as they come, and the ways
they end early (client gone, timeout, shutdown, dead engine)."""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from functools import partial

from starlette.requests import Request

from ..engine.engine import Engine, EngineDead
from ..image_types import PromptImage
from ..schemas.errors import APIError
from ..task import Event, GenParams, SamplingParams, Task, TaskError, TaskResult, TextChunk
from .sink import emitter

log = logging.getLogger("server.service")

# Events a streaming reader may lag behind before its tasks stop generating (each is about
# one token's text): a client that reads nothing holds its slot, not unbounded memory.
MAX_BACKLOG = 256
# A streaming reader with more events than this waiting for one task is behind: its adjacent
# text chunks go out as one (``TaskGroup.batches(coalesce=True)``). Above any one step's
# output for a task (a speculative step releases at most 1 + --spec-ngram-size-m = 49
# tokens), so a reader that keeps up never sees a merged chunk.
COALESCE_AFTER = 64
# How often a non-streaming request asks whether its client is still there.
DISCONNECT_POLL_S = 0.25


class TaskGroup:
    """Runs tasks on the engine and yields ``(index, event)`` as they come.

    Leaving the iteration early (client gone) cancels every task still running.
    """

    def __init__(
        self,
        engine: Engine,
        *,
        timeout: float = 600.0,
        max_queue: int = 256,
        drain_deadline: Callable[[], float | None] = lambda: None,
        ping: float = 0.0,
    ) -> None:
        self.engine = engine
        self.ping = ping  # > 0: ``batches`` yields an empty batch after this much silence
        self.drain_deadline = drain_deadline
        self.timeout = timeout
        self.max_queue = max_queue
        self.loop = asyncio.get_running_loop()
        # The engine's side of the group: its emitters and lagging checks reach the box
        # only, never the group or its tasks, so a finished request has no reference cycle
        # and is freed at once (not left to the garbage collector's next full pass).
        self.box = _Mailbox()
        self.tasks: list[Task] = []
        self._tick: asyncio.TimerHandle | None = None  # wakes a waiting reader (``_wait``)

    @property
    def pending(self) -> collections.deque[tuple[int, Event]]:
        """Delivered events not read yet, in order."""
        return self.box.pending

    @property
    def n_read(self) -> list[int]:
        """Events of each task read so far."""
        return self.box.n_read

    def _emitter(self, index: int) -> Callable[[Event], None]:
        """The ``emit`` of the task at ``index``: thread-safe, never blocks."""
        # the engine batches a step's events per loop (service/sink.py): one wake-up, then
        # the box's deliver() on the loop, event by event
        return emitter(self.loop, partial(self.box.deliver_to, index))

    async def _wait(self, timeout: float) -> None:
        """Until an event is delivered or the group's tick fires (at most ``timeout``
        seconds from now): one future per wait, not a task per event as
        ``asyncio.wait_for(queue.get())`` costs, and one timer per ``timeout``, not per wait
        (a reader that keeps up waits once per engine step). A wake-up may come early: the
        caller checks what it waits for and waits again."""
        fut = self.loop.create_future()
        box = self.box
        box.waiter = fut
        if self._tick is None:
            self._tick = self.loop.call_later(timeout, self._on_tick)
        try:
            await fut
        finally:
            box.waiter = None

    def _on_tick(self) -> None:
        self._tick = None
        w = self.box.waiter
        if w is not None and not w.done():
            w.set_result(None)

    def add(
        self,
        prompt: list[int],
        sampling: SamplingParams,
        gen: GenParams,
        *,
        id_slot: int = -1,
        cache_prompt: bool = True,
        stream: bool = True,
        user_start: int = -1,
        tenant: str = "",
        lora: tuple[float, ...] = (),
        return_progress: bool = False,
        timings_per_token: bool = False,
        images: tuple[PromptImage, ...] = (),
        priority: int = 0,
    ) -> Task:
        """Add a task (not yet running: ``submit`` starts them all)."""
        task = Task(
            prompt=prompt,
            sampling=sampling,
            gen=gen,
            emit=self._emitter(len(self.tasks)),
            id_slot=id_slot,
            cache_prompt=cache_prompt,
            stream=stream,
            user_start=user_start,
            tenant=tenant,
            lora=lora,
            return_progress=return_progress and stream,
            timings_per_token=timings_per_token and stream,
            lagging=self.box.lagging(len(self.tasks)) if stream else None,
            images=images,
            priority=priority,
        )
        self.tasks.append(task)
        self.box.n_read.append(0)
        return task

    def submit(self) -> None:
        """Hand every task to the engine, or none: APIError 400 for an id_slot out of range,
        503 when the queue is full or the engine stopped."""
        if any(t.id_slot >= len(self.engine.slots) for t in self.tasks):
            raise APIError(
                400, f"id_slot must be below the number of slots ({len(self.engine.slots)})"
            )
        queued = self.engine.queue_depth() + len(self.tasks)
        # n_idle_slots walks the slots: only asked when the queue alone is over the bound
        if queued > self.max_queue and queued > self.max_queue + self.engine.n_idle_slots():
            raise APIError(
                503,
                f"the server is busy: more than {self.max_queue} requests are waiting",
                "unavailable_error",
                headers={"Retry-After": "1"},
            )
        try:
            for t in self.tasks:
                self.engine.submit(t)
        except EngineDead as e:
            self.cancel()
            raise APIError(503, str(e), "unavailable_error") from e

    def cancel(self) -> None:
        """Cancel every task (finished ones ignore it); safe to call more than once."""
        for t in self.tasks:
            t.cancel()

    def _ended(self, deadline: float) -> TaskError | None:
        """Why the unfinished tasks must end now, if they must: the server drains for a
        shutdown and its grace time is over, or the request ran out of time."""
        drain = self.drain_deadline()
        now = time.monotonic()
        if drain is not None and now >= drain:
            return TaskError(503, "the server is shutting down", "unavailable_error")
        if now >= deadline:
            return TaskError(
                408, f"the request timed out after {self.timeout:g} s", "timeout_error"
            )
        return None

    async def batches(
        self, coalesce: bool = False
    ) -> AsyncGenerator[list[tuple[int, Event]], None]:
        """Every event delivered since the last batch, in order, until every task ended: a
        streaming route shapes and writes a batch at once. A timeout, a shutdown's end of
        grace or a dead engine ends the unfinished tasks with a TaskError each (so streams
        can report it). With ``ping`` > 0, an empty batch after that many seconds without
        one (a stream's keep-alive, ``protocols.common.sse_batches``). ``coalesce``: a task with more than COALESCE_AFTER events waiting
        (a reader that far behind) gets its adjacent TextChunks merged into one
        (``merge_text``); a reader that keeps up gets every event as it was sent."""
        open_ = set(range(len(self.tasks)))
        deadline = time.monotonic() + self.timeout
        ping = self.ping
        quiet_since = time.monotonic()  # the last batch (for ``ping``)
        try:
            while open_:
                failure = self._ended(deadline)
                if failure is None and not self.pending:
                    now = time.monotonic()
                    wait = min(1.0, deadline - now)
                    if ping > 0:  # wake no later than the ping is due
                        wait = min(wait, quiet_since + ping - now)
                    await self._wait(max(0.0, wait))
                    if not self.pending:
                        failure = self._ended(deadline)
                        if failure is None and not self.engine.alive:
                            failure = TaskError(500, "the engine stopped", "server_error")
                        if failure is None:
                            if ping > 0 and time.monotonic() - quiet_since >= ping:
                                quiet_since = time.monotonic()
                                yield []  # silent for ``ping`` s: the reader pings
                            continue
                if failure is not None:
                    self.cancel()
                    batch: list[tuple[int, Event]] = [(i, failure) for i in sorted(open_)]
                    open_.clear()
                    yield batch
                    return
                if ping > 0:  # one clock read per batch, not per event
                    quiet_since = time.monotonic()
                yield self._take(open_, coalesce)
        finally:
            if self._tick is not None:
                self._tick.cancel()
                self._tick = None
            if open_:
                self.cancel()

    def _take(self, open_: set[int], coalesce: bool) -> list[tuple[int, Event]]:
        """The pending events, counted as read (backpressure); ended tasks leave ``open_``."""
        batch = list(self.pending)
        self.pending.clear()
        n_read = self.n_read
        for index, ev in batch:
            n_read[index] += 1
            if not isinstance(ev, TextChunk) and isinstance(ev, TaskResult | TaskError):
                open_.discard(index)
        if coalesce and len(batch) > COALESCE_AFTER:
            return coalesced(batch)
        return batch

    async def events(self) -> AsyncIterator[tuple[int, Event]]:
        """The events of ``batches`` one at a time (never coalesced)."""
        batches = self.batches()
        try:
            async for batch in batches:
                for item in batch:
                    yield item
        finally:
            await batches.aclose()

    async def results(self, request: Request | None = None) -> list[TaskResult]:
        """Wait for every task; the first error becomes an APIError.

        With ``request``, a client that disconnects cancels the tasks (within about
        2 x DISCONNECT_POLL_S). The watcher starts only once the request has run that long:
        most requests end before, and then cost no watcher task.
        """
        watchers: list[asyncio.Task[None]] = []

        def start_watcher(req: Request) -> None:
            watchers.append(asyncio.create_task(self._watch(req)))

        timer = None
        if request is not None:
            timer = self.loop.call_later(DISCONNECT_POLL_S, start_watcher, request)
        out: list[TaskResult | None] = [None] * len(self.tasks)
        try:
            async for index, ev in self.events():
                if isinstance(ev, TaskError):
                    raise APIError(ev.status, ev.message, ev.type, headers=None, **ev.extra)
                if isinstance(ev, TaskResult):
                    out[index] = ev
        finally:
            if timer is not None:
                timer.cancel()
            for w in watchers:
                w.cancel()
        return [r for r in out if r is not None]

    async def _watch(self, request: Request) -> None:
        await until_disconnected(request)
        log.info("client disconnected; cancelling %d task(s)", len(self.tasks))
        self.cancel()


class _Mailbox:
    """What the engine thread reaches of a TaskGroup: delivered events not read yet, the
    reader's waiter, and how many events of each task were read (backpressure). It holds
    no reference to the group or its tasks (see ``TaskGroup.__init__``)."""

    def __init__(self) -> None:
        self.pending: collections.deque[tuple[int, Event]] = collections.deque()
        self.waiter: asyncio.Future[None] | None = None
        self.n_read: list[int] = []  # written on the loop only

    def deliver(self, item: tuple[int, Event]) -> None:
        """On the loop: queue an event, and wake the reader if it waits (once per hand-off:
        the wake-up runs after the engine's whole hand-off was delivered)."""
        self.pending.append(item)
        w = self.waiter
        if w is not None:
            self.waiter = None
            if not w.done():
                w.set_result(None)

    def deliver_to(self, index: int, ev: Event) -> None:
        """``deliver`` of task ``index``'s event (a task's receiver: service/sink.py)."""
        self.deliver((index, ev))

    def lagging(self, index: int) -> Callable[[int], bool]:
        """Whether the reader of task ``index`` is more than MAX_BACKLOG of its ``n_sent``
        events behind (called on the engine thread; each counter has one writer)."""
        n_read = self.n_read

        def lagging(n_sent: int) -> bool:
            return n_sent - n_read[index] > MAX_BACKLOG

        return lagging


def merge_text(chunks: list[TextChunk]) -> TextChunk:
    """Adjacent TextChunks of one task as one: the texts, tokens and log-probs in order;
    the timings of the last (the run's so far). A stop-string hold-back releases such a
    chunk too (several tokens at once), so every stream shape already takes one."""
    if len(chunks) == 1:
        return chunks[0]
    return TextChunk(
        "".join(c.text for c in chunks),
        [t for c in chunks for t in c.tokens],
        [lp for c in chunks for lp in c.logprobs],
        chunks[-1].timings,
    )


def coalesced(batch: list[tuple[int, Event]]) -> list[tuple[int, Event]]:
    """``batch`` with the adjacent TextChunks of a task merged where that task has more
    than COALESCE_AFTER events in it (its reader is that far behind); the rest untouched,
    every other event and the order kept."""
    counts: collections.Counter[int] = collections.Counter(i for i, _ in batch)
    behind = {i for i, n in counts.items() if n > COALESCE_AFTER}
    if not behind:
        return batch
    out: list[tuple[int, Event]] = []
    run: list[TextChunk] = []
    run_index = -1
    for index, ev in batch:
        if index in behind and isinstance(ev, TextChunk):
            if run and run_index != index:
                out.append((run_index, merge_text(run)))
                run = []
            run.append(ev)
            run_index = index
            continue
        if run:
            out.append((run_index, merge_text(run)))
            run = []
        out.append((index, ev))
    if run:
        out.append((run_index, merge_text(run)))
    return out


async def until_disconnected(request: Request, period: float = DISCONNECT_POLL_S) -> None:
    """Returns once the client of ``request`` has gone (checked at once, then every
    ``period`` seconds). Polled: Starlette tells a non-streaming handler of a disconnect
    only when asked."""
    while not await request.is_disconnected():
        await asyncio.sleep(period)
