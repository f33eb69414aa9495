"""The draft model's sequences, kept beside the target's by the slot store.

Invariant (checked by ``problems``): the draft context's sequence ``slot.id`` holds exactly
``slot.tokens[:slot.n_dft]`` at positions 0..n_dft-1. The draft may lag the target (it
catches up when the slot next drafts, ``server.slots.drafter``), never lead it: whatever
cuts, clears, copies or restores a slot's target sequence does the same here, through
``SlotStore``. A draft operation that fails empties the draft sequence (n_dft = 0) and
never touches the target: the draft only costs time when it is behind.

Sliding windows: drafting decodes up to k tokens past the slot's end and then removes them,
and llama.cpp may reuse window cells masked for those positions meanwhile; the draft's
window can so lose up to k of its oldest cells. That only makes its drafts slightly worse
(the target verifies everything), so the draft's window is checked ``slack`` tokens short.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

from ..types import Checkpoint
from .audit import kv_problems, kv_type_problem, seq_state_problem
from .backend_api import SeqMemory
from .policy import window_intact
from .slot import Slot

log = logging.getLogger("server.slots.draft_kv")


class DraftMemory(SeqMemory, Protocol):
    """What the draft context offers (server.llama.draft.DraftContext)."""

    n_swa: int
    batch: Any
    n_batch: int

    def decode(self) -> int: ...
    def greedy(self, idx: int, want_p: bool) -> tuple[int, float]: ...


class DraftKV:
    def __init__(self, dft: DraftMemory, slack: int) -> None:
        self.d = dft
        # the window checked: a draft ahead by ``slack`` tokens may have lost that many
        self.n_swa = max(1, dft.n_swa - slack) if dft.n_swa > 0 else 0

    # ---- following the target --------------------------------------------------------

    def cut(self, slot: Slot, n: int) -> None:
        """The target now holds ``n`` tokens: drop what the draft holds beyond them."""
        if slot.n_dft <= n:
            return
        ok = n > 0 and self.d.seq_rm(slot.id, n, -1) and self.d.seq_pos_max(slot.id) == n - 1
        if ok and window_intact(self.d.seq_pos_min(slot.id), n, self.n_swa):
            slot.n_dft = n
        else:
            self.clear(slot)  # a cut behind the draft's window: it recomputes when it drafts

    def clear(self, slot: Slot) -> None:
        self.d.seq_clear(slot.id)
        slot.n_dft = 0

    def shift(self, slot: Slot, n_keep: int, n_discard: int) -> None:
        """The target's context shifted (SlotStore.shift): the draft shifts the same way
        when it holds moved tokens and its memory can shift, else keeps at most its first
        ``n_keep`` tokens (it catches up when it next drafts)."""
        n, end = slot.n_dft, n_keep + n_discard
        if n <= end or not self.d.can_shift:
            self.cut(slot, min(n, n_keep))
            return
        if self.d.seq_rm(slot.id, n_keep, end):
            self.d.seq_add(slot.id, end, n, -n_discard)
            if self.d.seq_pos_max(slot.id) == n - n_discard - 1:
                slot.n_dft = n - n_discard
                return
        self.clear(slot)

    def copy(self, src: Slot, dst: Slot, n: int) -> None:
        """``dst``'s target just took ``src``'s first ``n`` tokens: take its draft's too."""
        self.clear(dst)
        m = min(n, src.n_dft)
        if m <= 0 or not window_intact(self.d.seq_pos_min(src.id), m, self.n_swa):
            return
        self.d.seq_cp(src.id, dst.id, 0, m)
        if self.d.seq_pos_max(dst.id) == m - 1:
            dst.n_dft = m
        else:
            self.clear(dst)

    # ---- checkpoints -------------------------------------------------------------------

    def checkpoint_data(self, slot: Slot) -> bytes:
        """The draft's partial state for a checkpoint at the target's length; empty when
        the draft lags (a resume there then recomputes the draft)."""
        if slot.n_dft != len(slot.tokens) or slot.n_dft == 0:
            return b""
        return bytes(self.d.state_get(slot.id, partial=True))

    def resume(self, slot: Slot, c: Checkpoint) -> None:
        """The target resumed at checkpoint ``c``: the draft follows with its own data."""
        if c.data_dft and slot.n_dft >= c.n_tokens:
            if self.d.state_set(slot.id, bytearray(c.data_dft), partial=True) > 0:
                self.cut(slot, c.n_tokens)
                return
            log.warning("slot %d: draft checkpoint restore failed", slot.id)
        self.cut(slot, c.n_tokens)

    # ---- whole states (RAM cache, slot files) --------------------------------------------

    def state(self, slot: Slot) -> bytes:
        """The draft sequence's whole state; empty unless it holds all the slot's tokens."""
        if slot.n_dft != len(slot.tokens) or slot.n_dft == 0:
            return b""
        return bytes(self.d.state_get(slot.id))

    def restore(self, slot: Slot, data: bytes | bytearray) -> bool:
        """Load a draft state for the slot's (restored) tokens; it must hold exactly them,
        proven cell by cell first (it may come from a file). False leaves the draft empty."""
        self.clear(slot)
        n = len(slot.tokens)
        if not data or n == 0:
            return False
        try:
            read = self.d.state_cells(data, len(data))
        except ValueError as e:
            log.warning("slot %d: unreadable draft state (%s): dropped", slot.id, e)
            return False
        problem = None if read is None else seq_state_problem(read[0], n, self.n_swa)
        if problem is None and read is not None and read[1] != len(data):
            problem = "bytes after the state"
        if problem is None and read is not None:
            problem = kv_type_problem(read[0], self.d.kv_type_ids)
        if problem:
            log.warning("slot %d: draft state dropped: %s", slot.id, problem)
            return False
        if self.d.state_set(slot.id, bytearray(data)) != len(data):
            log.warning("slot %d: the draft context refused the draft state: dropped", slot.id)
            self.clear(slot)
            return False
        slot.n_dft = n
        return True

    # ---- integrity -------------------------------------------------------------------

    def problems(self, slots: list[Slot]) -> list[str]:
        out = []
        for s in slots:
            if s.pending:
                continue
            pmax = self.d.seq_pos_max(s.id)
            if pmax != s.n_dft - 1 or s.n_dft > len(s.tokens):
                out.append(f"slot {s.id}: draft holds {s.n_dft} tokens but pos_max {pmax}")
        caches = self.d.kv_cells()
        if caches is not None:
            n = [None if s.pending else s.n_dft for s in slots]
            out += [f"draft {p}" for p in kv_problems(caches, n)]
        return out
