"""Cross-request prefix sharing in unified KV mode (llama_memory_seq_cp shares cells).

Two sources of cached tokens beyond a slot's own KV and the RAM cache:
- *held*: the longest prefix of a new prompt that another sequence already holds (idle slots,
  and busy slots up to the tokens they have decoded) is copied into the chosen slot;
- *in flight*: when another slot is still prefilling a prompt with a long common prefix, the
  new task's slot waits (is not decoded) until that slot has passed the common length, then
  copies it. The computing slot ends a prefill chunk exactly there, so its sliding window at
  the cut is still in memory when the waiters copy. A slot waits only while that is estimated
  to finish its prompt no later than computing it itself (kv/share_cost.py, from measured
  step times); it re-checks every step, and one that gives up copies what the source holds.

Both sources are read from the locator's match (kv/locator.py: one match over every
holder per admission, the prefix index's matching rule); nothing here computes a prefix.

Waiting never deadlocks: a slot only waits on a slot that is prefilling (never on a waiting
one), prefilling slots are scheduled oldest first, and a waiter whose source stopped (done,
cancelled, failed) takes what it can and computes the rest itself.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

from ..kv.locator import Locator, Match
from ..kv.share_cost import PrefillQueue, StepSpeed, queue_of, wait_pays
from ..kv.store import SlotStore
from ..slot.slot import ShareWait, Slot, SlotState
from ..slot.stats import EngineStats
from .step_plan import CopyPrefix, Ops

log = logging.getLogger("server.engine.sharing")


class Source(NamedTuple):
    slot: int
    n_tokens: int  # length of the shareable prefix


class PrefixSharing:
    def __init__(self, store: SlotStore, stats: EngineStats, enabled: bool, min_wait: int) -> None:
        self.store = store
        self.stats = stats
        self.enabled = enabled
        self.min_wait = min_wait  # least gain worth waiting for (--prefix-share-min)
        self.speed = StepSpeed()  # tests may inject their own
        self._seen = 0  # stats.n_batches last observed
        # the slots' prefixes (their block index); placement adds the tiers' index
        self.locator = Locator(store.slots, blocks=store.blocks)

    def held_source(
        self,
        dst: Slot,
        prompt: list[int],
        n_past: int,
        tenant: str = "",
        match: Match | None = None,
    ) -> Source | None:
        """The sequence of ``tenant`` holding the longest prefix of ``prompt`` beyond
        ``n_past`` tokens, as ``match`` (the locator's for this prompt, taken now when not
        given; ``dst``'s own entry is never read) reports it."""
        if not self.enabled:
            return None
        held = (match or self.locator.match(tenant, prompt)).held
        cap = len(prompt) - 1  # the last prompt token is always evaluated by its own slot
        best: Source | None = None
        for s in self.store.slots:
            if s is dst or not s.tokens or s.state is SlotState.WAIT:
                continue
            m = min(held[s.id], cap)
            if m <= (best.n_tokens if best else n_past):
                continue
            # the source's window behind the cut must still be in memory (ARCHITECTURE §4)
            if not self.store.serves_cut(s, m):
                continue
            best = Source(s.id, m)
        return best

    def inflight_source(
        self,
        dst: Slot,
        prompt: list[int],
        n_past: int,
        tenant: str = "",
        match: Match | None = None,
    ) -> Source | None:
        """A prefilling slot of ``tenant`` whose prompt shares at least ``min_wait`` more
        tokens than ``n_past`` with ``prompt``, which it has not decoded yet (read from
        ``match`` as ``held_source`` does)."""
        if not self.enabled or self.min_wait <= 0:
            return None
        inflight = (match or self.locator.match(tenant, prompt)).inflight
        cap = len(prompt) - 1
        best: Source | None = None
        for s in self.store.slots:
            if s is dst or s.state is not SlotState.PREFILL or s.task is None:
                continue
            c = min(inflight[s.id], cap)
            if c - n_past < self.min_wait or c <= len(s.tokens):
                continue
            if best is None or c > best.n_tokens:
                best = Source(s.id, c)
        return best

    def wait_on(self, dst: Slot, src: Source) -> bool:
        """Make ``dst`` (started, prefilling) wait for ``src`` unless computing its prompt
        itself is estimated to be faster; whether it waits."""
        s = self.store.slots[src.slot]
        sole = src.n_tokens not in s.live.share_marks
        if not wait_pays(self.speed, self._queue(), s, dst, src.n_tokens, sole):
            self.stats.prefix_waits_skipped += 1
            log.debug("slot %d: computes itself rather than wait for slot %d", dst.id, s.id)
            return False
        dst.state = SlotState.WAIT
        dst.live.wait = ShareWait(src.slot, s.live.task.id, src.n_tokens)
        s.live.share_marks.add(src.n_tokens)  # the source ends a chunk there
        log.debug("slot %d: waits for slot %d to reach %d tokens", dst.id, src.slot, src.n_tokens)
        return True

    def resolve_waiters(self) -> Ops[None]:
        """Called once per step before the batch is built. Waiters whose source reached the
        target (or stopped) copy and start prefilling; so do those for which waiting no longer
        pays. A pass over the slots, plus a sorted snapshot of the queue while any waits.
        The copies are yielded (``CopyPrefix``) for the runner to make."""
        self._observe_step()
        q = None
        for w in self.store.slots:
            if w.state is not SlotState.WAIT:
                continue
            wait = w.live.wait
            assert wait is not None  # a slot in WAIT has a run that waits for something
            src = self.store.slots[wait.src]
            computing = (
                src.task is not None and src.task.id == wait.task and src.state is SlotState.PREFILL
            )
            if computing and len(src.tokens) < wait.target:
                if q is None:
                    q = self._queue()
                sole = not self._mark_shared(src, w, wait)
                if wait_pays(self.speed, q, src, w, wait.target, sole):
                    continue
                self.stats.prefix_waits_abandoned += 1
                log.debug("slot %d: stops waiting for slot %d", w.id, src.id)
                if sole:
                    src.live.share_marks.discard(wait.target)
                q = None  # the queue changed: this slot computes more itself
            yield from self._start(w, again=not computing)

    def _start(self, w: Slot, again: bool) -> Ops[None]:
        """The waiter ``w`` takes what a held source gives and prefills the rest; with
        ``again`` (its source went away) it may wait on another computing slot instead."""
        task = w.live.task
        w.state = SlotState.PREFILL
        w.live.wait = None
        match = self.locator.match(task.tenant, task.prompt)  # one lookup serves both sources
        held = self.held_source(w, task.prompt, len(w.tokens), task.tenant, match)
        if held is not None:
            yield CopyPrefix(self.store.slots[held.slot], w, held.n_tokens)
        w.seq.n_cached = len(w.tokens)  # what this task will not compute itself
        if again:
            other = self.inflight_source(w, task.prompt, len(w.tokens), task.tenant, match)
            if other is not None:
                self.wait_on(w, other)

    def _mark_shared(self, src: Slot, w: Slot, wait: ShareWait) -> bool:
        """Whether another waiter needs ``src`` to end a chunk at ``w``'s target (``wait``)."""
        key = ShareWait(src.id, src.live.task.id, wait.target)
        waits = (o.live.wait for o in self.store.slots if o is not w and o.state is SlotState.WAIT)
        return key in waits

    def _queue(self) -> PrefillQueue:
        return queue_of(self.store.slots, self.store.b.n_batch, self.store.b.n_ubatch)

    def _observe_step(self) -> None:
        """Feed the last decoded batch to the speed estimate: its tokens and its time, as
        the step recorded them (stats.on_batch); only a batch not observed yet, and only
        when exactly one was decoded since the last call."""
        n = self.stats.n_batches
        if n == self._seen + 1:
            self.speed.observe(self.stats.last_batch_tokens, self.stats.last_batch_seconds)
        self._seen = n
