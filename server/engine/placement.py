"""Admission's memory side: starting the tasks ``Scheduler.admit`` placed on slots.

``admit`` decides which idle slot each waiting task takes (ARCHITECTURE §5), touching nothing;
``Placer.place`` then materializes each placement in order: a slot about to lose most of
what it holds goes to the RAM cache first, the best cached state (one walk of the prompt
down the prefix index serves the RAM and the disk tier) is restored into it, the slot keeps
the reusable prefix of its KV (a cut, or a resume at a checkpoint), takes the longest prefix
another sequence holds (prefix sharing) or waits for one being computed, and the run starts.
A failure fails its task only. ``place`` changes no memory and writes no tier itself: it
yields the operations (engine/step_plan.py) that ``Runner.drive`` carries out, and reads
each outcome; it reads the RAM cache only for its prefix index.
"""

from __future__ import annotations

import logging

from ..kv import images
from ..kv.locator import Match
from ..kv.policy import CheckpointView, ReusePlan, SlotChoice, plan_reuse
from ..kv.store import SlotStore
from ..prefix.prefix_index import SlotBaseline
from ..prefix.reuse import ReuseChunk
from ..slot.backend_api import Backend
from ..slot.reasoning_budget import BudgetTracker
from ..slot.slot import Slot, SlotRun
from ..slot.stats import EngineStats
from ..speculative.spec_step import Speculation
from ..task import Task, TaskError
from ..tiers.prompt_cache import PromptCache
from .cache_reuse import CacheReuse
from .options import EngineOptions
from .preempt import Preemption
from .sampling_paths import cpu_reason
from .sharing import PrefixSharing
from .step_plan import (
    CacheIdle,
    CopyPrefix,
    Cut,
    Ops,
    ParkChunks,
    Placed,
    Placement,
    Restore,
    ResumeAt,
    SaveIdle,
)

log = logging.getLogger("server.engine.engine")


