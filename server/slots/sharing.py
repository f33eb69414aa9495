"""Cross-request prefix sharing in unified KV mode (llama_memory_seq_cp shares cells).

Two sources of cached tokens beyond a slot's own KV and the RAM cache:
- *held*: the longest prefix of a new prompt that another sequence already holds (idle slots,
  and busy slots up to the tokens they have decoded) is copied into the chosen slot;
- *in flight*: when another slot is still prefilling a prompt with a long common prefix, the
  new task's slot waits (is not decoded) until that slot has passed the common length, then
  copies it. The computing slot ends a prefill chunk exactly there, so its sliding window at
  the cut is still in memory when the waiters copy.

Waiting never deadlocks: a slot only waits on a slot that is prefilling (never on a waiting
one), prefilling slots are scheduled oldest first, and a waiter whose source stopped (done,
cancelled, failed) takes what it can and computes the rest itself.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

from ..types import lcp
from .slot import Slot, SlotState
from .stats import EngineStats
from .store import SlotStore

log = logging.getLogger("server.slots.sharing")


class Source(NamedTuple):
    slot: int
    n_tokens: int  # length of the shareable prefix


class PrefixSharing:
    def __init__(self, store: SlotStore, stats: EngineStats, enabled: bool, min_wait: int) -> None:
        self.store = store
        self.stats = stats
        self.enabled = enabled
        self.min_wait = min_wait  # least gain worth waiting for (--prefix-share-min)

    def held_source(
        self, dst: Slot, prompt: list[int], n_past: int, tenant: str = ""
    ) -> Source | None:
        """The sequence of ``tenant`` holding the longest prefix of ``prompt`` beyond
        ``n_past`` tokens."""
        if not self.enabled:
            return None
        cap = len(prompt) - 1  # the last prompt token is always evaluated by its own slot
        best: Source | None = None
        for s in self.store.slots:
            if s is dst or not s.tokens or s.state is SlotState.WAIT or s.pending:
                continue
            if s.tenant != tenant:
                continue
            m = min(lcp(s.tokens, prompt), cap)
            if m <= (best.n_tokens if best else n_past):
                continue
            # the source's window behind the cut must still be in memory (DESIGN §4)
            if not self.store.serves_cut(s, m):
                continue
            best = Source(s.id, m)
        return best

    def inflight_source(
        self, dst: Slot, prompt: list[int], n_past: int, tenant: str = ""
    ) -> Source | None:
        """A prefilling slot of ``tenant`` whose prompt shares at least ``min_wait`` more
        tokens than ``n_past`` with ``prompt``, which it has not decoded yet."""
        if not self.enabled or self.min_wait <= 0:
            return None
        cap = len(prompt) - 1
        best: Source | None = None
        for s in self.store.slots:
            if s is dst or s.state is not SlotState.PREFILL or s.task is None:
                continue
            if s.task.tenant != tenant:
                continue
            c = min(lcp(s.task.prompt, prompt), cap)
            if c - n_past < self.min_wait or c <= len(s.tokens):
                continue
            if best is None or c > best.n_tokens:
                best = Source(s.id, c)
        return best

    def copy(self, src: Slot, dst: Slot, n: int) -> int:
        """Make ``dst`` hold ``src``'s first ``n`` tokens; returns what it holds."""
        got = self.store.copy_prefix(src, dst, n)
        self.stats.prefix_shared_tokens += got
        log.debug("slot %d: shared %d of %d tokens from slot %d", dst.id, got, n, src.id)
        return got

    def wait_on(self, dst: Slot, src: Source) -> None:
        s = self.store.slots[src.slot]
        dst.state = SlotState.WAIT
        run = dst.run
        run.wait_src, run.wait_task, run.wait_target = src.slot, s.task.id, src.n_tokens
        s.run.share_marks.add(src.n_tokens)  # the source ends a chunk there
        log.debug("slot %d: waits for slot %d to reach %d tokens", dst.id, src.slot, src.n_tokens)

    def resolve_waiters(self) -> None:
        """Waiters whose source reached the target (or stopped) copy and start prefilling."""
        for w in self.store.slots:
            if w.state is not SlotState.WAIT:
                continue
            run = w.run
            src = self.store.slots[run.wait_src]
            computing = (
                src.task is not None
                and src.task.id == run.wait_task
                and src.state is SlotState.PREFILL
            )
            if computing and len(src.tokens) < run.wait_target:
                continue
            task = w.task
            w.state = SlotState.PREFILL
            held = self.held_source(w, task.prompt, len(w.tokens), task.tenant)
            if held is not None:
                self.copy(self.store.slots[held.slot], w, held.n_tokens)
            run.n_cached = len(w.tokens)  # what this task will not compute itself
            if not computing:
                # the source went away: wait on another computing slot, or take over
                again = self.inflight_source(w, task.prompt, len(w.tokens), task.tenant)
                if again is not None:
                    self.wait_on(w, again)
