"""The runner: the one caller of llama.cpp's memory operations and of ``llama_decode``.

A step's decisions touch nothing. Admission (``Placer.place``), prefix sharing's waiters
(``PrefixSharing.resolve_waiters``) and embeddings (``EmbedQueue.step``) are generators that
yield typed operations (engine/step_plan.py: save an idle slot, restore, cut, resume at a checkpoint, park chunks,
copy a prefix, cache or evict idle slots, clear, decode embeddings); ``drive`` runs each and
sends its outcome back as the value of the ``yield``, so the next decision reads it (no
callbacks). The batch itself (``StepPlan``: shifts, checkpoints, drafts, moved chunks, the
decode) runs through ``execute`` (engine/executor.py does it for the runner); so do the
draft catch-up of ended runs, the scratch sequence's release and the engine's commands.
``tests/unit/test_one_phase.py`` holds every memory call to this module.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

from ..kv.checkpoints import restored_serves
from ..kv.store import SlotStore
from ..slot.slot import Slot
from ..slot.stats import EngineStats
from ..speculative.spec_step import Speculation
from ..tiers.disk import DiskTier
from ..tiers.prompt_cache import PromptCache
from ..tiers.saved import Extras, SavedState
from . import disk_glue, ram
from .cache_reuse import CacheReuse
from .executor import Executor
from .step_plan import (
    CacheIdle,
    Clear,
    CopyPrefix,
    Cut,
    EmbedDecode,
    EvictIdle,
    MemoryOp,
    Ops,
    ParkChunks,
    Restore,
    ResumeAt,
    SaveIdle,
    SaveRun,
    StepOutputs,
    StepPlan,
)

log = logging.getLogger("server.engine.runner")
R = TypeVar("R")
H = TypeVar("H")  # what a command runs against (the engine)


class Runner:
    def __init__(
        self,
        store: SlotStore,
        spec: Speculation,
        stats: EngineStats,
        executor: Executor,
        reuse: CacheReuse,
        cache: PromptCache | None,
        disk: DiskTier | None,
    ) -> None:
        self.store = store
        self.b = store.b
        self.spec = spec
        self.stats = stats
        self.executor = executor
        self.reuse = reuse
        self.cache = cache
        self.disk = disk

    def drive(self, decisions: Ops[R]) -> R:
        """Run every operation ``decisions`` yields, sending back its outcome (an operation
        that raises is thrown back in, where the decision handles it); its return value."""
        try:
            op = next(decisions)
            while True:
                try:
                    outcome = self.run(op)
                except Exception as e:
                    op = decisions.throw(e)
                    continue
                op = decisions.send(outcome)
        except StopIteration as stop:
            return stop.value

    def run(self, op: MemoryOp) -> int:
        """Carry out one operation; its outcome (see each type in engine/step_plan.py)."""
        store = self.store
        if isinstance(op, Cut):
            return store.cut(op.slot, op.n)
        if isinstance(op, CopyPrefix):
            got = store.copy_prefix(op.src, op.dst, op.n)
            self.stats.prefix_shared_tokens += got
            log.debug("slot %d: shared %d of %d from slot %d", op.dst.id, got, op.n, op.src.id)
            return got
        if isinstance(op, Restore):
            loaded = self._restore(op)
            assert self.cache is not None  # a Restore is planned only with a RAM cache
            self.cache.update()  # the RAM cache back within its limits
            return loaded
        if isinstance(op, ResumeAt):
            c = op.slot.checkpoints[op.index]
            n_past = store.resume_at_checkpoint(op.slot, op.index)
            if n_past > 0:
                self.stats.checkpoints_restored += 1
                self.spec.resumed(op.slot, c)
            return n_past
        if isinstance(op, ParkChunks):
            return self.reuse.park(op.slot, op.chunks, op.n_past)
        if isinstance(op, CacheIdle):
            assert self.cache is not None
            ram.cache_idle_slots(store, self.cache, self.b.kv_unified)
            return 0
        if isinstance(op, EvictIdle):
            ram.evict_idle(store, self.cache, op.slot)
            return 0
        if isinstance(op, SaveIdle):
            return self.cache is not None and ram.save(store, self.cache, op.slot)
        if isinstance(op, SaveRun):
            return self.cache is not None and ram.save_run(store, self.cache, op.slot)
        if isinstance(op, Clear):
            return store.clear(op.slot)
        if isinstance(op, EmbedDecode):
            return self._embed_decode()
        raise TypeError(f"not a memory operation: {op!r}")

    def _restore(self, op: Restore) -> bool:
        """The best entry of the RAM cache and the disk tier under it: the disk's when it
        shares more of the prompt (RAM's weaker hit, e.g. another conversation holding only
        the system prompt, must not hide a conversation's own state on disk), else RAM's.
        The disk is not looked at when RAM's entry holds the whole prompt but its last
        token."""
        assert self.cache is not None
        s, prompt, tenant = op.slot, op.prompt, op.tenant
        assert op.match is not None  # planned with a RAM cache: its index was walked
        choice = ram.find(self.cache, op.match, op.held)
        if choice is not None and not self._serves(self.cache.entries[choice.index], choice.n_lcp):
            choice = None
        if self.disk is not None and (choice is None or choice.n_lcp < len(prompt) - 1):
            hit = self.disk.find(prompt, tenant, op.held, op.match)
            if hit is not None and not self._serves(hit.pending or hit.entry, hit.n_lcp):
                hit = None
            if hit is not None and (choice is None or hit.n_lcp > choice.n_lcp):
                return disk_glue.load_hit(self.store, self.disk, s, hit, tenant)
        return choice is not None and ram.take(self.store, self.cache, s, choice)

    def _serves(self, state: SavedState | None, n_lcp: int) -> bool:
        """Whether ``state`` restored serves ``n_lcp`` of the prompt (``restored_serves``;
        a file's checkpoints are not known before it is read: taken as serving)."""
        assert state is not None
        known = state.extras is Extras.GIVEN
        ckpts = state.checkpoints if known else None
        return restored_serves(len(state.tokens), n_lcp, ckpts, self.b.n_swa, self.b.is_recurrent)

    def _embed_decode(self) -> int:
        """Decode the batch for embeddings; once more after freeing idle KV on no room."""
        n = self.b.batch.n
        for attempt in range(2):
            try:
                ret = self.b.decode(0, n)
            except Exception:
                log.exception("llama_decode raised (embeddings)")
                ret = -100
            if ret != 1 or attempt == 1 or not self.executor.free_idle_kv():
                return ret
        return ret

    # ---- the batch and the step's edges ---------------------------------------------

    def execute(self, plan: StepPlan) -> StepOutputs:
        """The step's batch: its memory operations, the decode, commits and samples."""
        return self.executor.execute(plan)

    def settle_ended(self, ended: list[Slot]) -> None:
        """Catch up the draft of the runs that ended (``ended``, emptied), so that the
        idle slots' snapshots carry the draft's state too: before admission saves them."""
        for s in ended:
            if s.idle and s.run is not None:
                self.spec.sync(s)
        ended.clear()

    def reap_reuse(self) -> None:
        """Empty --cache-reuse's scratch sequence when its run no longer needs it."""
        self.reuse.reap()

    def command(self, fn: Callable[[H], R], host: H) -> R:
        """An engine command (engine/commands.py: save, restore, erase, spill...)."""
        return fn(host)
