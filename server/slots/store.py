"""SlotStore: the one owner of the slots' tokens and of their sequences in the KV cache.

Invariant (checked by ``check_integrity``): a slot's ``tokens`` are exactly what the KV cache
holds for its sequence, at positions 0..len-1, and its checkpoints lie within those tokens.
Every change to a slot's tokens, checkpoints or KV goes through a method here: the
executor, the RAM-cache glue, prefix sharing and the slot commands call these methods and
never touch a sequence themselves. A draft model's sequences are not mirrored here: the
proposer reconciles them with their slots when it drafts (draft_kv.py); the store only
reads and writes their states where a snapshot, slot file or cache entry carries one (SDFT).
Engine thread only.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ..cache import slot_file
from ..types import Checkpoint, StateBuf, lcp
from .audit import kv_problems, kv_type_problem, seq_state_problem
from .backend_api import Backend
from .checkpoints import CheckpointPolicy
from .draft_kv import DraftKV, DraftMemory
from .policy import window_intact
from .reuse import ReuseChunk
from .slot import Slot

log = logging.getLogger("server.slots.store")


@dataclass
class FileAppendix:
    """What a slot file carries after its body: checkpoints (SCKP), draft state (SDFT)."""

    checkpoints: list[Checkpoint]
    draft: bytes = b""
    kv_types: tuple[int, int] | None = None  # SKVT: the KV cache's ggml types


@dataclass
class Snapshot:
    """What a RAM-cache entry needs from a slot: its tokens, its state's size (known before
    copying), a reader that copies the state bytes, and its checkpoints."""

    tokens: list[int]
    size: int  # target and draft states together
    read: Callable[[], StateBuf]
    checkpoints: list[Checkpoint]
    read_draft: Callable[[], bytes] | None = None


def shift_span(
    n_tokens: int, n_ctx: int, n_prompt: int, n_keep: int, n_discard: int, add_bos: bool
) -> tuple[int, int]:
    """llama-server's context shift (server-context.cpp, pre_decode): the tokens kept at the
    start, and how many after them are dropped. ``n_keep`` -1 keeps the whole prompt; a BOS
    adds one; at most n_ctx - 4 are kept; ``n_discard`` 0 drops half of the rest; at least one
    token after the kept ones always stays."""
    keep = n_prompt if n_keep < 0 else n_keep
    keep = min(n_ctx - 4, keep + (1 if add_bos else 0))
    n_left = n_tokens - keep
    discard = n_discard if n_discard else n_left // 2
    return keep, max(0, min(discard, max(0, n_left - 1)))


class SlotStore:
    def __init__(
        self,
        backend: Backend,
        ckpt: CheckpointPolicy,
        draft: DraftMemory | None = None,
        most_drafted: int = 0,
    ) -> None:
        self.b = backend
        self.ckpt = ckpt
        self.slots = [Slot(i, backend.n_ctx_slot) for i in range(backend.n_seq)]
        # a draft model's sequences, which follow the slots' (slots/draft_kv.py)
        self.dft = DraftKV(draft, most_drafted + 1, backend.n_seq) if draft is not None else None

    # ---- reading ------------------------------------------------------------------

    def pos_min(self, slot: Slot) -> int:
        """Lowest position the slot's sequence still holds (-1 when empty)."""
        return self.b.seq_pos_min(slot.id) if slot.tokens else -1

    def serves_cut(self, slot: Slot, n: int) -> bool:
        """Whether the sequence, cut to ``n`` tokens, still holds the window that the token at
        ``n`` attends to (always true without a sliding window)."""
        return window_intact(self.b.seq_pos_min(slot.id), n, self.b.n_swa)

    def draft_shared(self, slot: Slot) -> int:
        """How many of the slot's tokens its draft sequence holds (0 without a draft model;
        a draft not reconciled yet may hold others beyond them)."""
        return lcp(self.dft.held[slot.id], slot.tokens) if self.dft is not None else 0

    # ---- cutting and clearing -----------------------------------------------------

    def cut(self, slot: Slot, n_past: int) -> int:
        """Keep the first ``n_past`` tokens and drop the rest; returns what was kept.

        With SWA or recurrent memory a removal can fail or empty the sequence; then the slot
        is cleared and nothing is kept (never count tokens that are not in memory).
        Checkpoints past the kept tokens go too.
        """
        if n_past <= 0:
            self.clear(slot)
            return 0
        if n_past < len(slot.tokens):
            ok = self.b.seq_rm(slot.id, n_past, -1)
            if not ok or self.b.seq_pos_max(slot.id) != n_past - 1:
                log.debug("slot %d: partial removal at %d failed; clearing", slot.id, n_past)
                self.clear(slot)
                return 0
        slot.seq.truncate(n_past)
        slot.checkpoints = [c for c in slot.checkpoints if c.n_tokens <= n_past]
        return n_past

    def clear(self, slot: Slot) -> int:
        """Remove the whole sequence from the KV cache, whatever the slot believes it holds;
        returns how many tokens the slot held."""
        n = len(slot.tokens)
        self.b.seq_clear(slot.id)
        slot.tokens, slot.checkpoints = [], []
        return n

    def shift(self, slot: Slot, n_keep: int, n_discard: int) -> bool:
        """Context shift: drop the tokens [n_keep, n_keep + n_discard) and move those after
        them n_discard positions down, in the KV cache (seq_rm, seq_add) and in ``tokens``
        alike; the slot then holds n - n_discard tokens at 0..n-n_discard-1. Checkpoints go
        (the positions they hold no longer exist); the draft follows. Only for a memory that
        can shift (llama_memory_can_shift). False when nothing was shifted; the slot is
        cleared when llama.cpp did not end where the tokens say."""
        n, end = len(slot.tokens), n_keep + n_discard
        if n_discard <= 0 or n_keep < 0 or end > n:
            return False
        ok = self._own_cells_from(slot, end) and self.b.seq_rm(slot.id, n_keep, end)
        if ok:
            self.b.seq_add(slot.id, end, n, -n_discard)
        slot.seq.remove(n_keep, end)
        slot.checkpoints = []
        if not ok or self.b.seq_pos_max(slot.id) != len(slot.tokens) - 1:
            log.warning("slot %d: context shift failed; clearing", slot.id)
            self.clear(slot)
            return False
        return True

    def shared_until(self, slot: Slot) -> int:
        """In unified KV, the slot's cells that another sequence may share (seq_cp: prefix
        sharing) lie before this position: shared cells hold the same tokens in both, so
        none lies past the longest common prefix with another slot. seq_add moves a shared
        cell for every sequence holding it, so a shift must move none of these."""
        if not self.b.kv_unified:
            return 0
        return max((lcp(o.tokens, slot.tokens) for o in self.slots if o is not slot), default=0)

    def owned_discard(self, slot: Slot, n_keep: int, n_discard: int) -> int:
        """The n_discard a context shift of ``slot`` uses: ``n_discard``, or more when cells
        it shares lie past the cut: then the shift drops the shared span too and moves only
        cells the slot holds alone (no memory, no recompute; the other slot's positions stay
        where they are). Unchanged when the slot shares all it holds (``shift`` then takes
        a private copy)."""
        shared = self.shared_until(slot)
        if shared <= n_keep + n_discard or shared >= len(slot.tokens):
            return n_discard
        return shared - n_keep

    def _own_cells_from(self, slot: Slot, p0: int) -> bool:
        """Before seq_add moves the slot's cells from ``p0`` on, when cells it shares lie
        there (see ``shared_until``; ``owned_discard`` avoids this but where the slot shares
        everything): the slot takes a private copy of all its cells (its state saved, its
        sequence cleared, the state set back: new cells, its alone; needs room for them).
        False when that failed (the slot is then empty)."""
        if self.shared_until(slot) <= p0:
            return True
        data = self.b.state_get(slot.id)
        self.b.seq_clear(slot.id)
        return self.b.state_set(slot.id, data) == len(data)

    # ---- --cache-reuse (slots/cache_reuse.py) ------------------------------------

    def park_chunks(self, slot: Slot, chunks: list[ReuseChunk], scratch: int, n_past: int) -> int:
        """Keep the chunks' cells in the ``scratch`` sequence at their prompt positions and
        cut the slot to ``n_past`` (as ``cut``); returns what the slot kept. The scratch
        sequence then owns the chunks' cells alone (the caller never passes cells another
        slot shares), so moving them touches no slot: first all of them past every position
        either sequence uses, then each to its place (sources and targets never overlap)."""
        far = max(len(slot.tokens), chunks[-1].prompt_start + chunks[-1].length) + 1
        self.b.seq_clear(scratch)
        for ch in chunks:
            self.b.seq_cp(slot.id, scratch, ch.cache_start, ch.cache_start + ch.length)
        kept = self.cut(slot, n_past)
        self.b.seq_add(scratch, 0, -1, far)
        for ch in chunks:
            p0 = ch.cache_start + far
            self.b.seq_add(scratch, p0, p0 + ch.length, ch.delta - far)
        return kept

    def place_chunk(self, slot: Slot, ch: ReuseChunk, toks: list[int], scratch: int) -> bool:
        """Move a parked chunk (``toks``, the prompt's at ch.prompt_start, where the slot
        ends) from ``scratch`` into the slot; False (the slot unchanged) when llama.cpp did
        not end where the tokens say."""
        p0, p1 = ch.prompt_start, ch.prompt_start + ch.length
        if len(slot.tokens) != p0:
            return False
        self.b.seq_cp(scratch, slot.id, p0, p1)
        self.b.seq_rm(scratch, p0, p1)
        if self.b.seq_pos_max(slot.id) != p1 - 1:
            log.warning("slot %d: cache reuse of %d tokens at %d failed", slot.id, ch.length, p0)
            self.b.seq_rm(slot.id, p0, -1)
            return False
        slot.seq.extend(toks)
        return True

    # ---- checkpoints --------------------------------------------------------------

    def take_checkpoint(self, slot: Slot) -> Checkpoint:
        """Copy the partial (window / recurrent) state of the slot as it is now."""
        data = self.b.state_get(slot.id, partial=True)
        c = Checkpoint(
            len(slot.tokens), self.b.seq_pos_min(slot.id), self.b.seq_pos_max(slot.id), data
        )
        self.ckpt.insert(slot.checkpoints, c)
        return c

    def resume_at_checkpoint(self, slot: Slot, index: int) -> int:
        """Restore checkpoint ``index`` and cut the slot to it; returns the tokens kept (0 when
        the restore failed and the slot was cleared)."""
        c = slot.checkpoints[index]
        if self.b.state_set(slot.id, c.data, partial=True) == 0:
            log.warning("slot %d: checkpoint restore failed; reprocessing", slot.id)
            return self.cut(slot, 0)
        return self.cut(slot, c.n_tokens)

    # ---- decoding -----------------------------------------------------------------

    def commit(self, slot: Slot, toks: list[int]) -> None:
        """The batch holding ``toks`` at the slot's next positions was decoded: they are
        in the KV cache now."""
        slot.seq.extend(toks)

    def rollback(self, slot: Slot) -> None:
        """A failed decode may leave some ubatches of the slot's work in memory: cut back
        to the committed tokens."""
        self.b.seq_rm(slot.id, len(slot.tokens), -1)

    # ---- sharing, snapshots, restores ---------------------------------------------

    def copy_prefix(self, src: Slot, dst: Slot, n: int) -> int:
        """Make ``dst`` hold ``src``'s first ``n`` tokens (unified KV: cells are shared, not
        copied). Returns the tokens ``dst`` holds: ``n``, or 0 when the copy failed."""
        self.clear(dst)
        self.b.seq_cp(src.id, dst.id, 0, n)
        if self.b.seq_pos_max(dst.id) != n - 1:
            log.warning("slot %d: seq_cp from slot %d did not give %d tokens", dst.id, src.id, n)
            self.clear(dst)
            return 0
        dst.tokens = src.tokens[:n]
        # checkpoints are partial states of the same prefix: valid for the copy too
        dst.checkpoints = [c for c in src.checkpoints if c.n_tokens <= n]
        return n

    def snapshot(self, slot: Slot) -> Snapshot:
        """The slot's whole state for the RAM cache (the slot keeps it too). Every checkpoint
        goes along: a restored state holds only its last window (see checkpoints.py). The
        lists are the slot's own: the cache copies what it keeps."""
        size = self.b.state_size(slot.id)
        snap = Snapshot(
            slot.tokens, size, lambda: self.b.state_get(slot.id, size=size), slot.checkpoints
        )
        dft = self.dft
        n_dft = dft.state_size(slot) if dft is not None else 0
        if dft is not None and n_dft:
            snap.size += n_dft
            snap.read_draft = lambda: dft.state(slot)
        return snap

    def save_file(self, slot: Slot, path: str) -> FileAppendix | None:
        """llama.cpp writes the slot's state file body straight from the KV cache; returns
        what the appendices hold, or None when llama.cpp could not write."""
        if self.b.state_save_file(path, slot.id, slot.tokens) == 0:
            return None
        draft = self.dft.state(slot) if self.dft is not None else b""
        return FileAppendix(list(slot.checkpoints), draft, self.kv_types)

    @property
    def kv_types(self) -> tuple[int, int] | None:
        """The ggml types of the target's K and V cache (None: not known, a fake)."""
        return self.b.kv_type_ids

    def restore(
        self,
        slot: Slot,
        data: StateBuf,
        tokens: list[int],
        checkpoints: list[Checkpoint],
        *,
        nbytes: int | None = None,
        whole: bool = True,
        untrusted: bool = False,
        data_dft: bytes | bytearray = b"",
    ) -> int:
        """Load a sequence state into the slot with the tokens it describes.

        The state must prove it matches: it is consumed (whole, with ``whole``) and its
        positions run exactly 0..len(tokens)-1. An ``untrusted`` state (a slot file) must
        also describe, cell by cell, exactly those positions before it is loaded (see
        audit.py). Otherwise the slot is cleared and 0 returned. Returns the bytes consumed;
        the slot takes ``tokens`` and ``checkpoints`` as they are. ``data_dft``, the draft
        model's state of the same tokens, must load too (a RAM-cache entry's two states stand
        or fall together, DESIGN §7).
        """
        size = len(data) if nbytes is None else nbytes
        self.clear(slot)
        if untrusted and self._state_problem(data, size, len(tokens)):
            return 0
        consumed = self.b.state_set(slot.id, data, nbytes=nbytes)
        fits = consumed > 0 and (consumed == size or not whole)
        if not fits or not self._positions_match(slot, len(tokens)):
            self.clear(slot)
            return 0
        slot.tokens = tokens
        slot.checkpoints = [c for c in checkpoints if c.n_tokens <= len(tokens)]
        if data_dft and self.dft is not None and not self.dft.restore(slot, data_dft):
            self.clear(slot)
            return 0
        return consumed

    def restore_file(
        self,
        slot: Slot,
        buf: bytearray,
        state_off: int,
        end: int,
        tokens: list[int],
        *,
        exact: bool,
        appendices: slot_file.Appendices | None = None,
    ) -> slot_file.Appendices | None:
        """Restore a slot file's state (untrusted: its cells are proven first) with its
        checkpoints. The state starts at ``state_off`` of ``buf`` and ends at ``end`` when
        ``exact``; else where llama.cpp stops reading, with the appendices after it up to
        ``end`` (parsed here unless ``appendices`` already holds them: pass them, parsed off
        this thread, wherever the state's end is known). None when the state was refused;
        the slot is then empty."""
        consumed = self.load_file_state(slot, buf, state_off, end, tokens, exact=exact)
        if consumed == 0:
            return None
        if appendices is None:
            with memoryview(buf) as whole, whole[:end] as body:
                appendices = slot_file.parse_appendices(
                    body, state_off + consumed, len(tokens), self.ckpt.max_per_slot
                )
        return appendices if self.apply_appendices(slot, appendices) else None

    def load_file_state(
        self,
        slot: Slot,
        buf: bytearray,
        state_off: int,
        end: int,
        tokens: list[int],
        *,
        exact: bool,
    ) -> int:
        """The first half of ``restore_file``: load the state alone (proven first) and give
        the slot ``tokens`` without checkpoints. Returns the bytes consumed (its appendices
        start at ``state_off + consumed``); 0 when refused (the slot is then empty)."""
        size = end - state_off
        region = (ctypes.c_uint8 * size).from_buffer(buf, state_off)
        consumed = self.restore(slot, region, tokens, [], nbytes=size, whole=exact, untrusted=True)
        del region  # the mapping may be closed once this returns
        return consumed

    def apply_appendices(self, slot: Slot, appendices: slot_file.Appendices) -> bool:
        """The second half of ``restore_file``: a restored slot takes its file's checkpoints
        (at most the slot's limit) and draft state. False, with the slot cleared, when the
        file names KV cache types its state (proven ours) contradicts."""
        if slot_file.kv_types_problem(appendices, self.kv_types):
            self.clear(slot)  # its state proved of our types: the file contradicts itself
            return False
        self.set_checkpoints(slot, appendices.checkpoints)
        self._restore_draft(slot, appendices)
        return True

    def _restore_draft(self, slot: Slot, app: slot_file.Appendices) -> None:
        """A slot file's draft state (SDFT) and checkpoint draft data: kept when they fit
        this server's draft context, else dropped; the target state stays either way."""
        if self.dft is None:
            for c in slot.checkpoints:
                c.data_dft = b""
            if app.draft and app.draft[0]:
                app.warnings.append("the file's draft state was dropped: no draft model here")
            return
        if app.draft and app.draft[0] and not self.dft.restore(slot, app.draft[0]):
            app.warnings.append("the file's draft state does not fit the draft model; dropped")

    def _state_problem(self, data: StateBuf, size: int, n: int) -> str | None:
        """Why the state bytes cannot be ``n`` tokens' KV, read before loading them."""
        try:
            read = self.b.state_cells(data, size)
        except ValueError as e:
            problem: str | None = f"unreadable state ({e})"
        else:
            problem = None if read is None else seq_state_problem(read[0], n, self.b.n_swa)
            if read is not None and problem is None:
                problem = kv_type_problem(read[0], self.kv_types)
        if problem:
            log.warning("refusing a state for %d tokens: %s", n, problem)
        return problem

    def set_checkpoints(self, slot: Slot, checkpoints: list[Checkpoint]) -> None:
        """Give a restored slot the checkpoints that came with its state: those within its
        tokens, at most the slot's limit (the last ones), as the policy keeps them."""
        mine = [c for c in checkpoints if c.n_tokens <= len(slot.tokens)]
        keep = max(0, self.ckpt.max_per_slot)
        slot.checkpoints = mine[len(mine) - keep :] if len(mine) > keep else mine

    def _positions_match(self, slot: Slot, n: int) -> bool:
        """The restored sequence ends at position n-1 and holds what a cut at n needs: from 0
        without a window, the last window with one (a saved state holds no more)."""
        pos_min, pos_max = self.b.seq_pos_min(slot.id), self.b.seq_pos_max(slot.id)
        if pos_max != n - 1:
            return False
        if n == 0 or self.b.is_recurrent:
            return True
        if self.b.n_swa <= 0:
            return pos_min == 0
        return pos_min >= 0 and window_intact(pos_min, n, self.b.n_swa)

    # ---- integrity ----------------------------------------------------------------

    def check_integrity(self, others: Mapping[int, list[int]] | None = None) -> list[str]:
        """Every slot's token count matches its KV positions and its cells, cell by
        cell (no cell of the KV cache belongs to no slot); returns problems. ``others``:
        sequences beyond the slots and the positions they must hold (--cache-reuse's
        scratch sequence, holding parked chunks)."""
        problems = []
        for seq, pos in (others or {}).items():
            # a window cache may drop parked cells far below the last: the end is exact
            got, want = self.b.seq_pos_max(seq), max(pos, default=-1)
            if got != want:
                problems.append(f"sequence {seq}: ends at {got}, parked chunks at {want}")
        for s in self.slots:
            pmax = self.b.seq_pos_max(s.id)
            if pmax != len(s.tokens) - 1:
                problems.append(f"slot {s.id}: {len(s.tokens)} tokens but pos_max {pmax}")
            if not s.tokens and self.b.seq_pos_min(s.id) != -1:
                problems.append(f"slot {s.id}: no tokens but cells from {self.b.seq_pos_min(s.id)}")
            for c in s.checkpoints:
                if c.n_tokens > len(s.tokens):
                    problems.append(f"slot {s.id}: checkpoint at {c.n_tokens} beyond its tokens")
        caches = self.b.kv_cells()
        if caches is not None:
            n_tokens: list[int | None] = [len(s.tokens) for s in self.slots]
            problems += kv_problems(caches, n_tokens, others)
        if self.dft is not None:
            problems += self.dft.problems()
        return problems
