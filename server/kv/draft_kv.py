"""The draft model's sequences: what each holds, kept by the proposer, not by the slot store.

Invariant (checked by ``problems``): the draft context's sequence ``i`` holds exactly
``held[i]`` at positions 0..len-1. The slots' tokens are not mirrored: when the draft is
needed (drafting, a checkpoint, a snapshot of its state) ``reconcile`` cuts it to the
prefix it shares with its slot, and the drafter decodes the rest. KV content depends only on
the tokens and their positions, so a shared prefix is valid whatever happened to the slot
in between (cuts, restores, copies). A draft operation that fails empties the draft
sequence and never touches the target: the draft only costs time when it is behind.

Sliding windows: drafting decodes up to k tokens past the slot's end and then removes them,
and llama.cpp may reuse window cells masked for those positions meanwhile; the draft's
window can so lose up to k of its oldest cells. That only makes its drafts slightly worse
(the target verifies everything), so the draft's window is checked ``slack`` tokens short.
"""

from __future__ import annotations

import logging
from typing import Protocol

from ..slot.backend_api import Batch, SeqMemory
from ..slot.slot import Slot
from ..types import Checkpoint, lcp
from .audit import kv_problems, kv_type_problem, seq_state_problem
from .policy import window_intact

log = logging.getLogger("server.kv.draft_kv")


class DraftMemory(SeqMemory, Protocol):
    """What the draft context offers (server.llama.draft.DraftContext)."""

    n_swa: int
    n_batch: int

    @property
    def batch(self) -> Batch: ...

    def decode(self) -> int: ...
    def greedy(self, idx: int, want_p: bool) -> tuple[int, float]: ...


class DraftKV:
    def __init__(self, dft: DraftMemory, slack: int, n_seq: int) -> None:
        self.d = dft
        # the window checked: a draft ahead by ``slack`` tokens may have lost that many
        self.n_swa = max(1, dft.n_swa - slack) if dft.n_swa > 0 else 0
        self.held: list[list[int]] = [[] for _ in range(n_seq)]

    def n_held(self, slot: Slot) -> int:
        return len(self.held[slot.id])

    def shared(self, slot: Slot) -> int:
        """How many of the slot's tokens the draft sequence holds (a draft not reconciled
        yet may hold others beyond them)."""
        return lcp(self.held[slot.id], slot.tokens)

    # ---- meeting the slot ----------------------------------------------------------------

    def reconcile(self, slot: Slot) -> int:
        """Cut the draft to the prefix it shares with the slot's tokens; returns its length
        (0 when a cut behind the draft's window emptied it: it recomputes)."""
        held = self.held[slot.id]
        if not held:
            return 0
        n = lcp(held, slot.tokens)
        if n < len(held):
            self._cut(slot.id, n)
        return len(self.held[slot.id])

    def caught_up(self, slot: Slot, toks: list[int]) -> None:
        """The draft decoded ``toks`` after what it holds."""
        self.held[slot.id].extend(toks)

    def _cut(self, seq: int, n: int) -> None:
        ok = n > 0 and self.d.seq_rm(seq, n, -1) and self.d.seq_pos_max(seq) == n - 1
        if ok and window_intact(self.d.seq_pos_min(seq), n, self.n_swa):
            del self.held[seq][n:]
        else:
            self.clear(seq)

    def clear(self, seq: int) -> None:
        self.d.seq_clear(seq)
        self.held[seq] = []

    def shift(self, slot: Slot, n_keep: int, n_discard: int) -> None:
        """The target is about to shift its context (SlotStore.shift): the draft shifts
        the same way when it holds moved tokens and its memory can shift, else keeps at
        most its first ``n_keep`` tokens (it catches up when it next drafts)."""
        n, end = self.reconcile(slot), n_keep + n_discard
        if n <= end or not self.d.can_shift:
            self._cut(slot.id, min(n, n_keep))
            return
        if self.d.seq_rm(slot.id, n_keep, end):
            self.d.seq_add(slot.id, end, n, -n_discard)
            if self.d.seq_pos_max(slot.id) == n - n_discard - 1:
                del self.held[slot.id][n_keep:end]
                return
        self.clear(slot.id)

    # ---- checkpoints -------------------------------------------------------------------

    def checkpoint_data(self, slot: Slot) -> bytes:
        """The draft's partial state for a checkpoint at the slot's length; empty when
        the draft lags (a resume there then recomputes the draft)."""
        n = self.reconcile(slot)
        if n != len(slot.tokens) or n == 0:
            return b""
        return bytes(self.d.state_get(slot.id, partial=True))

    def resume(self, slot: Slot, c: Checkpoint) -> None:
        """The target resumed at checkpoint ``c`` (it holds c.n_tokens tokens): the draft
        follows with its own data when it holds that prefix, else is cut to it."""
        n = self.shared(slot)
        if c.data_dft and n >= c.n_tokens:
            if self.d.state_set(slot.id, bytearray(c.data_dft), partial=True) > 0:
                self._cut(slot.id, c.n_tokens)
                return
            log.warning("slot %d: draft checkpoint restore failed", slot.id)
        self.reconcile(slot)

    # ---- whole states (RAM cache, slot files) --------------------------------------------

    def state_size(self, slot: Slot) -> int:
        """The size of ``state(slot)``, 0 when the draft does not hold the slot's tokens
        (reconciled first)."""
        n = self.reconcile(slot)
        return self.d.state_size(slot.id) if n == len(slot.tokens) and n > 0 else 0

    def state(self, slot: Slot) -> bytes:
        """The draft sequence's whole state; empty unless it holds all the slot's tokens."""
        n = self.reconcile(slot)
        if n != len(slot.tokens) or n == 0:
            return b""
        return bytes(self.d.state_get(slot.id))

    def restore(self, slot: Slot, data: bytes | bytearray) -> bool:
        """Load a draft state for the slot's (restored) tokens; it must hold exactly them,
        proven cell by cell first (it may come from a file). False leaves the draft empty."""
        self.clear(slot.id)
        n = len(slot.tokens)
        if not data or n == 0:
            return False
        problem = self._state_problem(slot, data, n)
        if problem:
            log.warning("slot %d: draft state dropped: %s", slot.id, problem)
            return False
        if self.d.state_set(slot.id, bytearray(data)) != len(data):
            log.warning("slot %d: the draft context refused the draft state: dropped", slot.id)
            self.clear(slot.id)
            return False
        self.held[slot.id] = list(slot.tokens)
        return True

    def _state_problem(self, slot: Slot, data: bytes | bytearray, n: int) -> str | None:
        try:
            read = self.d.state_cells(data, len(data))
        except ValueError as e:
            return f"unreadable ({e})"
        problem = None if read is None else seq_state_problem(read[0], n, self.n_swa)
        if problem is None and read is not None and read[1] != len(data):
            problem = "bytes after the state"
        if problem is None and read is not None:
            problem = kv_type_problem(read[0], self.d.kv_type_ids)
        return problem

    # ---- integrity -------------------------------------------------------------------

    def problems(self) -> list[str]:
        out = []
        for i, held in enumerate(self.held):
            pmax = self.d.seq_pos_max(i)
            if pmax != len(held) - 1:
                out.append(f"draft seq {i}: holds {len(held)} tokens but pos_max {pmax}")
        caches = self.d.kv_cells()
        if caches is not None:
            n: list[int | None] = [len(h) for h in self.held]
            out += [f"draft {p}" for p in kv_problems(caches, n)]
        return out
