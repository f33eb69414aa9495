"""The slots' side of the KV events (medium GPU): after each engine step, what every slot's
sequence holds in full blocks, compared with what was last published for it.

A slot's ``Sequence`` is the one record of its KV tokens, changed only by SlotStore
(prefill and generation extend it; cuts, erases, clears, evictions to the RAM cache, context
shifts and restores truncate, remove or assign). ``Sequence.n_stable`` marks how many of its
first tokens are untouched since the last look, so a step that only appended costs a length
check, and a block is hashed once when it fills. Tokens of a failed decode never reach the
sequence, so they are never published. Engine thread only.
"""

from __future__ import annotations

from ..cache.kv_blocks import MEDIUM_GPU
from ..cache.kv_events import Chain, KVEvents
from .slot import Slot


class _Published:
    __slots__ = ("hashes", "tenant")

    def __init__(self) -> None:
        self.hashes: list[int] = []  # the slot's full blocks, as last published
        self.tenant = ""


class SlotWatcher:
    def __init__(self, events: KVEvents, n_slots: int) -> None:
        self.events = events
        self.bs = events.block_size
        self._pub = [_Published() for _ in range(n_slots)]

    def sync(self, slots: list[Slot]) -> None:
        """Publish what changed in the slots' sequences since the last call: blocks now
        held and blocks no longer held (one change: stores are counted before removals)."""
        stored: list[Chain] = []
        removed: list[int] = []
        bs = self.bs
        for s in slots:
            seq, pub = s.seq, self._pub[s.id]
            n_full = len(seq.tokens) // bs
            n_pub = len(pub.hashes)
            if n_full == n_pub and seq.n_stable >= n_pub * bs and pub.tenant == s.tenant:
                seq.n_stable = len(seq.tokens)
                continue
            self._diff(s, pub, n_full, stored, removed)
            seq.n_stable = len(seq.tokens)
        if stored or removed:
            self.events.change(MEDIUM_GPU, stored, removed)

    def _diff(
        self, s: Slot, pub: _Published, n_full: int, stored: list[Chain], removed: list[int]
    ) -> None:
        """The slot's blocks from the first that may differ: recomputed (memoized) and
        compared with the published ones; the differing tail goes, the new one comes."""
        tokens = s.seq.tokens
        keep = min(s.seq.n_stable // self.bs, len(pub.hashes), n_full)
        if pub.tenant != s.tenant:
            keep = 0
        parent = pub.hashes[keep - 1] if keep else None
        new = self.events.hasher.hashes(tokens, s.tenant, keep, n_full, parent)
        j = 0
        old = pub.hashes
        while j < len(new) and keep + j < len(old) and new[j] == old[keep + j]:
            j += 1
        removed.extend(old[keep + j :])
        if j < len(new):
            first = keep + j
            p = old[first - 1] if first else None
            bs = self.bs
            stored.append(Chain(new[j:], tokens[first * bs : n_full * bs], p, s.tenant))
        pub.hashes = old[: keep + j] + new[j:]
        pub.tenant = s.tenant