class Placer:
    def __init__(
        self,
        backend: Backend,
        store: SlotStore,
        sharing: PrefixSharing,
        spec: Speculation,
        stats: EngineStats,
        cache: PromptCache | None,
        opts: EngineOptions,
        reuse: CacheReuse | None = None,
        preemption: Preemption | None = None,
    ) -> None:
        """``reuse``: --cache-reuse (None: off); ``preemption``: the preempted runs that
        resume when their tasks are placed again (engine/preempt.py)."""
        self.b = backend
        self.store = store
        self.sharing = sharing
        self.spec = spec
        self.stats = stats
        self.cache = cache
        self.opts = opts
        self.reuse = reuse
        self.preemption = preemption

    def place(self, placements: list[Placement]) -> Ops[Placed]:
        """Start every placement in order; then, once per admission pass, the slots left
        idle go to the RAM cache (--cache-idle-slots). Returns the failures and the slots
        whose first progress event is due, for the engine to send."""
        out = Placed()
        for p in placements:
            yield from self._place(p, out)
        launched = len(out.failed) < len(placements)
        if launched and self.cache is not None and self.opts.cache_idle_slots:
            yield CacheIdle()
        return out

    def _place(self, p: Placement, out: Placed) -> Ops[None]:
        """Start ``p.task`` on ``p.slot`` after consulting the caches (a failure goes to
        ``out.failed`` and leaves the slot idle)."""
        slot, task = p.slot, p.task
        try:
            probe = self.preemption.resume_probe(task) if self.preemption else None
            if probe is not None:
                yield from self._resume(slot, task, probe, p.choice)
                return
            # one lookup over every holder serves the tier loads and prefix sharing
            index = self.cache.index if self.cache is not None else None
            match = self.sharing.locator.match(task.tenant, task.prompt, index)
            n_lcp = yield from self._restore_cached(slot, task, p.choice, match)
            yield from self._launch(slot, task, n_lcp, match)
            if task.return_progress:  # llama-server's first (0 %) progress event
                out.progress.append(slot)
        except Exception as e:
            log.exception("failed to start task %d", task.id)
            if slot.task is task:
                slot.release()
            out.failed.append((task, TaskError(500, f"failed to start the task: {e}")))

    def _restore_cached(
        self, slot: Slot, task: Task, choice: SlotChoice, match: Match
    ) -> Ops[int | None]:
        """Consult the RAM cache (and the disk tier under it) when the choice says so;
        returns what the slot holds of the prompt when still known (None: recompute it)."""
        n_lcp: int | None = choice.lcp
        if self.cache is None or not choice.update_cache:
            return n_lcp
        if choice.save_first:
            yield SaveIdle(slot)
        # one walk of the prompt down the prefix index serves both tiers (taken here: after
        # the save above, as the load rule expects)
        held = SlotBaseline(match.held[slot.id], len(slot.tokens))
        loaded = yield Restore(slot, task.prompt, task.tenant, match.tiers(), held)  # RAM, disk
        if loaded or (n_lcp is not None and n_lcp > len(slot.tokens)):
            n_lcp = None  # recomputed: a restore, or a failed one that emptied the slot
        return n_lcp

    def _resume(self, slot: Slot, task: Task, probe: list[int], choice: SlotChoice) -> Ops[None]:
        """A preempted run comes back on ``slot``: its state out of the RAM cache (or the
        disk tier, or what the slot still holds of it), cut to what is usable, then the run
        itself (``Preemption.reattach``). ``probe``: its state's tokens (and next token)."""
        assert self.preemption is not None  # only a preempted task has a probe
        if self.cache is not None:
            if choice.save_first:
                yield SaveIdle(slot)
            match = self.sharing.locator.match(task.tenant, probe, self.cache.index)
            held = SlotBaseline(match.held[slot.id], len(slot.tokens))
            yield Restore(slot, probe, task.tenant, match.tiers(), held)
        own = slot.tenant == task.tenant
        plan = plan_reuse(
            slot.tokens,
            probe,
            cache_prompt=True,
            pos_min=self.store.pos_min(slot),
            n_swa=self.b.n_swa,
            checkpoints=[
                CheckpointView(c.n_tokens, c.pos_min, c.pos_max) for c in slot.checkpoints
            ],
            n_lcp=None if own else 0,
            recurrent=self.b.is_recurrent,
        )
        if plan.checkpoint >= 0:
            n_past = yield ResumeAt(slot, plan.checkpoint)
        else:
            n_past = yield Cut(slot, plan.n_past)
        run = self.preemption.reattach(slot, task, n_past)
        log.debug(
            "slot %d: task %d resumed at %d of %d (%s)",
            slot.id,
            task.id,
            n_past,
            len(probe),
            "refill" if run.refill is not None else plan.reason,
        )

    def _launch(self, slot: Slot, task: Task, n_lcp: int | None, match: Match) -> Ops[None]:
        """Place ``task`` on ``slot``: keep the reusable prefix of its KV, drop the rest,
        take what another sequence holds, then start the run."""
        plan = self._reuse_plan(slot, task, n_lcp)
        n_past, chunks = yield from self._keep(slot, task, plan)
        wait = None
        if task.cache_prompt and not chunks:
            held = self.sharing.held_source(slot, task.prompt, n_past, task.tenant, match)
            if held is not None:
                n_past = yield CopyPrefix(self.store.slots[held.slot], slot, held.n_tokens)
            wait = self.sharing.inflight_source(slot, task.prompt, n_past, task.tenant, match)
        run = slot.start(task, n_past)
        if task.images:
            self.stats.image_tokens_cached += images.tokens_before(task.images, n_past)
        if chunks:  # the step moves them in, the gaps before them decoded as prompt chunks
            assert self.reuse is not None
            self.reuse.begin(slot, run, chunks)
        if wait is not None:
            self.sharing.wait_on(slot, wait)
        self._start_sampling(slot, run)
        t_wait = (run.t_start - task.t_enqueued) * 1e3
        self.stats.on_launch(t_wait)
        log.debug(
            "slot %d: task %d, prompt %d, reuse %d (%s), queued %.1f ms",
            slot.id,
            task.id,
            len(task.prompt),
            run.n_cached,
            plan.reason,
            t_wait,
        )

    def _keep(self, slot: Slot, task: Task, plan: ReusePlan) -> Ops[tuple[int, list[ReuseChunk]]]:
        """Carry out ``plan``: a cut (with --cache-reuse, the chunks found beyond it parked
        first), or a resume at a checkpoint. Returns the tokens kept and the parked chunks
        (the run takes them: ``CacheReuse.begin``)."""
        chunks: list[ReuseChunk] = []
        if self.reuse is not None and plan.checkpoint < 0 and not task.images:
            chunks = self.reuse.plan(slot, task, plan.n_past)
        if chunks:
            n_past = yield ParkChunks(slot, chunks, plan.n_past)
            return n_past, chunks if n_past == plan.n_past else []
        if plan.checkpoint >= 0:
            n_past = yield ResumeAt(slot, plan.checkpoint)
            return n_past, []
        n_past = yield Cut(slot, plan.n_past)
        return n_past, []

    def _reuse_plan(self, slot: Slot, task: Task, n_lcp: int | None) -> ReusePlan:
        return plan_reuse(
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

    def _start_sampling(self, slot: Slot, run: SlotRun) -> None:
        """The run's sampler, its constraint's matcher (else its reasoning budget), where it
        samples (-bs) and whether it speculates."""
        task = run.task
        # an image's placeholders are no token ids: the penalties see the text only
        history = [t for t in task.prompt if t >= 0] if task.images else task.prompt
        run.sampler = self.b.new_sampler(task.sampling, history)
        if task.sampling.constraint is not None:
            run.matcher = task.sampling.constraint.matcher()
        elif task.gen.reasoning_budget is not None:  # a constrained run's tokens are its grammar's
            piece = self.b.token_to_piece
            run.budget = BudgetTracker(task.gen.reasoning_budget, lambda t: piece(t, True))
        if self.b.backend_sampling:
            reason = cpu_reason(task)
            run.backend_sampled = not reason and self.b.attach_sampler(run.sampler, slot.id)
            self.stats.on_sampler_placed(reason or ("" if run.backend_sampled else "refused"))
        self.spec.plan(run)
        if task.images:
            run.spec = None  # drafts over placeholders mean nothing (images: no speculation)
