"""The engine: one thread owns the llama context and runs continuous-batching steps.

Each step (docs/ARCHITECTURE.md §3): run the commands queued for the engine thread, admit
waiting tasks to idle slots (placement: reuse, cache restores, sharing), then one batch in
three phases (engine/step_plan.py); every memory operation and decode runs in the runner
(engine/runner.py): ``schedule`` plans the next token of every generating slot plus prompt
chunks of prefilling slots (<= n_batch tokens), ``execute`` decodes it once and samples
where logits were requested, ``update`` accounts and emits text to the tasks' sinks.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from functools import partial
from typing import TypeVar

from ..kv.checkpoints import CheckpointPolicy
from ..kv.draft_kv import DraftMemory
from ..kv.store import SlotStore
from ..kv_events.kv_watch import SlotWatcher
from ..slot.backend_api import Backend
from ..slot.slot import Slot, SlotRun, SlotState
from ..slot.stats import EngineStats
from ..speculative.spec_step import Speculation
from ..task import Event, FinishReason, Task, TaskError
from ..tiers.disk import DiskTier
from ..tiers.prompt_cache import PromptCache
from .cache_reuse import CacheReuse
from .commands import Command
from .embed import EmbedEvent, EmbedQueue, EmbedTask
from .event_sink import Delivery, Emitter, EventSink
from .executor import Executor
from .options import EngineOptions
from .placement import Placer
from .preempt import Preemption
from .runner import Runner
from .sampling_paths import ParallelSampling
from .scheduler import Scheduler
from .sharing import PrefixSharing
from .update import Updater

log = logging.getLogger("server.engine.engine")
R = TypeVar("R")
E = TypeVar("E")


class EngineDead(RuntimeError):
    pass


class Engine:
    def __init__(
        self,
        backend: Backend,
        opts: EngineOptions,
        cache: PromptCache | None = None,
        disk: DiskTier | None = None,
        draft: DraftMemory | None = None,
    ) -> None:
        """``draft``: the draft model's context, for ``opts.spec`` draft-simple."""
        self.b = backend
        self.opts = opts
        # the clock admission reads (aging, preemption); a test sets a fake one
        self.clock: Callable[[], float] = time.perf_counter
        self.waiting: collections.deque[Task] = collections.deque()
        self.stats = EngineStats()
        self.ckpt = CheckpointPolicy(
            enabled=opts.ctx_checkpoints > 0 and (backend.n_swa > 0 or backend.is_recurrent),
            max_per_slot=opts.ctx_checkpoints,
            min_step=opts.checkpoint_min_step,
            n_ubatch=backend.n_ubatch,
        )
        self.store = SlotStore(backend, self.ckpt, draft, opts.spec.most_drafted)
        self.spec = Speculation(
            opts.spec, self.store, self.stats, backend.is_recurrent, self._remaining
        )
        self.sharing = PrefixSharing(
            self.store,
            self.stats,
            enabled=opts.prefix_share and backend.kv_unified,
            min_wait=opts.prefix_share_min,
        )
        self._inbox: queue.SimpleQueue[Task | EmbedTask | _Op | None] = queue.SimpleQueue()
        self._ops: list[_Op] = []
        # events queued for delivery, each bound to its receiver, with its sink (None: a
        # plain callable, called on this thread at the flush)
        # queued deliveries by sink, in order (None: plain callables, called at the flush)
        self._outbox: dict[EventSink | None, list[Delivery]] = {}
        self._wake = threading.Event()
        # ops (commands) put in the inbox and not drained yet: an inbox of ops alone is not
        # coalesced (they have no decode to share)
        self._ops_queued = 0
        self._ops_lock = threading.Lock()
        # requests the HTTP side is preparing for this engine (``arrival``): coalescing
        # waits only while one is on its way, so a lone request never sleeps for company
        self._arriving = 0
        self._stop = False
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.par = ParallelSampling(opts.sample_threads, opts.sample_parallel_min)
        # --kv-events-endpoint: told of the slots' sequences after every step (kv_watch.py)
        self.kv_watch: SlotWatcher | None = None
        self._wire_phases(cache, disk)
        # --embedding: prompt-only tasks run on idle slots within a step (engine/embed.py)
        self.embed = EmbedQueue(backend, self.store, self._send_embed, self._flush)

    def _wire_phases(self, cache: PromptCache | None, disk: DiskTier | None) -> None:
        """The step's phases (engine/step_plan.py): decide (admit and place, resolve waiters,
        schedule), change memory (the runner, alone), account (update)."""
        self.scheduler = Scheduler(self.ckpt, self.spec, self.b, self.opts)
        self.scheduler.speed = self.sharing.speed  # one estimate, fed each step by sharing
        self.reuse = CacheReuse(self.b, self.store, self.stats, self.opts)
        self.executor = Executor(
            self.b, self.store, self.spec, self.stats, self.par, cache, self.reuse
        )
        self.updater = Updater(self.b, self.stats, self._send, lambda: self.shifts)
        self.preemption = Preemption()
        self.placer = Placer(
            self.b,
            self.store,
            self.sharing,
            self.spec,
            self.stats,
            cache,
            self.opts,
            self.reuse if self.reuse.available else None,
            self.preemption,
        )
        self.runner = Runner(
            self.store, self.spec, self.stats, self.executor, self.reuse, cache, disk
        )

    @property
    def cache(self) -> PromptCache | None:
        """The RAM prompt cache (admission consults it; tests may set it)."""
        return self.placer.cache

    @cache.setter
    def cache(self, cache: PromptCache | None) -> None:
        self.placer.cache = self.runner.cache = self.executor.cache = cache

    @property
    def disk(self) -> DiskTier | None:
        """The tier under the RAM cache: looked at with it (the longer match is restored)."""
        return self.runner.disk

    @property
    def slots(self) -> list[Slot]:
        """The slots (read-only outside the engine thread; changed only through ``store``)."""
        return self.store.slots

    # ---- public, thread-safe ------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop = True
        self._inbox.put(None)
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self.par.close()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    def submit(self, task: Task | EmbedTask) -> None:
        if not self.alive:
            raise EngineDead("the engine is not running")
        self._inbox.put(task)
        self._wake.set()

    def submit_command(self, cmd: Command[R]) -> Future[R]:
        """Run ``cmd.run(engine)`` on the engine thread between two steps, once ``cmd.slot``
        (when >= 0) is idle; commands and ops run in the order they came, except that one
        waiting for its slot lets later ones pass. The Future holds the command's typed
        result (its failures are results too: engine/commands.py), or what it raised;
        EngineDead in it when the engine stops first. EngineDead when it is not running;
        ValueError when ``cmd.slot`` names no slot (checked here, never on the engine thread)."""
        if not -1 <= cmd.slot < len(self.slots):
            raise ValueError(f"no slot {cmd.slot}: this engine has {len(self.slots)} slots")
        return self.call(cmd.run, slot=cmd.slot)

    def call(self, fn: Callable[[Engine], object], slot: int = -1) -> Future:
        """Run ``fn(engine)`` on the engine thread between steps, once ``slot`` (if given) is
        idle. The untyped form of ``submit_command``, for tests and diagnostics: what the
        HTTP side asks of the engine is a command."""
        if not self.alive:
            raise EngineDead("the engine is not running")
        op = _Op(fn, slot, Future())
        with self._ops_lock:  # before the put: the drain counts it down
            self._ops_queued += 1
        self._inbox.put(op)
        self._wake.set()
        return op.future

    def arrival(self, delta: int) -> None:
        """``+1`` when a request starts its preparation (tokenizing, checks) for this
        engine, ``-1`` when it is submitted or fails; thread-safe. Woken from idle, the
        engine coalesces arrivals only while this count is above zero."""
        with self._ops_lock:
            self._arriving += delta

    def queue_depth(self) -> int:
        """Tasks waiting for a slot, including those not yet picked up (approximate, lock-free)."""
        return len(self.waiting) + len(self.embed) + self._inbox.qsize()

    def n_idle_slots(self) -> int:
        return sum(1 for s in self.slots if s.task is None)

    # ---- loop ---------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop:
                self._drain_inbox()
                if not self._has_work():
                    self._flush()
                    self._wake.wait(0.5)
                    self._wake.clear()
                    self._coalesce()
                    continue
                if not self.step(flush=False):
                    self._wake.wait(0.002)  # work, but none decodable now (lagging readers)
                    self._wake.clear()
        except BaseException as e:  # the engine must never die silently
            log.exception("engine thread died")
            self.error = e
            self._fail_everything(f"engine failure: {e}")
            return
        self._fail_everything("the server is shutting down")

    def _coalesce(self) -> None:
        """Woken from idle: requests sent together reach the queue a few ms apart (each is
        parsed and tokenized off the event loop). Wait while they keep coming (a few slices
        of ``coalesce_ms`` at most) so they share the first decode instead of trailing it.
        Commands alone (a slot save or restore) have no decode to share: they run at once.
        Nor does a request with no other on its way (``arrival``): it runs at once too."""
        if self.opts.coalesce_ms <= 0 or self._inbox.qsize() <= self._ops_queued:
            return  # nothing, or commands alone
        seen = self._inbox.qsize()
        for _ in range(4):
            if self._arriving <= 0:
                return  # nobody else is being prepared: nothing to wait for
            time.sleep(self.opts.coalesce_ms / 1e3)
            n = self._inbox.qsize()
            if n == seen:
                return
            seen = n

    def _has_work(self) -> bool:
        if self.waiting or self._ops or self.embed.waiting or self.updater.ended:
            return True
        return any(not s.idle for s in self.slots)

    def _drain_inbox(self) -> None:
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if item is None:
                continue
            if isinstance(item, _Op):
                with self._ops_lock:
                    self._ops_queued -= 1
                self._ops.append(item)
            elif isinstance(item, EmbedTask):
                self.embed.waiting.append(item)
            else:
                self.waiting.append(item)

    def _run_ops(self) -> None:
        if not self._ops:
            return
        keep: list[_Op] = []
        for op in self._ops:
            if op.slot >= 0 and not self.slots[op.slot].idle:
                keep.append(op)  # waits until the slot is idle; never touches a running task
                continue
            if op.future.set_running_or_notify_cancel():
                try:
                    op.future.set_result(self.runner.command(op.fn, self))
                except BaseException as e:
                    op.future.set_exception(e)
        self._ops = keep

    def step(self, flush: bool = True) -> bool:
        """One scheduling + decode step; whether it decoded. Engine thread only (or tests).

        Events are delivered right before the next llama_decode; with ``flush`` also at the
        end of this step (the engine thread passes False and flushes when it goes idle).
        """
        t0 = time.perf_counter()
        self._take_in()  # ended runs settled; the inbox, the commands, the cancellations
        self._admit()  # waiting tasks placed on slots (the runner does their memory work)
        decoded = False
        try:
            decoded = self._embed_step() | self._batch_step()  # both run: embeddings first
            if decoded:
                self.stats.on_step(time.perf_counter() - t0)
        finally:
            self._settle(flush or not decoded)  # no decode ahead to piggyback on: flush
        return decoded

    def _take_in(self) -> None:
        """What happened since the last step: runs that ended settle (their draft catch-up,
        their parked chunks), queued tasks and commands come in, cancelled tasks go."""
        self.runner.settle_ended(self.updater.ended)
        self._drain_inbox()
        self._run_ops()
        self._reap_cancelled()
        self.runner.reap_reuse()  # a run that ended (a client that left) parks nothing now

    def _embed_step(self) -> bool:
        """Waiting embedding prompts decoded (engine/embed.py); whether any was."""
        return self.runner.drive(self.embed.step()) if self.embed.waiting else False

    def _settle(self, flush: bool) -> None:
        """After the decode, whatever happened in it: parked chunks reaped, the KV watcher
        told, and with ``flush`` the step's events delivered."""
        self.runner.reap_reuse()
        if self.kv_watch is not None:
            self.kv_watch.sync(self.slots)
        if flush:
            self._flush()

    def _send(self, task: Task, ev: Event) -> None:
        """Queue an event for its task; see ``_flush`` for when it is delivered."""
        task.n_sent += 1
        self._queue(task.emit, ev)

    def _send_embed(self, task: EmbedTask, ev: EmbedEvent) -> None:
        """Queue an embedding task's event, as ``_send``."""
        task.n_sent += 1
        self._queue(task.emit, ev)

    def _queue(self, emit: Callable[[E], None], ev: E) -> None:
        if isinstance(emit, Emitter):
            sink: EventSink | None = emit.sink
            delivery = emit.bind(ev)
        else:
            sink, delivery = None, partial(emit, ev)
        box = self._outbox.get(sink)
        if box is None:
            self._outbox[sink] = [delivery]
        else:
            box.append(delivery)

    def _flush(self) -> None:
        """Deliver queued events with one ``EventSink.deliver`` per sink (one wake-up per
        event loop). Called just before llama_decode (which releases the GIL for
        milliseconds), so the HTTP side serializes and sends chunks while the model runs
        instead of contending with this thread for the GIL between decodes. Plain callables
        (tests) are called directly."""
        if not self._outbox:
            return
        out, self._outbox = self._outbox, {}
        for delivery in out.pop(None, ()):
            delivery()
        for sink, batch in out.items():
            assert sink is not None  # popped above
            sink.deliver(batch)

    # ---- admission ----------------------------------------------------------------

    def _reap_cancelled(self) -> None:
        if any(t.cancelled for t in self.waiting):
            for t in self.waiting:
                if t.cancelled:
                    self.preemption.drop(t)
            self.waiting = collections.deque(t for t in self.waiting if not t.cancelled)
        for s in self.slots:  # per slot and step: the cheap test first
            run = s.run
            if run is not None and run.task.cancelled and s.state is not SlotState.IDLE:
                self.updater.finish(s, FinishReason.CANCELLED)

    def _admit(self) -> None:
        """Admission: ``admit`` decides where the waiting tasks go, ``place`` starts them
        (the memory side: cache restores, cuts, sharing); then the tasks waiting for a
        shared prefix that is ready copy it."""
        if self.waiting:
            self._place_waiting()
        self.runner.drive(self.sharing.resolve_waiters())

    def _place_waiting(self) -> None:
        now = self.clock()
        rule = self.opts.priority
        if rule.on:
            self._preempt(now)
        admission = self.scheduler.admit(self.waiting, self.slots, self.sharing.locator)
        self.waiting = admission.deferred
        placed = self.runner.drive(self.placer.place(admission.placements))
        for p in admission.placements:
            t = p.task
            if p.slot.task is t:
                self.stats.on_admitted(
                    t.priority, now - (t.t_waiting or t.t_enqueued), not p.slot.live.preempted
                )
        for task, err in placed.failed:
            self.preemption.drop(task)
            self._send(task, err)
        for slot in placed.progress:
            self.updater.progress(slot)

    def _preempt(self, now: float) -> None:
        """--scheduling-policy priority: order the queue, then preempt the runs that waiting
        tasks of a better priority displace (engine/priority.py, engine/preempt.py); the
        preempted tasks wait again, in order."""
        rule = self.opts.priority
        self.waiting = rule.order(self.waiting, now)
        if sum(1 for s in self.slots if s.idle) >= len(self.waiting):
            return  # an idle slot for every waiter: nothing to weigh
        runs = self.preemption.views(
            rule, self.slots, self.cache is not None, self.spec.by_model, now
        )
        room = self.preemption.make_room(rule, self.waiting, self.slots, runs, now)
        back = self.runner.drive(room)
        if back:
            self.stats.on_preempted([t.priority for t in back])
            self.waiting.extend(back)
            self.waiting = rule.order(self.waiting, now)

    # ---- the step: schedule, execute, update ---------------------------------------

    def _batch_step(self) -> bool:
        """Schedule, execute and update one batch; False when there was nothing to decode."""
        # backpressure: a slot whose reader lags generates nothing until it catches up
        active = _decodable(self.slots)
        if not active:
            return False
        t0 = time.perf_counter()
        plan = self.scheduler.schedule(active)
        if not plan.work:
            return False
        self._flush()  # deliver events while llama.cpp runs (it releases the GIL)
        out = self.runner.execute(plan)
        self.updater.update(out)
        if out.n_tokens:
            self.stats.on_batch(out.n_tokens, time.perf_counter() - t0)
        return bool(out.outputs or out.ended)

    @property
    def reuses(self) -> bool:
        """--cache-reuse is on and can work: the KV cache can move positions and the
        scratch sequence exists (llama-server turns it off otherwise, with a warning)."""
        return self.opts.cache_reuse > 0 and self.reuse.available

    @property
    def shifts(self) -> bool:
        """--context-shift is on and the KV cache can move positions (llama-server turns
        it off otherwise)."""
        return self.opts.context_shift and self.b.can_shift

    def _remaining(self, run: SlotRun) -> int:
        """Tokens the run may still generate (-1: no limit but the context)."""
        limit = run.task.gen.max_tokens
        return -1 if limit < 0 else limit - run.n_decoded

    def _fail_everything(self, message: str) -> None:
        self._flush()
        for s in self.slots:
            if s.task is not None:
                s.task.emit(TaskError(500, message))
                s.release()
        while self.waiting:
            t = self.waiting.popleft()
            self.preemption.drop(t)
            t.emit(TaskError(503, message))
        self.embed.fail_all(message)
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, Task | EmbedTask):
                item.emit(TaskError(503, message))
            elif isinstance(item, _Op):
                item.future.set_exception(EngineDead(message))
        for op in self._ops:
            if not op.future.done():
                op.future.set_exception(EngineDead(message))

    # ---- integrity ----------------------------------------------------------------

    # ---- what the HTTP side may read (public; routes never reach into the parts) ----

    @property
    def checkpoints_per_slot(self) -> int:
        """The most context checkpoints a slot keeps (--ctx-checkpoints)."""
        return self.store.ckpt.max_per_slot

    @property
    def step_speed(self) -> tuple[float | None, float | None]:
        """The measured step time as (seconds per step, seconds per token); None until
        measured (share_cost.StepSpeed)."""
        speed = self.sharing.speed
        return speed.per_step, speed.per_token

    def draft_shared(self, slot: Slot) -> int:
        """Tokens of ``slot``'s draft-model sequence shared with another (SlotStore)."""
        return self.store.draft_shared(slot)

    def check_integrity(self) -> list[str]:
        """The slot store's invariant (tokens == KV, for the target and a draft model's
        context) and the RAM cache's (its accounting and its prefix index); returns
        problems. The disk tier checks its own (DiskTier.check_integrity): its scanner and
        writer threads change it under its lock."""
        problems = self.store.check_integrity(self.reuse.held())
        if self.cache is not None:
            problems += [f"RAM cache: {p}" for p in self.cache.check_integrity()]
        return problems


@dataclass
class _Op:
    fn: Callable[[Engine], object]
    slot: int
    future: Future


def _decodable(slots: list[Slot]) -> list[Slot]:
    """The slots prefilling or generating, but for generating ones whose reader lags
    (backpressure: they decode nothing this step). One pass, no call per slot."""
    out = []
    prefill, generate = SlotState.PREFILL, SlotState.GENERATE
    for s in slots:
        state = s.state
        if state is generate:
            run = s.run
            assert run is not None  # a generating slot holds its run (no ``live`` call)
            task = run.task
            lagging = task.lagging
            if lagging is not None and lagging(task.n_sent):
                continue
        elif state is not prefill:
            continue
        out.append(s)
    return out
