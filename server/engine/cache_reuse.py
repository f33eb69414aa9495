"""--cache-reuse N (per request ``n_cache_reuse``): move cached chunks into place.

When a slot's tokens and a new prompt share a prefix and then differ, ``iter_chunks``
(prefix/reuse.py) finds the chunks of >= N cached tokens that appear later in the prompt, in
order, and ``select_chunks`` keeps those worth moving (at most ``MOST_CHUNKS``; one after a
gap only when it holds at least ``GAPPED_MIN`` tokens). Then:

1. ``park`` (placement, before the run starts): copies the chunks' cells to a scratch
   sequence (one sequence more than the slots, allocated with --cache-reuse under unified
   KV), cuts the slot to the common prefix and moves the parked cells to their prompt
   positions (seq_add; needs a memory that can shift: full attention, or --swa-full);
   ``begin`` hands the chunks to the run (``SlotRun.reuse``). No decode happens here: a
   placement costs one scan of the two token lists and a few memory operations per chunk.
2. The step's phases do the rest, in the normal batch budget: ``schedule`` ends the slot's
   prompt chunks at the next parked chunk (the gap before it is decoded as ordinary prompt
   tokens, batched with the other slots' tokens), and once the slot holds the tokens up to
   it, plans the move (``SlotWork.reuse``); ``execute`` carries it out (``place_due``:
   llama.cpp requires a sequence's positions to stay consecutive, so a chunk joins the
   slot only when the gap before it is in). Each chunk after a gap so costs its slot one
   step more; other slots keep streaming meanwhile.

The scratch sequence serves one run at a time (``owner``): a placement while it is busy
reuses only the common prefix. It is emptied when the last chunk moved in, when a move
failed, and at the next step after the run ended (done, cancelled by a client that left,
failed): ``reap``. The rest of the prompt, and always its last token, are computed as
usual. Rules kept simple:
- with a sliding-window cache (--swa-full), one run of adjacent chunks only (the first
  one kept, after a gap or not, and those right after it): a chunk parked further than a
  window before the scratch sequence's end could lose the cells its next token attends to;
- a chunk holding a cell another slot shares (prefix sharing under unified KV) is not
  reused: moving it would move the other slot's positions too;
- checkpoints beyond the common prefix go (``SlotStore.cut``); models that can shift
  take no checkpoints anyway.
As in llama-server, reused KV was computed under the old context: the answer is close to,
not the same as, a cold run's.
"""

from __future__ import annotations

import collections
import logging

from ..kv.store import SlotStore
from ..prefix.reuse import ReuseChunk, iter_chunks, select_chunks
from ..slot.backend_api import Backend
from ..slot.slot import Slot, SlotRun, SlotState
from ..slot.stats import EngineStats
from ..task import Task
from .options import EngineOptions

log = logging.getLogger("server.engine.engine")


# A chunk after a gap costs its slot one step more (the gap is decoded first); it is moved
# only when it saves at least this many tokens of prompt processing. A step of one token
# costs about 15 prompt tokens' time on a 2-core CPU (ARCHITECTURE §10: 24 ms vs 1.7 ms), more
# on a GPU: 32 keeps the 1-token chunks of an adversarial prompt (every other token
# substituted) from turning one prompt into a thousand steps.
GAPPED_MIN = 32
# Chunks moved per placement at most: each is two memory operations over the KV cells at
# placement and two more when it moves in, and each one after a gap adds a step.
MOST_CHUNKS = 16


