"""RAM prompt cache of per-sequence states (DESIGN §7; llama-server's server_prompt_cache).

The cache only stores and chooses; the engine moves bytes in and out of llama.cpp. Entries are
kept in insertion order: eviction always takes the oldest first.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from ..types import Checkpoint, StateBuf, lcp

log = logging.getLogger("server.cache")

MiB = 1024 * 1024


@dataclass
class CacheEntry:
    tokens: list[int]
    data: StateBuf  # target sequence state (llama_state_seq_get_data_ext, flags none)
    data_dft: bytes | bytearray = b""  # draft model state; empty without a draft model
    checkpoints: list[Checkpoint] = field(default_factory=list)
    created: float = field(default_factory=time.time)
    tenant: str = ""  # only this tenant's prompts may load the entry (--cache-isolation)

    @property
    def nbytes(self) -> int:
        return len(self.data) + len(self.data_dft) + sum(c.nbytes for c in self.checkpoints)


class SaveOutcome(NamedTuple):
    saved: bool
    reason: str  # "saved" | "empty" | "covered" | "too-large" | "no-memory"
    evicted: int = 0


class LoadChoice(NamedTuple):
    # mypy: the field shadows tuple.index (rename it in the prefix index rewrite)
    index: int  # type: ignore[assignment]
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
    """``limit_bytes`` < 0 means no byte limit. ``limit_tokens`` is the --cache-ram-tokens floor."""

    def __init__(self, limit_bytes: int, limit_tokens: int) -> None:
        self.limit_bytes = limit_bytes
        self.limit_tokens = limit_tokens
        # Invariant: only _append and _drop change ``entries``, and they keep the running
        # totals equal to the sums over the entries (check_integrity recounts them).
        self.entries: list[CacheEntry] = []
        self._n_bytes = 0
        self._n_tokens = 0
        self.counters = CacheCounters()
        # Called with each entry leaving by eviction (and with a state too large for the
        # limit, read for it): the disk tier's writer takes it (server.cache.disk).
        self.on_evict: Callable[[CacheEntry], object] | None = None

    # ---- accounting ---------------------------------------------------------------

    @property
    def nbytes(self) -> int:
        return self._n_bytes

    @property
    def n_tokens(self) -> int:
        return self._n_tokens

    def _append(self, e: CacheEntry) -> None:
        self.entries.append(e)
        self._n_bytes += e.nbytes
        self._n_tokens += len(e.tokens)

    def _drop(self, index: int) -> CacheEntry:
        e = self.entries.pop(index)
        self._n_bytes -= e.nbytes
        self._n_tokens -= len(e.tokens)
        return e

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
            for j, f in enumerate(self.entries):
                if (
                    i != j
                    and len(e.tokens) <= len(f.tokens)
                    and f.tokens[: len(e.tokens)] == e.tokens
                ):
                    problems.append(f"entry {i} is a prefix of entry {j}")
        if total != self.nbytes:
            problems.append(f"bytes {self.nbytes} != sum of entries {total}")
        n_tokens = sum(len(e.tokens) for e in self.entries)
        if n_tokens != self.n_tokens:
            problems.append(f"tokens {self.n_tokens} != sum of entries {n_tokens}")
        if self.limit_bytes >= 0 and self.nbytes > self.limit_bytes:
            problems.append(f"bytes {self.nbytes} over the limit {self.limit_bytes}")
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
        """Store a slot's state. ``size`` is the state size (known before copying); the bytes
        are read only once the entry is sure to be kept. Entries cover each other only within
        one ``tenant``."""
        if not tokens:
            return self._skip("empty")
        mine = [e.tenant == tenant for e in self.entries]
        for e, same in zip(self.entries, mine, strict=True):
            if same and len(e.tokens) >= len(tokens) and lcp(e.tokens, tokens) == len(tokens):
                return self._skip("covered")  # the longer entry serves this prompt too
        need = size + sum(c.nbytes for c in checkpoints)
        if self.limit_bytes >= 0 and need > self.limit_bytes:
            if self.on_evict is not None:  # straight to the next tier
                self._spill(tokens, read_state, checkpoints, read_draft, tenant)
            return self._skip("too-large")  # never evict for an entry that cannot fit anyway
        evicted = 0
        for i in range(len(self.entries) - 1, -1, -1):  # the new entry serves its prefixes
            if mine[i] and lcp(self.entries[i].tokens, tokens) == len(self.entries[i].tokens):
                self._drop(i)
                evicted += 1
        if self.limit_bytes >= 0:
            while self.entries and self.nbytes + need > self.limit_bytes:
                self._evict_oldest("making room")
                evicted += 1
        try:
            data = read_state()
            dft = read_draft() if read_draft is not None else b""
        except MemoryError:
            self.limit_bytes = max(1, int(0.4 * self.nbytes))
            log.warning(
                "out of memory saving a prompt; cache limit cut to %.1f MiB", self.limit_bytes / MiB
            )
            self.update()
            return self._skip("no-memory")
        self._append(CacheEntry(list(tokens), data, dft, list(checkpoints), tenant=tenant))
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

    def _spill(
        self,
        tokens: Sequence[int],
        read_state: Callable[[], StateBuf],
        checkpoints: Sequence[Checkpoint],
        read_draft: Callable[[], bytes | bytearray] | None,
        tenant: str,
    ) -> None:
        """Hand a state too large for RAM to ``on_evict`` (copied: the slot keeps its own)."""
        try:
            dft = read_draft() if read_draft is not None else b""
            e = CacheEntry(list(tokens), read_state(), dft, list(checkpoints), tenant=tenant)
        except MemoryError:
            return
        self.on_evict(e)  # type: ignore[misc]

    def _evict_oldest(self, why: str) -> None:
        e = self._drop(0)
        self.counters.evictions += 1
        if self.on_evict is not None:
            self.on_evict(e)
        log.debug("cache: evicted %d tokens, %.2f MiB (%s)", len(e.tokens), e.nbytes / MiB, why)

    # ---- load ---------------------------------------------------------------------

    def find(
        self, slot_tokens: Sequence[int], prompt: Sequence[int], tenant: str = "", own: bool = True
    ) -> LoadChoice | None:
        """The entry of ``tenant`` that beats the slot's own state (when ``own``: the slot
        holds this tenant's tokens) on both f_keep and f_sim, if any.

        An entry sharing less than a quarter of itself with the prompt is never taken
        ("don't trash large prompts").
        """
        if not prompt:
            return None
        n = lcp(slot_tokens, prompt) if own else 0
        best_keep = n / len(slot_tokens) if slot_tokens else -1.0
        best_sim = n / len(prompt)
        best: LoadChoice | None = None
        for i, e in enumerate(self.entries):
            if e.tenant != tenant:
                continue
            m = lcp(e.tokens, prompt)
            f_keep = m / len(e.tokens)
            f_sim = m / len(prompt)
            if f_keep < 0.25:
                continue
            if f_keep > best_keep and f_sim > best_sim:
                best_keep, best_sim = f_keep, f_sim
                best = LoadChoice(i, m, f_keep, f_sim)
        return best

    def take(self, choice: LoadChoice, restore: Callable[[CacheEntry], bool]) -> CacheEntry | None:
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

    def describe(self) -> dict:
        now = time.time()
        return {
            "n_entries": len(self.entries),
            "n_bytes": self.nbytes,
            "n_tokens": self.n_tokens,
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
                for e in list(self.entries)
            ],
        }
