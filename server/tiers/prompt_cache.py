"""RAM prompt cache of per-sequence states (ARCHITECTURE §7; llama-server's server_prompt_cache).

The cache only stores and chooses; the engine moves bytes in and out of llama.cpp. Entries are
kept in insertion order: eviction always takes the oldest first. Every entry is registered in
the prefix index (server.prefix.prefix_index) under its tenant and tokens, and leaves it with
the entry (taken, replaced, evicted): ``find`` and ``save``'s covered and prefix rules walk
the prompt down that tree instead of scanning the entries.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

from ..prefix.prefix_index import Held, Match, PrefixIndex, SlotBaseline
from ..types import Checkpoint, StateBuf
from . import tenancy
from .saved import InSlot, SavedState

log = logging.getLogger("server.tiers.prompt_cache")

MiB = 1024 * 1024


@dataclass(eq=False)
class RamHeld(Held):
    """A RAM cache entry in the prefix index; ``order`` is ``(seq,)``, its insertion."""

    TIER: ClassVar[str] = "ram"
    entry: SavedState


class SaveOutcome(NamedTuple):
    saved: bool
    reason: str  # "saved" | "empty" | "covered" | "too-large" | "no-memory"
    evicted: int = 0


@dataclass(frozen=True, slots=True)
class LoadChoice:
    index: int
    n_lcp: int
    f_keep: float
    f_sim: float


@dataclass
class CacheCounters:
    saves: int = 0
    save_skips: int = 0
    loads: int = 0  # hits: an entry was restored into a slot
    misses: int = 0  # looked, nothing better than the slot's own state
    load_failures: int = 0
    evictions: int = 0
    bytes_restored: int = 0
    tokens_restored: int = 0


class PromptCache:
    """``limit_bytes`` < 0 means no byte limit. ``limit_tokens`` is the --cache-ram-tokens floor.

    ``index``: the prefix index the entries are registered in (one shared with the disk
    tier, server.prefix.prefix_index); a fresh one of its own when None. Lookups (``find``,
    and ``save``'s covered and prefix rules) go through it, never a scan of the entries.
    """

    def __init__(
        self, limit_bytes: int, limit_tokens: int, index: PrefixIndex | None = None
    ) -> None:
        self.limit_bytes = limit_bytes
        self.limit_tokens = limit_tokens
        self.index = PrefixIndex() if index is None else index
        # Invariant: only _append and _drop change ``entries``, and they keep the running
        # totals equal to the sums over the entries (check_integrity recounts them), and
        # ``_held[i]`` (in the index) holds ``entries[i]``, whose insertion number is
        # ``_seqs[i]`` (increasing: the list is the FIFO eviction order).
        self.entries: list[SavedState] = []
        self._held: list[RamHeld] = []
        self._seqs: list[int] = []
        self._seq = 0
        self._n_bytes = 0
        self._n_tokens = 0
        self.counters = CacheCounters()
        # Called with each entry leaving by eviction (and with a state too large for the
        # limit, read for it): the disk tier's writer takes it (server.tiers.disk).
        self.on_evict: Callable[[SavedState], object] | None = None

    # ---- accounting ---------------------------------------------------------------

    @property
    def nbytes(self) -> int:
        return self._n_bytes

    @property
    def n_tokens(self) -> int:
        return self._n_tokens

    def _append(self, e: SavedState) -> None:
        self._seq += 1
        h = RamHeld(e.tenant, (self._seq,), e)
        self.index.add(h, e.tokens)
        self.entries.append(e)
        self._held.append(h)
        self._seqs.append(self._seq)
        self._n_bytes += e.nbytes
        self._n_tokens += len(e.tokens)

    def _drop(self, index: int) -> SavedState:
        e = self.entries.pop(index)
        self.index.discard(self._held.pop(index))
        del self._seqs[index]
        self._n_bytes -= e.nbytes
        self._n_tokens -= len(e.tokens)
        return e

    def _position(self, h: RamHeld) -> int:
        """Where ``h``'s entry is in ``entries`` (by its insertion number: no scan)."""
        i = bisect.bisect_left(self._seqs, h.order[0])
        assert self._held[i] is h
        return i

    def token_limit(self) -> int:
        """--cache-ram-tokens, raised to what the byte limit holds at the current bytes/token."""
        if self.limit_bytes < 0:
            return self.limit_tokens
        per_token = max(1.0, self.nbytes / max(1, self.n_tokens))
        return max(self.limit_tokens, int(self.limit_bytes / per_token))

    def check_integrity(self) -> list[str]:
        """Recounts bytes and tokens from the entries and checks the ordering rules."""
        problems = []
        total = 0
        for i, e in enumerate(self.entries):
            total += len(e.data) + len(e.data_dft) + sum(len(c.data) for c in e.checkpoints)
            total += sum(len(c.data_dft) for c in e.checkpoints)
            if not e.tokens:
                problems.append(f"entry {i} is empty")
            if any(c.n_tokens > len(e.tokens) for c in e.checkpoints):
                problems.append(f"entry {i} has a checkpoint beyond its tokens")
        index_problems = self._check_index()
        problems += index_problems + self._check_prefixes(trust_index=not index_problems)
        if total != self.nbytes:
            problems.append(f"bytes {self.nbytes} != sum of entries {total}")
        n_tokens = sum(len(e.tokens) for e in self.entries)
        if n_tokens != self.n_tokens:
            problems.append(f"tokens {self.n_tokens} != sum of entries {n_tokens}")
        if self.limit_bytes >= 0 and self.nbytes > self.limit_bytes:
            problems.append(f"bytes {self.nbytes} over the limit {self.limit_bytes}")
        return problems

    def _check_prefixes(self, trust_index: bool) -> list[str]:
        """No entry is a prefix of another of its tenant's (save drops those). Through the
        index when it holds exactly the entries (each entry's subtree holds it alone), else
        by comparing every pair."""
        problems = []
        if trust_index:
            for i, h in enumerate(self._held):
                for other in self.index.below(h):
                    problems.append(f"entry {i} is a prefix of entry {self._position(other)}")
            return problems
        for i, e in enumerate(self.entries):
            for j, f in enumerate(self.entries):
                if (
                    i != j
                    and e.tenant == f.tenant
                    and len(e.tokens) <= len(f.tokens)
                    and f.tokens[: len(e.tokens)] == e.tokens
                ):
                    problems.append(f"entry {i} is a prefix of entry {j}")
        return problems

    def _check_index(self) -> list[str]:
        """The prefix index holds exactly the entries, under their tokens and tenants."""
        problems = self.index.check_integrity()
        held = self.index.holders(RamHeld.TIER)
        if len(held) != len(self.entries) or len(self._held) != len(self.entries):
            problems.append(f"index holds {len(held)} entries, the cache {len(self.entries)}")
        if self._seqs != sorted(set(self._seqs)):
            problems.append("insertion numbers out of order")
        for i, (e, h) in enumerate(zip(self.entries, self._held, strict=False)):
            if h.entry is not e or h.key != e.tenant:
                problems.append(f"entry {i} is not the one indexed")
            elif self.index.path_of(h) != list(e.tokens):
                problems.append(f"entry {i} is not indexed under its tokens")
        return problems

    # ---- save (alloc) -------------------------------------------------------------

    def save(
        self,
        tokens: Sequence[int],
        size: int,
        read_state: Callable[[], StateBuf],
        checkpoints: Sequence[Checkpoint] = (),
        read_draft: Callable[[], bytes | bytearray] | None = None,
        tenant: str = "",
    ) -> SaveOutcome:
        """``put`` of a state still in a slot: ``size`` bytes (target and draft), read by
        ``read_state`` and ``read_draft`` only once the entry is sure to be kept."""
        where = InSlot(-1, size, read_state, read_draft)
        return self.put(SavedState(list(tokens), where, b"", list(checkpoints), tenant=tenant))

    def put(self, state: SavedState) -> SaveOutcome:
        """Store a slot's state (SlotStore.snapshot's: its bytes are read, with
        ``SavedState.read``, only once the entry is sure to be kept). Entries cover each
        other only within one tenant."""
        tokens, tenant = state.tokens, state.tenant
        if not tokens:
            return self._skip("empty")
        if self.index.covers(RamHeld.TIER, tenant, tokens):
            return self._skip("covered")  # the longer entry serves this prompt too
        need = state.nbytes
        if self.limit_bytes >= 0 and need > self.limit_bytes:
            if self.on_evict is not None:  # straight to the next tier
                self._spill(state)
            return self._skip("too-large")  # never evict for an entry that cannot fit anyway
        evicted = 0
        for h in self.index.prefixes_of(RamHeld.TIER, tenant, tokens):
            self._drop(self._position(h))  # the new entry serves its prefixes
            evicted += 1
        if self.limit_bytes >= 0:
            while self.entries and self.nbytes + need > self.limit_bytes:
                self._evict_oldest("making room")
                evicted += 1
        try:
            entry = state.read()
        except MemoryError:
            self.limit_bytes = max(1, int(0.4 * self.nbytes))
            log.warning(
                "out of memory saving a prompt; cache limit cut to %.1f MiB", self.limit_bytes / MiB
            )
            self.update()
            return self._skip("no-memory")
        self._append(entry)
        self.counters.saves += 1
        log.debug(
            "cache: saved %d tokens, %.2f MiB (%d entries)",
            len(tokens),
            need / MiB,
            len(self.entries),
        )
        return SaveOutcome(True, "saved", evicted)

    def _skip(self, reason: str) -> SaveOutcome:
        self.counters.save_skips += 1
        return SaveOutcome(False, reason)

    def _spill(self, state: SavedState) -> None:
        """Hand a state too large for RAM to ``on_evict`` (copied: the slot keeps its own)."""
        try:
            e = state.read()
        except MemoryError:
            return
        if self.on_evict is not None:  # always, from its callers
            self.on_evict(e)

    def _evict_oldest(self, why: str) -> None:
        e = self._drop(0)
        self.counters.evictions += 1
        if self.on_evict is not None:
            self.on_evict(e)
        log.debug("cache: evicted %d tokens, %.2f MiB (%s)", len(e.tokens), e.nbytes / MiB, why)

    # ---- load ---------------------------------------------------------------------

    def find(self, match: Match, slot: SlotBaseline) -> LoadChoice | None:
        """The entry of the prompt's key (``match``: the prompt walked down this cache's
        index, the locator's ``Match.tiers()``) that beats ``slot``'s own state on both
        f_keep and f_sim, if any: the first such entry in insertion order, then each later
        one beating that, as a scan would take them. An entry sharing less than a quarter of
        itself with the prompt is never taken ("don't trash large prompts")."""
        if match.index is not self.index:
            raise ValueError("a match of another index")
        hit = match.beating((RamHeld.TIER,), slot)
        if hit is None:
            return None
        f_sim = hit.n_lcp / match.n_prompt
        return LoadChoice(self._position(hit.held), hit.n_lcp, hit.f_keep, f_sim)

    def take(self, choice: LoadChoice, restore: Callable[[SavedState], bool]) -> SavedState | None:
        """Restore the chosen entry with ``restore`` (target and draft: both or neither).

        On success the entry is removed from the cache and returned; on failure it stays.
        """
        e = self.entries[choice.index]
        if not restore(e):
            self.counters.load_failures += 1
            return None
        self._drop(choice.index)
        self.counters.loads += 1
        self.counters.bytes_restored += e.nbytes
        self.counters.tokens_restored += len(e.tokens)
        log.debug(
            "cache: loaded %d tokens (f_keep %.2f, f_sim %.2f)",
            len(e.tokens),
            choice.f_keep,
            choice.f_sim,
        )
        return e

    # ---- update -------------------------------------------------------------------

    def update(self) -> None:
        """Evict oldest-first while over the byte limit, then while over the token limit."""
        if self.limit_bytes >= 0:
            while self.entries and self.nbytes > self.limit_bytes:
                self._evict_oldest("byte limit")
        limit = self.token_limit()
        if limit > 0:
            while self.entries and self.n_tokens > limit:
                self._evict_oldest("token limit")

    def describe(self, owner: str | None = None) -> dict:
        """Entries, totals, limits and counters; engine thread only (the entries and the
        totals must agree). ``owner``: only that tenant's entries (``tenancy.owner``), and
        totals of those: another tenant's sizes would tell its prompts' lengths."""
        now = time.time()
        mine = [e for e in self.entries if owner is None or tenancy.owner(e.tenant) == owner]
        return {
            "n_entries": len(mine),
            "n_bytes": self.nbytes if owner is None else sum(e.nbytes for e in mine),
            "n_tokens": self.n_tokens if owner is None else sum(len(e.tokens) for e in mine),
            "limit_bytes": self.limit_bytes,
            "limit_tokens": self.limit_tokens,
            "limit_tokens_effective": self.token_limit(),
            "counters": self.counters.__dict__.copy(),
            "entries": [
                {
                    "n_tokens": len(e.tokens),
                    "n_bytes": e.nbytes,
                    "n_checkpoints": len(e.checkpoints),
                    "age_s": round(now - e.created, 3),
                }
                for e in mine
            ],
        }