class CacheReuse:
    def __init__(
        self, backend: Backend, store: SlotStore, stats: EngineStats, opts: EngineOptions
    ) -> None:
        self.b = backend
        self.store = store
        self.stats = stats
        self.opts = opts
        self.scratch = backend.scratch_seq
        # a sliding-window cache (--swa-full): parked cells more than a window below the
        # scratch sequence's last position count as masked there, and llama.cpp may give
        # them to any new token (find_slot). One run of adjacent chunks keeps every cell a
        # later token attends to within the window of the scratch's end.
        self.windowed = "swa" in (backend.kv_kinds or ())
        # the slot and run whose chunks the scratch sequence holds (None: it is empty)
        self.owner: tuple[Slot, SlotRun] | None = None
        self._parked = False  # the scratch may hold cells (parked, not handed to a run yet)

    @property
    def available(self) -> bool:
        """The memory can move positions and the scratch sequence exists."""
        return bool(self.b.can_shift) and self.scratch >= 0 and not self.b.is_recurrent

    def n_min(self, task: Task) -> int:
        """The task's least chunk (its ``n_cache_reuse``, else --cache-reuse; 0: off)."""
        n = task.gen.n_cache_reuse
        return self.opts.cache_reuse if n < 0 else n

    def plan(self, slot: Slot, task: Task, n_past: int) -> list[ReuseChunk]:
        """The chunks to move for ``task`` on ``slot`` after a cut at ``n_past`` (see
        ``select_chunks``); none when off, unavailable, while another run holds the scratch
        sequence, or when the slot holds another tenant's (or adapter set's) tokens."""
        n_min = self.n_min(task)
        if n_min <= 0 or not task.cache_prompt or slot.tenant != task.tenant:
            return []
        if not self.available or self.owner is not None or len(slot.tokens) <= n_past + n_min:
            return []
        prompt = task.prompt[:-1]  # the last prompt token is always computed
        shared = self.store.shared_until(slot)
        found = iter_chunks(slot.tokens, prompt, n_min, start=n_past)
        mine = (c for c in found if c.cache_start >= shared)
        return select_chunks(mine, n_past, GAPPED_MIN, MOST_CHUNKS, one_run=self.windowed)

    def park(self, slot: Slot, chunks: list[ReuseChunk], n_past: int) -> int:
        """Step 1 (before the run starts): returns the tokens the slot kept (``n_past``, or 0
        when the cut failed: then nothing is reused and the scratch is empty)."""
        self._parked = True
        kept = self.store.park_chunks(slot, chunks, self.scratch, n_past)
        if kept != n_past:
            self._release()
        return kept

    def begin(self, slot: Slot, run: SlotRun, chunks: list[ReuseChunk]) -> None:
        """The run (started at the common prefix) takes the parked chunks: the step's
        phases move them in (``SlotRun.reuse``, ``place_due``)."""
        run.reuse = collections.deque(chunks)
        self.owner = (slot, run)

    def place_due(self, slot: Slot, n: int) -> bool:
        """``execute``: move the run's next ``n`` parked chunks into the slot, which holds
        the prompt up to the first of them (the scheduler planned it so), counting them in
        the run's ``n_cached`` and the stats. False when a move failed: the slot is then
        unchanged from there and every chunk left is dropped (the prompt computed)."""
        run = slot.live
        if self.owner is None or self.owner[1] is not run:
            run.reuse.clear()
            return n == 0
        prompt = run.task.prompt
        for _ in range(n):
            ch = run.reuse[0]
            toks = prompt[ch.prompt_start : ch.prompt_start + ch.length]
            if not self.store.place_chunk(slot, ch, toks, self.scratch):
                self._release()
                return False
            run.reuse.popleft()
            run.seq.reused(ch.length, 1)
            self.stats.cache_reuse_tokens += ch.length
            self.stats.cache_reuse_chunks += 1
        if not run.reuse:
            log.debug(
                "slot %d: cache reuse: %d tokens in %d chunks",
                slot.id,
                run.seq.n_reused,
                run.seq.n_reuse_chunks,
            )
            self._release()
        return True

    def reap(self) -> None:
        """Once per step: empty the scratch sequence when its run no longer prefills (it
        ended, was cancelled or failed) or was never handed the chunks (a failed start)."""
        if self.owner is None:
            if self._parked:
                self._release()
            return
        slot, run = self.owner
        if slot.run is not run or slot.state is not SlotState.PREFILL or not run.reuse:
            self._release()

    def _release(self) -> None:
        if self.owner is not None:
            self.owner[1].reuse.clear()
        self.owner = None
        self._parked = False
        self.b.seq_clear(self.scratch)

    def held(self) -> dict[int, list[int]]:
        """What the scratch sequence should hold: {its id: the parked chunks' positions}
        (empty positions when no run holds it); {} without one. For the integrity check."""
        if self.scratch < 0:
            return {}
        pos: list[int] = []
        if self.owner is not None:
            for ch in self.owner[1].reuse:
                pos.extend(range(ch.prompt_start, ch.prompt_start + ch.length))
        return {self.scratch: pos}


__all__ = ["CacheReuse", "GAPPED_MIN", "MOST_CHUNKS"]
