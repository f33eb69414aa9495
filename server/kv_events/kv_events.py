"""KV-cache events: what the server holds, per medium, in full blocks, and the vLLM events
that tell llm-d's indexer when it changes (block hashes and tuples: kv_events/kv_blocks.py).

``KVEvents`` keeps, per medium, how many holders hold each block (two slots or two RAM
entries often share a system prompt's blocks): a block is published ``BlockStored`` when
its first holder comes and ``BlockRemoved`` when its last one goes, so a subscriber's view
of a medium is exactly the union of what its holders hold. Holders:

- GPU: the slots' sequences (server.kv_events.kv_watch reports their changes each step);
- CPU and DISK: the RAM cache's entries and the disk tier's files and queued entries, as
  the prefix index registers and forgets them (``added`` / ``discarded``: the index's
  listener, called on whichever thread changed the tree).

Token ids (issue 40): a BlockStored names its blocks' tokens, i.e. the prompt's text.
``token_ids`` says whose are published: ``ALL``; ``SHARED`` (not those of a tenant's blocks,
--cache-isolation); ``NONE`` (any key holder's prompt is private: --api-key). A withheld
block is published with its hashes and an empty ``token_ids``.

Every change's events are handed to ``publish`` (non-blocking: the publisher's bounded
queue, kv_events/kv_publisher.py) under one lock, so their order is the ledger's order.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..prefix.prefix_index import Held
from ..tiers.tenancy import owner
from .kv_blocks import (
    MEDIUM_CPU,
    MEDIUM_DISK,
    MEDIUM_GPU,
    BlockHasher,
    Event,
    cleared_event,
    removed_event,
    stored_event,
    tenant_extra,
)

# whose token ids BlockStored carries (module docstring)
TOKENS_ALL, TOKENS_SHARED, TOKENS_NONE = "all", "shared", "none"

# the prefix index's tiers (Held.TIER) and the medium each publishes as
TIER_MEDIUM = {"ram": MEDIUM_CPU, "disk": MEDIUM_DISK, "disk-queue": MEDIUM_DISK}


@dataclass
class Chain:
    """A holder's run of full blocks: ``hashes[i]`` names ``tokens[i*bs:(i+1)*bs]``;
    ``parent`` is the block before the first (None: the model's root)."""

    hashes: list[int]
    tokens: Sequence[int]
    parent: int | None = None
    tenant: str = ""
    # each block's extra keys (the tenant's, then its images': BlockHasher.hashes); None:
    # the tenant's alone, for every block (a text-only chain)
    keys: list[tuple[str, ...]] | None = None


class KVEvents:
    def __init__(
        self,
        hasher: BlockHasher,
        publish: Callable[[list[Event]], None],
        token_ids: str = TOKENS_ALL,
    ) -> None:
        self.hasher = hasher
        self.token_ids = token_ids
        self.block_size = hasher.block_size
        self._publish = publish
        self._lock = threading.Lock()
        self._refs: dict[str, dict[int, int]] = {
            m: {} for m in (MEDIUM_GPU, MEDIUM_CPU, MEDIUM_DISK)
        }
        self._held: dict[Held, tuple[str, list[int]]] = {}  # a tier's holder -> its blocks
        self._gone: set[Held] = set()  # holders discarded before their ``added`` ran

    # ---- changes ------------------------------------------------------------------

    def change(self, medium: str, stored: list[Chain], removed: list[int]) -> None:
        """Holders of ``medium`` now hold the ``stored`` chains too, and no longer the
        ``removed`` blocks (one reference each); publish what that changes. Stores count
        first, so a block moving between two holders in one change is never published."""
        with self._lock:
            self._change(medium, stored, removed)

    def _change(self, medium: str, stored: list[Chain], removed: list[int]) -> None:
        events: list[Event] = []
        refs = self._refs[medium]
        for c in stored:
            self._store(refs, medium, c, events)
        gone = self._release(refs, removed)
        if gone:
            events.append(removed_event(gone, medium))
        if events:
            self._publish(events)

    def _store(self, refs: dict[int, int], medium: str, c: Chain, out: list[Event]) -> None:
        """Count ``c``'s blocks; each run of blocks new to the medium is one BlockStored
        (parent: the block before the run)."""
        start = -1
        for i, h in enumerate(c.hashes):
            n = refs.get(h, 0)
            refs[h] = n + 1
            if n == 0 and start < 0:
                start = i
            elif n > 0 and start >= 0:
                out.append(self._run(c, start, i, medium))
                start = -1
        if start >= 0:
            out.append(self._run(c, start, len(c.hashes), medium))

    def _run(self, c: Chain, a: int, b: int, medium: str) -> Event:
        bs = self.block_size
        parent = c.parent if a == 0 else c.hashes[a - 1]
        toks = list(c.tokens[a * bs : b * bs]) if self._shows(c.tenant) else []
        if c.keys is not None and any(c.keys[a:b]):
            return stored_event(c.hashes[a:b], parent, toks, bs, medium, c.keys[a:b])
        return stored_event(c.hashes[a:b], parent, toks, bs, medium, tenant_extra(c.tenant))

    def _shows(self, tenant: str) -> bool:
        """Whether a block of ``tenant`` is published with its token ids."""
        if self.token_ids == TOKENS_ALL:
            return True
        return self.token_ids == TOKENS_SHARED and not owner(tenant)

    @staticmethod
    def _release(refs: dict[int, int], hashes: list[int]) -> list[int]:
        """Drop one reference to each block; returns those no holder holds any more."""
        gone = []
        for h in hashes:
            n = refs.get(h, 0)
            if n <= 1:
                if n == 1:
                    del refs[h]
                    gone.append(h)
            else:
                refs[h] = n - 1
        return gone

    def cleared(self) -> None:
        """Every medium is empty (start-up, model unloaded): AllBlocksCleared."""
        with self._lock:
            for refs in self._refs.values():
                refs.clear()
            self._held.clear()
            self._gone.clear()
            self._publish([cleared_event()])

    def held(self, medium: str) -> set[int]:
        """The blocks ``medium`` holds now (tests, diagnostics)."""
        with self._lock:
            return set(self._refs[medium])

    # ---- the prefix index's listener (RAM cache, disk tier) ---------------------------

    def added(self, h: Held, tokens: Sequence[int]) -> None:
        medium = TIER_MEDIUM.get(getattr(h, "TIER", ""))
        if medium is None:
            return
        tenant = h.key if isinstance(h.key, str) else ""
        keys: list[tuple[str, ...]] = []
        hashes = self.hasher.hashes(tokens, tenant, keys=keys)  # outside the lock: memo shared
        with self._lock:
            if h in self._gone:  # its discard ran first (another thread)
                self._gone.discard(h)
                return
            self._held[h] = (medium, hashes)
            self._change(medium, [Chain(hashes, tokens, None, tenant, keys)], [])

    def discarded(self, h: Held) -> None:
        if getattr(h, "TIER", "") not in TIER_MEDIUM:
            return
        with self._lock:
            got = self._held.pop(h, None)
            if got is None:
                self._gone.add(h)
                return
            self._change(got[0], [], got[1])
