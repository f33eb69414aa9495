"""--cache-reuse N (per request ``n_cache_reuse``): move cached chunks into place.

When a slot's tokens and a new prompt share a prefix and then differ, ``match_chunks``
(slots/reuse.py) finds the chunks of >= N cached tokens that appear later in the prompt, in
order. Placement then (``Placer._launch``):

1. ``park``: copies the chunks' cells to a scratch sequence (one sequence more than the
   slots, allocated with --cache-reuse under unified KV), cuts the slot to the common
   prefix and moves the parked cells to their prompt positions (seq_add; needs a memory
   that can shift: full attention, or --swa-full);
2. ``place`` (after the run started): decodes the prompt tokens before each chunk (the
   gaps: llama.cpp requires a sequence's positions to stay consecutive, so the chunk
   cannot sit in the slot's sequence while they are decoded), then moves the chunk from
   the scratch sequence into the slot. The scratch sequence is empty again afterwards.

The rest of the prompt is computed by the step as usual; its last token always is (its
logits are needed). Rules kept simple:
- a chunk holding a cell another slot shares (prefix sharing under unified KV) is not
  reused: moving it would move the other slot's positions too;
- the gaps are decoded synchronously, at most ``n_batch`` tokens in all (later chunks are
  dropped);
- checkpoints beyond the common prefix go (``SlotStore.cut``); models that can shift
  take no checkpoints anyway.
As in llama-server, reused KV was computed under the old context: the answer is close to,
not the same as, a cold run's.
"""

from __future__ import annotations

import logging

from ..types import Task, lcp
from .adapter_turns import adapters_of
from .backend_api import Backend
from .options import EngineOptions
from .reuse import ReuseChunk, match_chunks, within_gap_budget
from .slot import Slot
from .stats import EngineStats
from .store import SlotStore

log = logging.getLogger("server.slots.engine")


class CacheReuse:
    def __init__(
        self, backend: Backend, store: SlotStore, stats: EngineStats, opts: EngineOptions
    ) -> None:
        self.b = backend
        self.store = store
        self.stats = stats
        self.opts = opts
        self.scratch = backend.scratch_seq

    @property
    def available(self) -> bool:
        """The memory can move positions and the scratch sequence exists."""
        return bool(self.b.can_shift) and self.scratch >= 0 and not self.b.is_recurrent

    def n_min(self, task: Task) -> int:
        """The task's least chunk (its ``n_cache_reuse``, else --cache-reuse; 0: off)."""
        n = task.gen.n_cache_reuse
        return self.opts.cache_reuse if n < 0 else n

    def plan(self, slot: Slot, task: Task, n_past: int) -> list[ReuseChunk]:
        """The chunks to move for ``task`` on ``slot`` after a cut at ``n_past``; none when
        off, unavailable, or the slot holds another tenant's (or adapter set's) tokens."""
        n_min = self.n_min(task)
        if n_min <= 0 or not task.cache_prompt or slot.tenant != task.tenant:
            return []
        if not self.available or len(slot.tokens) <= n_past + n_min:
            return []
        prompt = task.prompt[:-1]  # the last prompt token is always computed
        chunks = match_chunks(slot.tokens, prompt, n_min, start=n_past)
        shared = self._shared_bound(slot)
        chunks = [c for c in chunks if c.cache_start >= shared]
        return within_gap_budget(chunks, n_past, self.b.n_batch)

    def _shared_bound(self, slot: Slot) -> int:
        """Cached positions below this may be cells another slot shares (unified KV)."""
        if not self.b.kv_unified:
            return 0
        others = (lcp(s.tokens, slot.tokens) for s in self.store.slots if s is not slot)
        return max(others, default=0)

    def park(self, slot: Slot, chunks: list[ReuseChunk], n_past: int) -> int:
        """Step 1 (before the run starts): returns the tokens the slot kept (``n_past``, or 0
        when the cut failed: then nothing is reused and the scratch is empty)."""
        kept = self.store.park_chunks(slot, chunks, self.scratch, n_past)
        if kept != n_past:
            self.b.seq_clear(self.scratch)
        return kept

    def place(self, slot: Slot, chunks: list[ReuseChunk]) -> None:
        """Step 2 (the run started at the common prefix): the gaps decoded, the chunks
        moved in, counted in the run's ``n_cached`` / ``n_computed`` and the stats. Stops
        at the first failure (the rest of the prompt is then computed as usual)."""
        run = slot.live
        prompt = run.task.prompt
        n_reused = n_chunks = n_gap = 0
        try:
            for ch in chunks:
                gap = prompt[len(slot.tokens) : ch.prompt_start]
                if gap and not self._decode(slot, gap):
                    break
                n_gap += len(gap)
                toks = prompt[ch.prompt_start : ch.prompt_start + ch.length]
                if not self.store.place_chunk(slot, ch, toks, self.scratch):
                    break
                n_reused += ch.length
                n_chunks += 1
        finally:
            self.b.seq_clear(self.scratch)
        run.seq.reused(n_reused, n_chunks, n_gap)
        self.stats.cache_reuse_tokens += n_reused
        self.stats.cache_reuse_chunks += n_chunks
        log.debug(
            "slot %d: cache reuse: %d tokens in %d chunks, %d gap tokens computed",
            slot.id,
            n_reused,
            n_chunks,
            n_gap,
        )

    def _decode(self, slot: Slot, toks: list[int]) -> bool:
        """Decode ``toks`` at the slot's next positions (no logits), under the run's
        adapters; False (the slot cut back to its committed tokens) when a decode failed."""
        self.b.set_adapters(adapters_of(slot))
        batch = self.b.batch
        for i in range(0, len(toks), self.b.n_batch):
            part = toks[i : i + self.b.n_batch]
            batch.clear()
            batch.add_span(part, len(slot.tokens), slot.id, False)
            if self.b.decode(0, batch.n) != 0:
                self.store.rollback(slot)
                return False
            self.store.commit(slot, part)
        return True


__all__ = ["CacheReuse"]
