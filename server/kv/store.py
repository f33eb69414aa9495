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
import functools
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

from ..prefix.block_index import BlockIndex
from ..prefix.reuse import ReuseChunk
from ..slot.backend_api import Backend
from ..slot.slot import Slot
from ..tiers import slot_file
from ..tiers.file_io import StateBuffers
from ..tiers.saved import Extras, InBuffer, InSlot, OnDisk, SavedState
from ..types import Checkpoint, StateBuf, lcp
from .audit import kv_problems, kv_type_problem, seq_state_problem
from .checkpoints import CheckpointPolicy, file_checkpoints
from .draft_kv import DraftKV, DraftMemory
from .policy import window_intact
from .spare import Spare

log = logging.getLogger("server.kv.store")


class Decoded(Protocol):
    """A decoded batch's part for one slot (engine/step_plan.py's ``SlotWork``)."""

    slot: Slot
    tokens: list[int]


@dataclass(frozen=True)
class Restored:
    """What ``SlotStore.restore`` did: ``ok`` when the slot now holds the state (else it is
    empty, or, for a state already in it, as it was); ``consumed``: the bytes of the target
    state llama.cpp read (a file's appendices start right after them)."""

    ok: bool
    consumed: int = 0


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
        # what every slot's KV holds, as blocks: the locator's index of the slots, kept by
        # their sequences as their tokens change (server.prefix.block_index)
        self.blocks = BlockIndex()
        for s in self.slots:
            s.seq.watch = functools.partial(self.blocks.changed, s.id)
        # a draft model's sequences, which follow the slots' (kv/draft_kv.py)
        self.dft = DraftKV(draft, most_drafted + 1, backend.n_seq) if draft is not None else None
        # a restored RAM entry's bytes, for the next state copied out (kv/spare.py)
        self.spare = Spare()

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
        return self.dft.shared(slot) if self.dft is not None else 0

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
        return self.shared_until(slot) <= p0 or self._own_copy(slot, partial=False)

    def _own_copy(self, slot: Slot, partial: bool) -> bool:
        """Give the slot cells of its own for those it shares (``partial``: its window
        cells only): its state read, its sequence cleared (in those caches), the state set
        back: new cells, its alone (needs room for them). False when that failed."""
        data = self.b.state_get(slot.id, partial=partial)
        if not partial:
            self.b.seq_clear(slot.id)  # (a partial load clears the window cache itself)
        return self.b.state_set(slot.id, data, partial=partial) == len(data)

    # ---- --cache-reuse (engine/cache_reuse.py) ------------------------------------

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
        self.give_checkpoint(slot, c)
        return c

    def give_checkpoint(self, slot: Slot, c: Checkpoint) -> None:
        """Keep ``c`` (a checkpoint of this slot's tokens) as the policy keeps checkpoints."""
        self.ckpt.insert(slot.checkpoints, c)

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

    def commit_all(self, works: Iterable[Decoded]) -> None:
        """``commit`` for each decoded work (its slot and tokens), in one call per step."""
        for w in works:
            w.slot.seq.extend(w.tokens)

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
        # seq_cp shared the source's window cells too. llama.cpp reuses a cell that slid out
        # of the window only while one sequence owns it, and sizes the window cache for one
        # window per slot (when smaller than the context): shared window cells would stay
        # until every owner dropped them, and the cache filled ("no room left") while the
        # slots held a common prefix. So the copy takes its window as its own; the
        # full-attention cells stay shared.
        own = not self.b.window_cache_slides or self._own_copy(dst, partial=True)
        if not own or self.b.seq_pos_max(dst.id) != n - 1:
            log.warning("slot %d: its copied window could not be made its own", dst.id)
            self.clear(dst)
            return 0
        dst.tokens = src.tokens[:n]
        # checkpoints are partial states of the same prefix: valid for the copy too
        dst.checkpoints = [c for c in src.checkpoints if c.n_tokens <= n]
        return n

    def snapshot(self, slot: Slot) -> SavedState:
        """The slot's whole state, still in its KV cache (``InSlot``: ``SavedState.read``
        copies it), for the RAM cache or the disk tier; the slot keeps it too. Of the
        checkpoints, those a slot file carries go along (``file_checkpoints``: the one
        serving a regenerated answer and the next turn; each costs a window of state, and
        with all of them an agent's conversation took 54 MiB of the RAM cache instead of
        24). The token list is the slot's own: a copy read is the cache's."""
        size = self.b.state_size(slot.id)
        dft, read_draft = self.dft, None
        n_dft = dft.state_size(slot) if dft is not None else 0
        if dft is not None and n_dft:
            read_draft = lambda: dft.state(slot)  # noqa: E731
        where = InSlot(slot.id, size + n_dft, lambda: self._copy_out(slot.id, size), read_draft)
        ckpts = file_checkpoints(
            slot.checkpoints, len(slot.tokens), self.b.n_swa, self.b.is_recurrent
        )
        return SavedState(slot.tokens, where, b"", ckpts, tenant=slot.tenant)

    def _copy_out(self, seq: int, size: int) -> StateBuf:
        """Sequence ``seq``'s state (``size`` bytes) in memory of ours: the spare's pages
        when it has room (kv/spare.py), else new memory."""
        got = self.spare.copy(size, lambda buf, n: self.b.state_get_into(seq, buf, n))
        return got if got is not None else self.b.state_get(seq, size=size)

    def recycle(self, state: SavedState) -> None:
        """``state`` was restored from our memory and nothing reads it any more (a RAM
        entry taken): its bytes may become the spare the next copy lands in."""
        self.spare.give(state.data)

    def save_state(self, slot: Slot, buffers: StateBuffers) -> SavedState | None:
        """The slot's state copied into a buffer of ``buffers`` (reused memory: one copy, no
        page faults) for a slot file: ``InBuffer`` from 0, with what the file's appendices
        hold (of the checkpoints, those a file carries: ``file_checkpoints``); None, the
        buffer given back, when llama.cpp could not copy it. The caller gives the buffer
        back once the file is written."""
        size = self.b.state_size(slot.id)
        buf = buffers.take(size)
        if self.b.state_get_into(slot.id, buf, size) != size:
            buffers.give(buf)
            return None
        draft = self.dft.state(slot) if self.dft is not None else b""
        ckpts = file_checkpoints(
            slot.checkpoints, len(slot.tokens), self.b.n_swa, self.b.is_recurrent
        )
        return SavedState(
            list(slot.tokens),
            InBuffer(buf, 0, size, True, True),
            draft,
            ckpts,
            tenant=slot.tenant,
            kv_types=self.kv_types,
        )

    @property
    def kv_types(self) -> tuple[int, int] | None:
        """The ggml types of the target's K and V cache (None: not known, a fake)."""
        return self.b.kv_type_ids

    def restore(self, slot: Slot, state: SavedState, trusted: bool) -> Restored:
        """Load a saved state into the slot: the one way a state comes back (RAM cache, disk
        tier, slot files).

        The state must prove it matches: it is consumed (whole, unless a buffer's end is not
        exact) and its positions run exactly 0..len(tokens)-1; an untrusted state (a file's)
        must also describe, cell by cell, exactly those positions before it is loaded (see
        audit.py). Otherwise the slot is cleared and nothing restored. On success the slot
        takes the state's tokens and tenant, then its extras: a trusted state (our own
        memory) keeps every checkpoint within its tokens, and its draft state must load too
        (target and draft stand or fall together, ARCHITECTURE §7); an untrusted one keeps at
        most the slot's limit of checkpoints, is refused when it names KV types other than
        ours, and its draft state is dropped, with a warning, when it does not fit (§8).
        A state already ``InSlot`` of this slot (a file's appendices, read after its state
        was loaded) only gives its extras, if the slot still holds its tokens.
        """
        if isinstance(state.data, InSlot):
            if state.data.slot != slot.id or slot.tokens != state.tokens:
                return Restored(False)
            return Restored(self._extras(slot, state, trusted))
        consumed = self._load(slot, state, trusted)
        if consumed == 0:
            return Restored(False)
        slot.tenant = state.tenant
        if state.extras is Extras.LATER:
            return Restored(True, consumed)
        if state.extras is Extras.AFTER_STATE:
            self._parse_extras(state, consumed)
        return Restored(self._extras(slot, state, trusted), consumed)

    def _load(self, slot: Slot, state: SavedState, trusted: bool) -> int:
        """Clear the slot and load the target state alone (proven first unless ``trusted``
        or proven already in its buffer: ``InBuffer.proven``); the slot takes the tokens, no checkpoints. Returns the bytes consumed,
        0 when refused (the slot is then empty)."""
        where, n = state.data, len(state.tokens)
        if isinstance(where, (InSlot, OnDisk)):
            raise TypeError(f"a state {type(where).__name__} has no bytes to load")
        region, data, nbytes = None, where, None
        if isinstance(where, InBuffer):
            size, whole = where.end - where.state_off, where.exact
            trusted = trusted or where.proven  # proven in this private buffer already
            region = (ctypes.c_uint8 * size).from_buffer(where.buf, where.state_off)
            data, nbytes = region, size
        else:
            data, nbytes, size, whole = where, None, len(where), True
        self.clear(slot)
        try:
            if not trusted and self._state_problem(data, size, n):
                return 0
            consumed = self.b.state_set(slot.id, data, nbytes=nbytes)
        finally:
            del data, region  # a mapping may be closed once this returns
        fits = consumed > 0 and (consumed == size or not whole)
        if not fits or not self._positions_match(slot, n):
            self.clear(slot)
            return 0
        slot.tokens = state.tokens
        return consumed

    def _parse_extras(self, state: SavedState, consumed: int) -> None:
        """A buffer's appendices, read where its state ended (known once loaded)."""
        where = state.data
        assert isinstance(where, InBuffer)
        with memoryview(where.buf) as whole, whole[: where.end] as body:
            app = slot_file.parse_appendices(
                body, where.state_off + consumed, len(state.tokens), self.ckpt.max_per_slot
            )
        slot_file.give_appendices(state, app)

    def _extras(self, slot: Slot, state: SavedState, trusted: bool) -> bool:
        """Give a slot that holds the state's tokens its checkpoints and draft state (see
        ``restore``); False, with the slot cleared, when they are refused."""
        if trusted:
            slot.checkpoints = [c for c in state.checkpoints if c.n_tokens <= len(slot.tokens)]
            if (
                state.data_dft
                and self.dft is not None
                and not self.dft.restore(slot, state.data_dft)
            ):
                self.clear(slot)
                return False
            return True
        if slot_file.kv_types_problem(state, self.kv_types):
            self.clear(slot)  # its state proved of our types: the file contradicts itself
            return False
        self.set_checkpoints(slot, state.checkpoints)
        self._restore_draft(slot, state)
        return True

    def _restore_draft(self, slot: Slot, state: SavedState) -> None:
        """A file's draft state (SDFT) and checkpoint draft data: kept when they fit this
        server's draft context, else dropped; the target state stays either way."""
        if self.dft is None:
            for c in slot.checkpoints:
                c.data_dft = b""
            if state.data_dft:
                state.warnings.append("the file's draft state was dropped: no draft model here")
            return
        if state.data_dft and not self.dft.restore(slot, state.data_dft):
            state.warnings.append("the file's draft state does not fit the draft model; dropped")

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
            problems += kv_problems(caches, n_tokens, others, self.b.window_cache_slides)
        if self.dft is not None:
            problems += self.dft.problems()
        problems += self.blocks.check_integrity()
        for s in self.slots:
            if not self.blocks.holds_items(s.id, s.tokens):
                problems.append(f"slot {s.id}: its tokens are not the ones its blocks index")
        return problems
