"""The engine: one thread owns the llama context and runs continuous-batching steps.

Each step (DESIGN §3): admit waiting tasks to idle slots, build one batch holding the next
token of every generating slot plus prompt chunks of prefilling slots (<= n_batch tokens),
decode it once, sample where logits were requested, emit text to the tasks' sinks.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from ..cache.disk import DiskTier
from ..cache.prompt_cache import PromptCache
from ..types import (
    Event,
    FinishReason,
    PromptProgress,
    Task,
    TaskError,
    TaskResult,
    TextChunk,
    Timings,
    TokenLogprob,
)
from . import disk_glue, ram
from .backend_api import Backend
from .checkpoints import CheckpointPolicy
from .draft_kv import DraftMemory
from .embed import EmbedQueue, EmbedTask
from .policy import CheckpointView, SlotChoice, SlotView, choose_slot, plan_reuse
from .sampling import ParallelSampling, cpu_reason
from .sharing import PrefixSharing
from .slot import Slot, SlotRun, SlotState
from .spec_step import Speculation
from .speculative import SpecConfig
from .stats import EngineStats
from .store import SlotStore, shift_span

log = logging.getLogger("server.slots.engine")


@dataclass
class EngineOptions:
    """Scheduler settings (``server.app.engine_options`` builds them from Settings)."""

    slot_prompt_similarity: float = 0.10
    ctx_checkpoints: int = 32
    checkpoint_min_step: int = 8192
    cache_idle_slots: bool = True  # only with a RAM cache
    prefix_share: bool = True  # needs unified KV
    prefix_share_min: int = 128  # least gain worth waiting for an in-flight prefix
    coalesce_ms: float = 2.0  # after idle, wait in slices this long for concurrent arrivals
    # workers sampling the CPU-sampled slots of one step concurrently (-1: auto, by the
    # cores; 0: off); used from ``sample_parallel_min`` such slots (see slots/sampling.py)
    sample_threads: int = -1
    sample_parallel_min: int = 4
    spec: SpecConfig = field(default_factory=SpecConfig)  # speculative decoding (--spec-*)
    context_shift: bool = False  # --context-shift: a full slot shifts (SlotStore.shift)


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
        self.cache = cache
        self.disk = disk  # the tier under the RAM cache: consulted when the RAM cache misses
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
        self._outbox: list[tuple[Callable[[Event], None], Event]] = []
        self._wake = threading.Event()
        self._stop = False
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.par = ParallelSampling(opts.sample_threads, opts.sample_parallel_min)
        # --embedding: prompt-only tasks run on idle slots within a step (slots/embed.py)
        self.embed = EmbedQueue(
            backend, self.store, cache, self._send, self._flush, self._free_idle_kv
        )

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

    def call(self, fn: Callable[[Engine], Any], slot: int = -1) -> Future:
        """Run ``fn(engine)`` on the engine thread between steps, once ``slot`` (if given) is idle."""
        if not self.alive:
            raise EngineDead("the engine is not running")
        op = _Op(fn, slot, Future())
        self._inbox.put(op)
        self._wake.set()
        return op.future

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
        parsed and tokenized on the event loop). Wait while they keep coming (a few slices of
        ``coalesce_ms`` at most) so they share the first decode instead of trailing it."""
        if self.opts.coalesce_ms <= 0 or self._inbox.empty():
            return
        seen = self._inbox.qsize()
        for _ in range(4):
            time.sleep(self.opts.coalesce_ms / 1e3)
            n = self._inbox.qsize()
            if n == seen:
                return
            seen = n

    def _has_work(self) -> bool:
        return bool(self.waiting or self._ops or self.embed.waiting) or any(
            not s.idle for s in self.slots
        )

    def _drain_inbox(self) -> None:
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if item is None:
                continue
            if isinstance(item, _Op):
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
                    op.future.set_result(op.fn(self))
                except BaseException as e:
                    op.future.set_exception(e)
        self._ops = keep

    def step(self, flush: bool = True) -> bool:
        """One scheduling + decode step; whether it decoded. Engine thread only (or tests).

        Events are delivered right before the next llama_decode; with ``flush`` also at the
        end of this step (the engine thread passes False and flushes when it goes idle).
        """
        t0 = time.perf_counter()
        self._drain_inbox()
        self._run_ops()
        self._reap_cancelled()
        self._admit()
        decoded = False
        try:
            embedded = self.embed.step() if self.embed.waiting else False
            decoded = self._decode_step() or embedded
            if decoded:
                self.stats.on_step(time.perf_counter() - t0)
        finally:
            if flush or not decoded:  # no decode ahead to piggyback on
                self._flush()
        return decoded

    def _send(self, task: Task, ev: Event) -> None:
        """Queue an event for its task; see ``_flush`` for when it is delivered."""
        task.n_sent += 1
        self._outbox.append((task.emit, ev))

    def _flush(self) -> None:
        """Deliver queued events with one wake-up per event loop. Called just before
        llama_decode (which releases the GIL for milliseconds), so the HTTP side serializes
        and sends chunks while the model runs instead of contending with this thread for the
        GIL between decodes. Emitters without a loop (tests) are called directly."""
        if not self._outbox:
            return
        out, self._outbox = self._outbox, []
        by_loop: dict[Any, list] = {}
        for emit, ev in out:
            loop = getattr(emit, "loop", None)
            if loop is None:
                emit(ev)
            else:
                by_loop.setdefault(loop, []).append((emit.deliver, ev))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver_all, items)
            except RuntimeError:  # loop closed: the clients are gone
                pass

    # ---- admission ----------------------------------------------------------------

    def _reap_cancelled(self) -> None:
        if any(t.cancelled for t in self.waiting):
            self.waiting = collections.deque(t for t in self.waiting if not t.cancelled)
        for s in self.slots:
            if s.task is not None and s.task.cancelled:
                self._finish(s, FinishReason.CANCELLED)

    def _admit(self) -> None:
        if not self.waiting:
            return
        deferred: collections.deque[Task] = collections.deque()
        launched = False
        while self.waiting:
            task = self.waiting.popleft()
            views = [SlotView(s.id, s.idle, s.tokens, s.last_used, s.tenant) for s in self.slots]
            choice = choose_slot(
                views, task.prompt, task.id_slot, self.opts.slot_prompt_similarity, task.tenant
            )
            if choice is None:
                deferred.append(task)
                if task.id_slot < 0:
                    break  # no idle slot at all: keep FIFO order for the rest
                continue
            launched |= self._place(self.slots[choice.slot], task, choice)
        deferred.extend(self.waiting)
        self.waiting = deferred
        # once per admission pass: the slots left idle go to the RAM cache
        if launched and self.cache is not None and self.opts.cache_idle_slots:
            ram.cache_idle_slots(self.store, self.cache, self.b.kv_unified)

    def _place(self, slot: Slot, task: Task, choice: SlotChoice) -> bool:
        """Start ``task`` on ``slot`` after consulting the RAM cache; a failure here fails
        this task only. True when the task started."""
        try:
            n_lcp: int | None = choice.lcp
            if self.cache is not None and choice.update_cache:
                if choice.save_first:
                    ram.save(self.store, self.cache, slot)
                # one walk of the prompt down the prefix index serves both tiers
                match = self.cache.index.match(task.tenant, task.prompt)
                loaded = ram.load(self.store, self.cache, slot, task.prompt, task.tenant, match)
                if not loaded and self.disk is not None:  # the tier under RAM
                    loaded = disk_glue.load(
                        self.store, self.disk, slot, task.prompt, task.tenant, match
                    )
                if loaded or (n_lcp is not None and n_lcp > len(slot.tokens)):
                    n_lcp = None  # recomputed: a restore, or a failed one that emptied the slot
                self.cache.update()
            self._launch(slot, task, n_lcp)
            return True
        except Exception as e:
            log.exception("failed to start task %d", task.id)
            if slot.task is task:
                slot.release()
            self._send(task, TaskError(500, f"failed to start the task: {e}"))
            return False

    def _launch(self, slot: Slot, task: Task, n_lcp: int | None) -> None:
        """Place ``task`` on ``slot``: keep the reusable prefix of its KV, drop the rest."""
        plan = plan_reuse(
            slot.tokens,
            task.prompt,
            cache_prompt=task.cache_prompt,
            pos_min=self.store.pos_min(slot),
            n_swa=self.b.n_swa,
            checkpoints=[
                CheckpointView(c.n_tokens, c.pos_min, c.pos_max) for c in slot.checkpoints
            ],
            n_lcp=n_lcp,
            recurrent=self.b.is_recurrent,
        )
        if plan.checkpoint >= 0:
            n_past = self.store.resume_at_checkpoint(slot, plan.checkpoint)
            if n_past > 0:
                self.stats.checkpoints_restored += 1
        else:
            n_past = self.store.cut(slot, plan.n_past)
        wait = None
        if task.cache_prompt:
            held = self.sharing.held_source(slot, task.prompt, n_past, task.tenant)
            if held is not None:
                n_past = self.sharing.copy(self.slots[held.slot], slot, held.n_tokens)
            wait = self.sharing.inflight_source(slot, task.prompt, n_past, task.tenant)
        run = slot.start(task, n_past)
        if task.return_progress:  # llama-server's first (0 %) progress event
            self._progress(slot)
        if wait is not None:
            self.sharing.wait_on(slot, wait)
        run.sampler = self.b.new_sampler(task.sampling, task.prompt)
        if task.sampling.constraint is not None:
            run.matcher = task.sampling.constraint.matcher()
        if self.b.backend_sampling:
            self._place_sampler(slot, run)
        self.spec.plan(run)
        t_wait = (run.t_start - task.t_enqueued) * 1e3
        self.stats.on_launch(t_wait)
        log.debug(
            "slot %d: task %d, prompt %d, reuse %d (%s), queued %.1f ms",
            slot.id,
            task.id,
            len(task.prompt),
            n_past,
            plan.reason,
            t_wait,
        )

    # ---- decode step --------------------------------------------------------------

    def _decode_step(self) -> bool:
        """Build, decode and sample one batch; False when there was nothing to decode."""
        self.sharing.resolve_waiters()
        # backpressure: a slot whose reader lags generates nothing until it catches up
        active = [
            s
            for s in self.slots
            if s.state in (SlotState.PREFILL, SlotState.GENERATE) and not _lagging(s)
        ]
        if not active:
            return False
        budget = self.b.n_batch
        while True:
            n = self._build_batch(active, budget)
            if n == 0:
                return False
            self._flush()
            t0 = time.perf_counter()
            try:
                ret = self.b.decode(0, n)
            except Exception:
                log.exception("llama_decode raised")
                ret = -100
            dt = time.perf_counter() - t0
            if ret == 0:
                break
            for s in active:
                self.store.rollback(s)
            budget, active = self._recover(ret, budget, active)
            if not active:
                return True
        self.stats.on_decode(sum(1 for s in active if s.pending), dt)
        self._after_decode(active)
        return True

    def _recover(self, ret: int, budget: int, active: list[Slot]) -> tuple[int, list[Slot]]:
        """After a failed decode: free idle KV, else halve the batch, else end the longest
        task. Returns the budget and the slots for the next try."""
        if ret == 1 and self._free_idle_kv():
            return budget, active
        if ret == 1 and budget > 1:
            budget = max(1, budget // 2)
            log.warning("llama_decode found no KV room; retrying with n_batch=%d", budget)
            return budget, active
        victim = max(active, key=lambda s: len(s.tokens))
        log.error("llama_decode failed (%d); ending task on slot %d", ret, victim.id)
        if ret == 1:
            # an error, as llama-server sends one, never a quiet "length" with no text
            self.stats.kv_exhausted += 1
            error = "Context size has been exceeded: the KV cache has no room left"
        else:
            error = f"llama_decode failed ({ret})"
        self._finish(victim, FinishReason.ERROR, error=error)
        return budget, [s for s in active if s is not victim]

    def _build_batch(self, active: list[Slot], budget: int) -> int:
        batch = self.b.batch
        batch.clear()
        gen = [s for s in active if s.state is SlotState.GENERATE]
        pre = sorted(
            (s for s in active if s.state is SlotState.PREFILL), key=lambda s: s.run.t_start
        )
        # Generating slots first: a long prefill never starves them of their next token. They
        # go into the (empty) batch in one call: no per-token batch writes from Python.
        toks: list[int] = []
        pos: list[int] = []
        seqs: list[int] = []
        drafted = self.spec.model_drafts(gen)
        for s in gen:
            if len(toks) >= budget:
                s.pending, s.i_batch, s.run.draft = [], -1, []
                continue
            run = s.run
            if run.n_decoded == 1 and self._wants_prompt_end_checkpoint(s):
                self._take_checkpoint(s)
            s.i_batch = len(toks)
            n = len(s.tokens)
            if run.spec is None:
                s.pending = [run.next_token]
                toks.append(run.next_token)
                pos.append(n)
                seqs.append(s.id)
                continue
            # the sampled token and its draft, each row with logits (verified after decode)
            run.draft = self.spec.draft(s, budget - len(toks) - 1, drafted)
            s.pending = [run.next_token, *run.draft]
            toks.extend(s.pending)
            pos.extend(range(n, n + len(s.pending)))
            seqs.extend([s.id] * len(s.pending))
        if toks:
            batch.add_tokens(toks, pos, seqs)
        for s in pre:
            s.pending, s.i_batch = [], -1
            if budget - batch.n > 0:
                self._add_prompt_chunk(s, budget - batch.n)
        return batch.n

    def _remaining(self, run: SlotRun) -> int:
        """Tokens the run may still generate (-1: no limit but the context)."""
        limit = run.task.gen.max_tokens
        return -1 if limit < 0 else limit - run.n_decoded

    def _add_prompt_chunk(self, s: Slot, room: int) -> None:
        """Add the slot's next prompt chunk (at most ``room`` tokens) to the batch. A chunk
        ends where a sharing waiter or a checkpoint needs the slot to stop."""
        cur = len(s.tokens)
        task = s.run.task
        prompt = task.prompt
        end = min(len(prompt), cur + room)
        marks = s.run.share_marks
        if marks:
            end = min(end, min((m for m in marks if m > cur), default=end))
        if self.ckpt.enabled:
            n_start = s.run.n_cached
            end = min(end, self.ckpt.chunk_end(cur, len(prompt), task.user_start, n_start))
            if self.ckpt.wants(cur, len(prompt), task.user_start, s.checkpoints, n_start):
                self._take_checkpoint(s)
        s.pending = prompt[cur:end]
        last = end == len(prompt)
        i = self.b.batch.add_span(s.pending, cur, s.id, last)
        s.i_batch = i if last else -1

    def _wants_prompt_end_checkpoint(self, s: Slot) -> bool:
        """The slot holds exactly its prompt and its first sampled token is about to be
        decoded. Skipped when prompt plus answer stay inside one window: a restored state of
        at most n_swa tokens serves every cut."""
        n_prompt = len(s.tokens)
        if not self.ckpt.wants_at_prompt_end(n_prompt, s.checkpoints):
            return False
        limit = s.run.task.gen.max_tokens
        return self.b.is_recurrent or limit < 0 or n_prompt + limit > self.b.n_swa

    def _take_checkpoint(self, s: Slot) -> None:
        self.spec.sync(s, whole=True)  # the checkpoint carries the draft's state too
        c = self.store.take_checkpoint(s)
        self.stats.checkpoints_created += 1
        log.debug("slot %d: checkpoint at %d tokens (%d bytes)", s.id, c.n_tokens, c.nbytes)

    def _free_idle_kv(self) -> bool:
        """Clear idle slots' sequences to make KV room (unified mode), saving them to the RAM
        cache first when there is one. True if any was freed."""
        freed = False
        for s in self.slots:
            if s.idle and s.tokens:
                ram.evict_idle(self.store, self.cache, s)
                freed = True
        return freed

    def _after_decode(self, active: list[Slot]) -> None:
        now = time.perf_counter()
        todo: list[tuple[Slot, int]] = []
        for s in active:
            if not s.pending:
                continue
            run = s.run
            n = self.store.commit(s)
            if s.state is SlotState.PREFILL:
                run.n_processed += n
                if run.task.return_progress:
                    self._progress(s)
            if s.i_batch < 0:
                continue
            s.i_batch, idx = -1, s.i_batch
            if s.state is SlotState.PREFILL:
                s.state = SlotState.GENERATE
                run.t_first = now
                self.stats.on_first_token((now - run.task.t_enqueued) * 1e3)
                if run.task.gen.max_tokens == 0:  # prompt only (n_predict 0): nothing sampled
                    self._finish(s, FinishReason.LENGTH)
                    continue
            todo.append((s, idx))
        self._sample_all(todo)

    def _place_sampler(self, slot: Slot, run: SlotRun) -> None:
        """-bs: run the slot's chain on the backend, or count why it stays on the CPU."""
        reason = cpu_reason(run.task)
        run.backend_sampled = not reason and self.b.attach_sampler(run.sampler, slot.id)
        self.stats.on_sampler_placed(reason or ("" if run.backend_sampled else "refused"))

    def _sample_all(self, todo: list[tuple[Slot, int]]) -> None:
        """Sample every slot that got logits. The CPU-sampled slots without a constraint
        are sampled together first (concurrently when the pool is worth it), then each slot
        takes its token in turn."""
        cpu = [
            (s, i)
            for s, i in todo
            if s.run.matcher is None and not s.run.backend_sampled and not s.run.draft
        ]
        picked: dict[int, int] = {}
        if len(cpu) > 1:
            pool = self.par.pool_for(len(cpu))
            try:
                toks = self.b.sample_many([(s.run.sampler, i) for s, i in cpu], pool)
                picked = {s.id: t for (s, _), t in zip(cpu, toks, strict=True)}
            except Exception:  # sampled one by one below, where a failure ends its slot only
                log.exception("batched sampling failed")
        for s, idx in todo:
            if s.run.draft:
                self._verify(s, idx)
            else:
                self._sample(s, idx, picked.get(s.id, -1))

    def _sample(self, s: Slot, idx: int, tok: int = -1) -> None:
        """Take the slot's next token (``tok`` when already sampled) and emit its text."""
        try:
            if tok < 0:
                tok = self._pick(s.run, idx)
        except Exception as e:
            log.exception("sampling failed on slot %d", s.id)
            self._finish(s, FinishReason.ERROR, error=f"sampling failed: {e}")
            return
        self._take(s, idx, tok)

    def _verify(self, s: Slot, idx: int) -> None:
        """A drafting slot's rows ``idx..idx+k`` were decoded: sample them in order while
        the sampled token equals the draft, drop the rejected rows from the KV cache, then
        take the sampled tokens (the last one is the next to decode)."""
        run = s.run
        draft, run.draft = run.draft, []
        picked: list[int] = []
        try:
            for i in range(len(draft) + 1):
                picked.append(self._pick(run, idx + i))
                if i == len(draft) or picked[-1] != draft[i]:
                    break
        except Exception as e:
            log.exception("sampling failed on slot %d", s.id)
            self._finish(s, FinishReason.ERROR, error=f"sampling failed: {e}")
            return
        log.debug("slot %d: accepted %d/%d draft tokens", s.id, len(picked) - 1, len(draft))
        if not self.spec.accept(s, draft, len(picked) - 1):
            self._finish(s, FinishReason.ERROR, error="could not drop rejected draft tokens")
            return
        for i, tok in enumerate(picked):
            if not self._take(s, idx + i, tok):
                return

    def _take(self, s: Slot, idx: int, tok: int) -> bool:
        """Account for the sampled token ``tok`` (logits row ``idx``) and emit its text;
        False when this ended the run."""
        run = s.run
        gen = run.task.gen
        run.n_decoded += 1
        lp: TokenLogprob | None = None
        if gen.logprobs or gen.n_probs > 0:
            lp = self.b.sampled_logprobs(run.sampler, idx, tok, gen.n_probs)
        if self.b.is_eog(tok) and not gen.ignore_eos:
            self._finish(s, FinishReason.STOP)
            return False
        run.generated.append(tok)
        rel = run.stream.push(self.b.token_to_piece(tok))
        if lp is not None:
            run.logprobs.append(lp)
        if rel.text or rel.stop:
            self._emit_text(run, rel.text)
        if rel.stop:
            self._finish(s, FinishReason.STOP, stop_word=rel.stop)
            return False
        if run.matcher is not None and run.matcher.is_done():
            self._finish(s, FinishReason.STOP)  # the constraint is complete: nothing may follow
            return False
        limit = run.task.gen.max_tokens
        if (limit >= 0 and run.n_decoded >= limit) or self._context_full(s):
            self._finish(s, FinishReason.LENGTH)
            return False
        run.next_token = tok
        return True

    def _pick(self, run: SlotRun, idx: int) -> int:
        """The run's next token: sampled, and for a constrained run one its matcher allows
        (the matcher is advanced over it). Costs a constrained slot about 0.2 ms per token,
        1-2 ms when the sampled token is refused (full-vocabulary mask): it never holds up
        the batch for long. Raises RuntimeError when the constraint admits no token."""
        m = run.matcher
        if m is None:
            return self.b.sample(run.sampler, idx)
        gen = run.task.gen
        # with log-probs wanted, always mask: they report the constrained distribution
        tok = self.b.sample_constrained(run.sampler, idx, m, gen.logprobs or gen.n_probs > 0)
        if tok < 0 or not m.accept(tok):
            raise RuntimeError(f"the constraint admits no token: {m.error() or 'dead end'}")
        return tok

    def _progress(self, s: Slot) -> None:
        """Send the slot's prompt progress (tasks with ``return_progress``, streamed only):
        ``processed`` is what the slot holds of the prompt, cached tokens included."""
        run = s.run
        if run.task.stream:
            t_ms = (time.perf_counter() - run.t_start) * 1e3
            ev = PromptProgress(run.n_prompt, run.n_cached, len(s.tokens), int(t_ms))
            if run.task.timings_per_token:  # llama-server's: 0 ms until a prompt token is in
                ms = t_ms if run.n_processed else 0.0
                ev.timings = Timings(cache_n=run.n_cached, prompt_n=run.n_processed, prompt_ms=ms)
            self._send(run.task, ev)

    @property
    def shifts(self) -> bool:
        """--context-shift is on and the KV cache can move positions (llama-server turns
        it off otherwise)."""
        return self.opts.context_shift and bool(getattr(self.b, "can_shift", False))

    def _context_full(self, s: Slot) -> bool:
        """Whether the slot has no room for its next token. With --context-shift a full slot
        drops half of what follows n_keep and goes on (llama-server's rule: shift_span); the
        run is ``truncated`` either way."""
        if len(s.tokens) + 1 < s.n_ctx:
            return False
        run = s.run
        run.truncated = True
        if not self.shifts:
            return True
        gen = run.task.gen
        add_bos = bool(getattr(self.b, "add_bos", False))
        n_keep, n_discard = shift_span(
            len(s.tokens), s.n_ctx, run.n_prompt, gen.n_keep, gen.n_discard, add_bos
        )
        if not self.store.shift(s, n_keep, n_discard):
            return True
        if run.history is not None:
            run.history.truncate(n_keep)
        self.stats.context_shifts += 1
        log.info("slot %d: context shift, n_keep = %d, n_discard = %d", s.id, n_keep, n_discard)
        return False

    def _emit_text(self, run: SlotRun, text: str) -> None:
        """Release text; it carries the tokens (and log-probs) not sent yet, which includes
        those whose text was held back as a possible stop-string prefix."""
        if run.task.stream:
            n = run.n_emitted
            chunk = TextChunk(text, run.generated[n:], run.logprobs[n:])
            if run.task.timings_per_token:  # llama-server's timings on every chunk
                chunk.timings = _timings_of(run, time.perf_counter())
            self._send(run.task, chunk)
            run.n_emitted = len(run.generated)
        run.out_text.append(text)

    def _finish(
        self, s: Slot, reason: FinishReason, *, stop_word: str = "", error: str = ""
    ) -> None:
        run = s.run
        task = run.task
        now = time.perf_counter()
        if reason is not FinishReason.STOP or not stop_word:
            rest = run.stream.flush()
            if rest and reason is not FinishReason.CANCELLED:
                self._emit_text(run, rest)
        result = _result_of(s.id, run, reason, stop_word, error, now)
        if run.sampler is not None:
            run.sampler.free()
            run.sampler = None
        self.stats.on_finish(result, (now - task.t_enqueued) * 1e3)
        if reason is FinishReason.ERROR:
            self._send(task, TaskError(500, error or "generation failed"))
        else:
            self._send(task, result)
        t = result.timings
        log.info(
            "slot %d task %d: %s cache_n=%d prompt_n=%d predicted_n=%d prompt_ms=%.1f predicted_ms=%.1f",
            s.id,
            task.id,
            reason.value,
            t.cache_n,
            t.prompt_n,
            t.predicted_n,
            t.prompt_ms,
            t.predicted_ms,
        )
        if reason is not FinishReason.ERROR:
            self.spec.sync(s)  # the idle slot's snapshots carry the draft's state too
        s.release()

    def _fail_everything(self, message: str) -> None:
        self._flush()
        for s in self.slots:
            if s.task is not None:
                s.task.emit(TaskError(500, message))
                s.release()
        while self.waiting:
            self.waiting.popleft().emit(TaskError(503, message))
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

    def check_integrity(self) -> list[str]:
        """The slot store's invariant (tokens == KV) for every slot; returns problems."""
        return self.store.check_integrity()


def _timings_of(run: SlotRun, now: float) -> Timings:
    """The run's token accounting and times so far (all of them when it ends now)."""
    t_first = run.t_first or now
    return Timings(
        cache_n=run.n_cached,
        prompt_n=run.n_processed,
        prompt_ms=(t_first - run.t_start) * 1e3,
        predicted_n=run.n_decoded,
        predicted_ms=(now - t_first) * 1e3 if run.t_first else 0.0,
        draft_n=run.n_drafted,
        draft_n_accepted=run.n_draft_accepted,
    )


def _result_of(
    slot_id: int, run: SlotRun, reason: FinishReason, stop_word: str, error: str, now: float
) -> TaskResult:
    """The TaskResult of a run ending now: its text, tokens and token accounting."""
    timings = _timings_of(run, now)
    return TaskResult(
        id_slot=slot_id,
        finish=reason,
        text="".join(run.out_text),
        tokens=list(run.generated),
        n_prompt=run.n_prompt,
        timings=timings,
        stop_word=stop_word,
        error=error,
        t_queue_ms=(run.t_start - run.task.t_enqueued) * 1e3,
        logprobs=run.logprobs,
        truncated=run.truncated,
    )


def _deliver_all(items: list) -> None:
    for deliver, ev in items:
        deliver(ev)


@dataclass
class _Op:
    fn: Callable[[Engine], Any]
    slot: int
    future: Future


def _lagging(s: Slot) -> bool:
    task = s.task
    return (
        s.state is SlotState.GENERATE
        and task is not None
        and task.lagging is not None
        and task.lagging()
    )
