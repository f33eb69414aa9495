"""The slots' side of the KV events (medium GPU): what every slot's KV holds in full blocks,
published once per engine step from the same change notifications the slots' block index
takes (server.prefix.block_index: one record of what the slots hold).

A slot's ``Sequence`` is the one record of its KV tokens, changed only by SlotStore; each
change reaches the block index, which tells its listeners (this watcher) the tokens now and
how many leading ones stayed. The watcher keeps, per slot, the lowest token changed since
the last publication; an append that fills no block costs a length check, a cut or a shift
marks where the slot's blocks may differ, and ``sync`` (after each step) hashes only the
blocks from there (each block hashed once when it fills; the hasher's memo serves the rest).
Tokens of a failed decode never reach the sequence, so they are never published. Engine
thread only.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from ..prefix.block_index import BlockIndex
from ..prefix.items import PromptItem
from ..slot.slot import Slot
from .kv_blocks import MEDIUM_GPU
from .kv_events import Chain, KVEvents


class _Published:
    __slots__ = ("hashes", "tenant")

    def __init__(self) -> None:
        self.hashes: list[int] = []  # the slot's full blocks, as last published
        self.tenant = ""


class SlotWatcher:
    """A listener of the slots' block index (``changed``), published by ``sync``."""

    def __init__(self, events: KVEvents, n_slots: int) -> None:
        self.events = events
        self.bs = events.block_size
        self._pub = [_Published() for _ in range(n_slots)]
        self._len = [0] * n_slots  # each slot's length at its last change
        self._low: dict[int, int] = {}  # slot id -> first token changed since the last sync

    def changed(self, hid: Hashable, items: Sequence[PromptItem], n_keep: int) -> int:
        """Slot ``hid`` holds ``items`` now, the first ``n_keep`` of them unchanged (appends
        since the last call included). Returns the length that fills its next block."""
        n, bs = len(items), self.bs
        if not isinstance(hid, int):
            return (n // bs + 1) * bs
        old = self._len[hid]
        self._len[hid] = n
        if n_keep >= old and n // bs == old // bs:
            return (n // bs + 1) * bs  # appends that filled no block
        low = self._low.get(hid)
        if low is None or n_keep < low:
            self._low[hid] = n_keep
        return (n // bs + 1) * bs

    def sync(self, slots: list[Slot]) -> None:
        """Publish what changed in the slots' blocks since the last call: blocks now held
        and blocks no longer held (one change: stores are counted before removals)."""
        if not self._low:
            return
        stored: list[Chain] = []
        removed: list[int] = []
        for sid, low in self._low.items():
            self._diff(slots[sid], low, stored, removed)
        self._low.clear()
        if stored or removed:
            self.events.change(MEDIUM_GPU, stored, removed)

    def _diff(self, s: Slot, low: int, stored: list[Chain], removed: list[int]) -> None:
        """The slot's blocks from the first that may differ: recomputed (memoized) and
        compared with the published ones; the differing tail goes, the new one comes."""
        pub, tokens, bs = self._pub[s.id], s.seq.tokens, self.bs
        n_full = len(tokens) // bs
        keep = min(low // bs, len(pub.hashes), n_full)
        if pub.tenant != s.tenant:
            keep = 0
        parent = pub.hashes[keep - 1] if keep else None
        keys: list[tuple[str, ...]] = []
        new = self.events.hasher.hashes(tokens, s.tenant, keep, n_full, parent, keys)
        j = 0
        old = pub.hashes
        while j < len(new) and keep + j < len(old) and new[j] == old[keep + j]:
            j += 1
        removed.extend(old[keep + j :])
        if j < len(new):
            first = keep + j
            p = old[first - 1] if first else None
            chain = Chain(new[j:], tokens[first * bs : n_full * bs], p, s.tenant, keys[j:])
            stored.append(chain)
        pub.hashes = old[: keep + j] + new[j:]
        pub.tenant = s.tenant


def watch_slots(events: KVEvents, blocks: BlockIndex, slots: list[Slot]) -> SlotWatcher:
    """A watcher of ``slots`` told by their block index (``blocks``) from now on, and of
    what they hold already (published by its first ``sync``)."""
    w = SlotWatcher(events, len(slots))
    blocks.listeners.append(w)
    for s in slots:
        s.seq.retell()  # from now on told at this watcher's block ends too
    return w
