"""Disk tier under the RAM prompt cache (issue 17): entries evicted from RAM go to files.

Policy and file handling only; the engine-side glue (server.engine.disk_glue) moves states
between slots and this tier.

Files: one entry per file, in the slot-file format plus a trailer naming its tenant and
model, written whole (temporary name, then rename); see server.tiers.disk_files.

Index. Kept in memory from the files' headers (tokens) and trailers (tenant), never from
their states; oldest first by (mtime, name), which is also the eviction order (FIFO by
bytes). Files and queued entries are registered in the prefix index
(server.prefix.prefix_index, shared with the RAM cache): lookups, the writer's covered check
and its replaced prefixes walk the prompt down that tree, never scan the entries. The
scanner and writer threads change it under this tier's lock (and the tree's own); the
engine thread's lookups take a snapshot of the prompt's path.

A scanner thread rescans the directory (never the engine thread): when a lookup
misses and the directory changed (its mtime moved, one stat) or ``rescan_s`` passed, and
every ``poll_s`` on its own, so entries another replica wrote are found and files another
replica evicted are forgotten. A scan is incremental: one listing, set differences against
the names it knows, and a header read only for new names matching the entry pattern; other
names (junk, however many) are ignored unread. A missing lookup waits for the scan it asked
for at most ``sync_scan_s``, and not at all when the last scan took longer than that.

Hostile files (not regular files, symlinks, truncated, wrong magic or version, lengths the
file cannot hold, tokens outside the vocabulary, another model's) are skipped and counted,
never loaded. A file that passes here still has its state proven cell by cell before it is
loaded (SlotStore.restore(..., trusted=False)), and it is read with pread into one
buffer (disk_files.read_entry), never mapped: a file another process truncates or rewrites
under the reader is a miss (``changed_files``), never a SIGBUS.
"""

from __future__ import annotations

import bisect
import collections
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from ..prefix.prefix_index import Held, Match, PrefixIndex, SlotBaseline
from . import tenancy
from .disk_files import (
    NAME_RE,
    READ_DELAY_ENV,
    WRITE_DELAY_ENV,
    BadFile,
    DiskEntry,
    FileCheck,
    clean_temp_files,
    encode_trailer,
    read_entry,
    read_header,
    write_entry,
)
from .saved import Extras, InBuffer, SavedState
from .tenancy import persistable

log = logging.getLogger("server.tiers.disk")

MiB = 1024 * 1024
# A scan indexes new files this many at a time, so that the engine thread's lookups never
# wait on the lock for a whole directory's worth of tree inserts (tens of microseconds each).
_ADD_CHUNK = 64


@dataclass(eq=False)
class DiskHeld(Held):
    """A file of the tier in the prefix index; ``order`` is ``(0, mtime_ns, name)``: the
    index's order, before every queued entry."""

    TIER: ClassVar[str] = "disk"
    entry: DiskEntry


@dataclass(eq=False)
class QueuedHeld(Held):
    """An entry waiting for the writer, in the prefix index; ``order`` is ``(1, seq)``:
    after every file (queued entries are newer than any file of theirs), in queue order."""

    TIER: ClassVar[str] = "disk-queue"
    entry: SavedState


class DiskIndex:
    """The tier's entries in memory, oldest first by (mtime, name), and registered in the
    prefix index (``tree``; shared with the RAM cache, or its own). No I/O; the tier's
    lock guards it (the tree has its own as well)."""

    def __init__(self, tree: PrefixIndex | None = None) -> None:
        self.tree = PrefixIndex() if tree is None else tree
        self.entries: list[DiskEntry] = []
        self._keys: list[tuple[int, str]] = []
        self.by_name: dict[str, DiskEntry] = {}
        self._held: dict[str, DiskHeld] = {}
        self.nbytes = 0

    def add(self, e: DiskEntry) -> None:
        if e.name in self.by_name or not e.tokens:
            return
        i = bisect.bisect(self._keys, e.key)
        self._keys.insert(i, e.key)
        self.entries.insert(i, e)
        self.by_name[e.name] = e
        h = self._held[e.name] = DiskHeld(e.tenant, (0, *e.key), e)
        self.tree.add(h, e.tokens)
        self.nbytes += e.nbytes

    def remove(self, name: str) -> DiskEntry | None:
        e = self.by_name.pop(name, None)
        if e is not None:
            i = bisect.bisect_left(self._keys, e.key)
            del self._keys[i], self.entries[i]
            self.tree.discard(self._held.pop(name))
            self.nbytes -= e.nbytes
        return e

    def covers(self, tokens: list[int], tenant: str) -> bool:
        """An entry of ``tenant`` holds ``tokens`` (or more that start with them)."""
        return self.tree.covers(DiskHeld.TIER, tenant, tokens)

    def prefixes_of(self, tokens: list[int], tenant: str, but: str = "") -> list[DiskEntry]:
        """Entries of ``tenant`` that ``tokens`` extend (a new entry serves them too)."""
        held = self.tree.prefixes_of(DiskHeld.TIER, tenant, tokens)
        return [h.entry for h in held if h.entry.name != but]

    def over_limit(self, limit_bytes: int) -> list[DiskEntry]:
        """Remove oldest-first until the bytes fit ``limit_bytes``; returns those removed."""
        out = []
        while self.entries and self.nbytes > limit_bytes:
            out.append(self.remove(self.entries[0].name))
        return [e for e in out if e is not None]

    def find(
        self, prompt: list[int], tenant: str, best_keep: float, best_sim: float
    ) -> tuple[DiskEntry, int] | None:
        """The RAM cache's rule (server.prefix.prefix_index.Match.best): the entry of
        ``tenant`` that beats (best_keep, best_sim) on both, skipping entries sharing less
        than a quarter of themselves with the prompt."""
        if not prompt:
            return None
        hit = self.tree.match(tenant, prompt).best((DiskHeld.TIER,), best_keep, best_sim)
        return None if hit is None else (hit.held.entry, hit.n_lcp)

    def check_integrity(self) -> list[str]:
        """The tree's invariants, and that it holds exactly these entries."""
        problems = self.tree.check_integrity()
        held = self.tree.holders(DiskHeld.TIER)
        if sorted(h.entry.name for h in held) != sorted(self.by_name):
            problems.append("the prefix index does not hold exactly the indexed files")
        for name, h in self._held.items():
            if h.entry is not self.by_name.get(name) or self.tree.path_of(h) != h.entry.tokens:
                problems.append(f"{name}: not indexed under its tokens")
        if [e.key for e in self.entries] != self._keys or self._keys != sorted(self._keys):
            problems.append("entries out of (mtime, name) order")
        if sum(e.nbytes for e in self.entries) != self.nbytes:
            problems.append("bytes != sum of entries")
        return problems


@dataclass
class DiskCounters:
    hits: int = 0  # lookups that restored an entry into a slot
    misses: int = 0
    load_failures: int = 0  # chosen, but its file was gone or its state was refused
    changed_files: int = 0  # chosen, but truncated or rewritten (by another process) by then
    writes: int = 0
    bytes_written: int = 0
    write_failures: int = 0
    write_drops: int = 0  # the writer was too far behind, or the tier closing
    covered: int = 0  # not written: an entry on disk already holds those tokens
    too_large: int = 0
    evictions: int = 0  # removed for the byte limit
    replaced: int = 0  # removed because a newer entry extends it
    bad_files: int = 0  # hostile or damaged files skipped (each counted once)
    foreign_files: int = 0  # another model's entries
    temp_files_removed: int = 0
    scans: int = 0
    bytes_read: int = 0
    load_ms_total: float = 0.0
    load_ms_last: float = 0.0
    lookup_ms_max: float = 0.0  # the longest lookup (engine thread), file reads apart


@dataclass
class DiskHit:
    """A lookup's choice: a file, or an entry still waiting for the writer (in memory)."""

    n_lcp: int
    entry: DiskEntry | None = None
    pending: SavedState | None = None

    @property
    def tokens(self) -> list[int]:
        if self.entry is not None:
            return self.entry.tokens
        assert self.pending is not None  # one of the two is set
        return self.pending.tokens


@dataclass
class _Queue:
    items: collections.deque[SavedState] = field(default_factory=collections.deque)
    # parallel to ``items``: each one's holder in the prefix index (None: no tokens)
    held: collections.deque[QueuedHeld | None] = field(default_factory=collections.deque)
    nbytes: int = 0
    writing: SavedState | None = None
    seq: int = 0


class DiskTier:
    """The disk tier: index, background writer, FIFO eviction by bytes, rescans.

    ``put`` (any thread) queues an entry for the writer; ``find`` (the engine thread) looks
    in the index and in the queue; the glue restores what it returns and reports with
    ``loaded`` / ``failed``. ``limit_bytes`` bounds the directory's entries (all replicas'
    that this one knows of).
    """

    def __init__(
        self,
        directory: str | Path,
        limit_bytes: int,
        check: FileCheck,
        *,
        rescan_s: float = 1.0,
        poll_s: float | None = None,
        sync_scan_s: float = 0.1,
        max_pending_bytes: int | None = None,
        write_delay_s: float | None = None,
        read_delay_s: float | None = None,
        index: PrefixIndex | None = None,
    ) -> None:
        self.dir = Path(directory)
        self.limit_bytes = limit_bytes
        self.check = check
        self.rescan_s = rescan_s
        self.poll_s = max(0.25, rescan_s) if poll_s is None else poll_s
        self.sync_scan_s = sync_scan_s
        # entries evicted from RAM wait here beyond --cache-ram: keep that bounded
        self.max_pending_bytes = max_pending_bytes or min(limit_bytes, 1024 * MiB)
        if write_delay_s is None:
            write_delay_s = float(os.environ.get(WRITE_DELAY_ENV, "0") or 0)
        self.write_delay_s = write_delay_s
        if read_delay_s is None:
            read_delay_s = float(os.environ.get(READ_DELAY_ENV, "0") or 0)
        self.read_delay_s = read_delay_s
        self.index = DiskIndex(index)
        self.counters = DiskCounters()
        self.bad: dict[str, tuple[int, int]] = {}  # name -> (size, mtime_ns) when refused
        self.last_bad: collections.deque[str] = collections.deque(maxlen=8)
        self._q = _Queue()
        self._lock = threading.Lock()  # index, counters' shared fields, queue
        self._cond = threading.Condition(self._lock)
        self._scan_lock = threading.Lock()  # one scan at a time
        self._last_scan = 0.0
        self._last_scan_s = 0.0  # how long the last scan took
        self._scans_begun = 0  # under _lock: a lookup waits for a scan begun after it asked
        self._scans_done = 0
        self._dir_mtime = -1  # the directory's mtime when last scanned
        self._junk: set[str] = set()  # listed names that are no entry's: never read
        self._wake = threading.Event()  # a lookup asks the scanner for a scan
        self._closing = False
        self._thread: threading.Thread | None = None
        self._scanner: threading.Thread | None = None

    # ---- life ---------------------------------------------------------------------

    def start(self) -> None:
        """Create the directory, remove dead writers' temporary files, index what is there,
        start the writer."""
        self.dir.mkdir(parents=True, exist_ok=True)
        self.counters.temp_files_removed += clean_temp_files(self.dir)
        self.scan()
        self._thread = threading.Thread(target=self._run, name="disk-cache", daemon=True)
        self._thread.start()
        self._scanner = threading.Thread(
            target=self._scan_loop, name="disk-cache-scan", daemon=True
        )
        self._scanner.start()
        log.info(
            "disk cache %s: %d entries, %.1f MiB (limit %.0f MiB), %d bad files skipped",
            self.dir,
            len(self.index.entries),
            self.index.nbytes / MiB,
            self.limit_bytes / MiB,
            self.counters.bad_files,
        )

    def flush(self, timeout: float) -> bool:
        """Wait until every queued entry is written (or ``timeout`` passes); True if so."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._q.items or self._q.writing is not None:
                left = deadline - time.monotonic()
                if left <= 0 or self._thread is None or not self._thread.is_alive():
                    return False
                self._cond.wait(left)
        return True

    def close(self, timeout: float = 5.0) -> None:
        """Stop the writer; what is still queued after ``timeout`` is dropped (a half-written
        file is a temporary file, never an entry)."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        if self._scanner is not None:
            self._scanner.join(timeout)

    # ---- writing ------------------------------------------------------------------

    def put(self, entry: SavedState, spill: bool = False) -> bool:
        """Queue an entry leaving RAM (any thread; takes the entry's buffers as they are).
        False when it is dropped: too large for the tier, or the writer too far behind
        (``max_pending_bytes``; not for a ``spill`` at shutdown, whose buffers are held
        anyway), or one request's private tenant (never persisted: tiers/tenancy.py)."""
        if not persistable(entry.tenant):
            return False
        with self._cond:
            if entry.nbytes > self.limit_bytes:
                self.counters.too_large += 1
                return False
            behind = self._q.nbytes + entry.nbytes > self.max_pending_bytes
            if self._closing or (behind and not spill):
                self.counters.write_drops += 1
                return False
            self._q.items.append(entry)
            self._q.nbytes += entry.nbytes
            self._q.seq += 1
            h = QueuedHeld(entry.tenant, (1, self._q.seq), entry) if entry.tokens else None
            if h is not None:
                self.index.tree.add(h, entry.tokens)
            self._q.held.append(h)
            self._cond.notify_all()
        return True

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._q.items and not self._closing:
                    self._cond.wait()
                if self._closing and not self._q.items:
                    return
                entry = self._q.items[0]
                self._q.writing = entry
            try:
                self._write(entry)
            except Exception:
                log.exception("disk cache writer")
            finally:
                with self._cond:
                    self._q.items.popleft()
                    h = self._q.held.popleft()
                    if h is not None:
                        self.index.tree.discard(h)
                    self._q.nbytes -= entry.nbytes
                    self._q.writing = None
                    self._cond.notify_all()

    def _write(self, entry: SavedState) -> None:
        with self._lock:
            if self.index.covers(entry.tokens, entry.tenant):
                self.counters.covered += 1
                return
        t0 = time.perf_counter()
        try:
            name, size, mtime = write_entry(
                self.dir,
                entry,
                self.check.version,
                self.check.model,
                self.write_delay_s,
                self.check.projector,
            )
        except (OSError, ValueError) as err:
            self.counters.write_failures += 1
            log.warning("disk cache: writing %d tokens failed: %s", len(entry.tokens), err)
            return
        e = DiskEntry(
            name, list(entry.tokens), entry.tenant, size, size - self._trailer_len(entry), mtime
        )
        with self._lock:
            self.index.add(e)
            self.counters.writes += 1
            self.counters.bytes_written += size
            gone = self.index.prefixes_of(e.tokens, e.tenant, but=name)
            for old in gone:
                self.index.remove(old.name)
            self.counters.replaced += len(gone)
            evicted = self.index.over_limit(self.limit_bytes)
            self.counters.evictions += len(evicted)
        for old in gone + evicted:
            (self.dir / old.name).unlink(missing_ok=True)  # another replica may beat us to it
        log.debug(
            "disk cache: wrote %d tokens, %.1f MiB in %.0f ms (%d replaced, %d evicted)",
            len(e.tokens),
            size / MiB,
            (time.perf_counter() - t0) * 1e3,
            len(gone),
            len(evicted),
        )

    def _trailer_len(self, entry: SavedState) -> int:
        return len(encode_trailer(entry.tenant, self.check.model, 0))

    # ---- indexing -----------------------------------------------------------------

    def _scan_loop(self) -> None:
        """The scanner thread: a scan when a lookup asks for one, else every ``poll_s`` when
        the directory changed or ``rescan_s`` passed (other replicas' entries)."""
        while not self._closing:
            asked = self._wake.wait(self.poll_s)
            self._wake.clear()
            if self._closing:
                return
            if asked or self._stale():
                try:
                    self.scan()
                except Exception:
                    log.exception("disk cache scanner")

    def scan(self) -> int:
        """Index new entry files, forget vanished ones; returns how many were added. One
        listing; only new names matching the entry pattern are examined (headers only),
        other names are remembered as junk, never read, logged or counted one by one. One
        scan at a time: a call while another runs waits, then lists again."""
        with self._scan_lock:
            with self._cond:
                self._scans_begun += 1
            t0 = time.monotonic()
            try:
                return self._scan_once(t0)
            finally:
                self._last_scan_s = time.monotonic() - t0
                with self._cond:
                    self._scans_done += 1
                    self._cond.notify_all()

    def _scan_once(self, t0: float) -> int:
        self._last_scan = t0
        try:
            self._dir_mtime = os.stat(self.dir).st_mtime_ns  # before listing: no gap
            names = set(os.listdir(self.dir))
        except OSError as err:
            log.warning("disk cache: cannot list %s: %s", self.dir, err)
            return 0
        self._junk &= names  # set operations: 20,000 junk names cost milliseconds
        with self._lock:
            self.counters.scans += 1
            for gone in [n for n in self.index.by_name if n not in names]:
                self.index.remove(gone)
            for gone in [n for n in self.bad if n not in names]:
                del self.bad[gone]  # refused files that were removed: forget them too
            fresh = names.difference(self.index.by_name, self._junk)
        junk = {n for n in fresh if NAME_RE.match(n) is None}  # temporary files too
        self._junk |= junk
        added = [e for e in map(self._examine, sorted(fresh - junk)) if e is not None]
        for i in range(0, len(added), _ADD_CHUNK):  # lookups wait for one chunk at most
            with self._lock:
                for e in added[i : i + _ADD_CHUNK]:
                    self.index.add(e)
        with self._lock:
            evicted = self.index.over_limit(self.limit_bytes)
            self.counters.evictions += len(evicted)
        for old in evicted:
            (self.dir / old.name).unlink(missing_ok=True)
        return len(added)

    def _examine(self, name: str) -> DiskEntry | None:
        """One new name matching the entry pattern: an entry, or None (refused and counted)."""
        try:
            st = os.lstat(self.dir / name)
        except OSError:
            return None
        seen = (st.st_size, st.st_mtime_ns)
        if self.bad.get(name) == seen:
            return None  # refused before and unchanged: counted once
        try:
            if st.st_size > self.limit_bytes:  # would evict every other entry to fit
                raise BadFile(f"{st.st_size} bytes, more than the whole tier")
            return read_header(self.dir, name, self.check)
        except BadFile as e:
            self._refuse(name, seen, str(e), e.foreign)
            return None

    def _refuse(self, name: str, seen: tuple[int, int], why: str, foreign: bool = False) -> None:
        with self._lock:  # scans iterate ``bad`` under the lock
            self.bad[name] = seen
            if foreign:
                self.counters.foreign_files += 1
            else:
                self.counters.bad_files += 1
                self.last_bad.append(f"{name[:80]}: {why}")
        log.log(
            logging.DEBUG if foreign else logging.WARNING,
            "disk cache: skipped %r: %s",
            name[:80],
            why,
        )

    # ---- lookups (engine thread) --------------------------------------------------

    def find(
        self, prompt: list[int], tenant: str, slot: SlotBaseline, match: Match | None = None
    ) -> DiskHit | None:
        """The best entry of ``tenant`` for ``prompt`` that beats ``slot``'s own state, in
        the queue or on disk; on a miss when the directory may have changed, the scanner is
        asked for a scan, waited for at most ``sync_scan_s`` (never a listing on this
        thread), and the index looked at again. Counts a miss; hits are counted by
        ``loaded``. ``match``: the prompt already walked down the prefix index for
        ``tenant`` (the RAM cache's walk, when the tiers share one index)."""
        if not prompt:
            return None
        t0 = time.perf_counter()
        hit = self._find(prompt, tenant, slot, match)
        if hit is None and self._stale() and self._refresh():
            hit = self._find(prompt, tenant, slot)  # the scan changed the tree: walk again
        ms = (time.perf_counter() - t0) * 1e3
        with self._lock:
            self.counters.misses += hit is None
            self.counters.lookup_ms_max = max(self.counters.lookup_ms_max, ms)
        return hit

    def _refresh(self) -> bool:
        """Ask the scanner for a scan and wait for it at most ``sync_scan_s``: not at all
        when the last scan took longer (a huge directory: the miss stands, the index catches
        up off this thread) or no scanner runs. True when a scan begun after asking ended."""
        with self._cond:
            target = self._scans_begun + 1
        self._wake.set()
        if self._scanner is None or self._last_scan_s > self.sync_scan_s:
            return False
        with self._cond:
            return self._cond.wait_for(lambda: self._scans_done >= target, self.sync_scan_s)

    def _stale(self) -> bool:
        """Whether the directory may hold files the index lacks: its mtime moved (a file was
        renamed in or removed; one stat call), or ``rescan_s`` passed (filesystems whose
        directory mtime lags, such as NFS with attribute caching)."""
        if time.monotonic() - self._last_scan >= self.rescan_s:
            return True
        try:
            return os.stat(self.dir).st_mtime_ns != self._dir_mtime
        except OSError:
            return False

    def _find(
        self, prompt: list[int], tenant: str, slot: SlotBaseline, match: Match | None = None
    ) -> DiskHit | None:
        """One walk of the prompt down the prefix index (none when ``match`` is this
        index's), then the rule over the files and the queue together (files first, by
        (mtime, name), then the queue in order)."""
        with self._lock:
            if match is None or match.index is not self.index.tree:
                match = self.index.tree.match(tenant, prompt)
            hit = match.beating((DiskHeld.TIER, QueuedHeld.TIER), slot)
        if hit is None:
            return None
        if isinstance(hit.held, QueuedHeld):
            return DiskHit(hit.n_lcp, pending=hit.held.entry)
        return DiskHit(hit.n_lcp, entry=hit.held.entry)

    def read(self, e: DiskEntry, seq: int) -> SavedState:
        """``e``'s file read into one buffer for sequence ``seq``, as a saved state
        (``InBuffer``: the state and its appendices, not the trailer; the appendices are
        read where the state ends, once it is loaded); raises as disk_files.read_entry does
        (EntryChanged, BadFile, OSError)."""
        buf, state_off = read_entry(self.dir, e, self.check, seq, self.read_delay_s)
        where = InBuffer(buf, state_off, e.body_len, exact=False)
        return SavedState(list(e.tokens), where, tenant=e.tenant, extras=Extras.AFTER_STATE)

    def loaded(self, hit: DiskHit, ms: float, nbytes: int) -> None:
        with self._lock:
            self.counters.hits += 1
            self.counters.bytes_read += nbytes
            self.counters.load_ms_total += ms
            self.counters.load_ms_last = ms

    def failed(self, hit: DiskHit, why: str, refuse: bool, changed: bool = False) -> None:
        """A chosen entry could not be loaded: forget it; with ``refuse`` (its state was
        refused) remember the file as bad so a rescan does not index it again; ``changed``:
        its file was truncated or rewritten since it was indexed (counted apart; a rescan
        examines it afresh)."""
        with self._lock:
            self.counters.load_failures += 1
            self.counters.misses += 1
            self.counters.changed_files += changed
        e = hit.entry
        if e is None:
            return
        with self._lock:
            self.index.remove(e.name)
        if refuse:
            self._refuse(e.name, (e.nbytes, e.mtime_ns), why)
        else:
            log.log(logging.WARNING if changed else logging.INFO, "disk cache: %s: %s", e.name, why)

    def check_integrity(self) -> list[str]:
        """The index's invariants (server.prefix.prefix_index), the files it holds, and the
        queue's entries in it."""
        with self._lock:
            problems = self.index.check_integrity()
            queued = self.index.tree.holders(QueuedHeld.TIER)
            mine = [h for h in self._q.held if h is not None]
            if {id(h) for h in queued} != {id(h) for h in mine}:
                problems.append("the prefix index does not hold exactly the queued entries")
        return problems

    # ---- reporting ----------------------------------------------------------------

    def describe(self, owner: str | None = None) -> dict:
        """Entries, totals, limits, counters and the write queue; any thread (under the
        tier's lock). ``owner``: only that tenant's entries (``tenancy.owner``), and totals
        of those."""
        now = time.time_ns()
        with self._lock:
            c = self.counters.__dict__.copy()
            entries = [
                e for e in self.index.entries if owner is None or tenancy.owner(e.tenant) == owner
            ]
            pending = len(self._q.items)
            pending_bytes = self._q.nbytes
            last_bad = list(self.last_bad)
            n_ignored = len(self._junk)
        return {
            "enabled": True,
            "dir": str(self.dir),
            "model": self.check.model,
            "n_entries": len(entries),
            "n_bytes": sum(e.nbytes for e in entries),
            "limit_bytes": self.limit_bytes,
            "n_pending": pending,
            "pending_bytes": pending_bytes,
            "counters": c,
            "bad_files": last_bad,
            "ignored_files": n_ignored,  # names that are no entry's (junk): never read
            "entries": [
                {
                    "name": e.name,
                    "n_tokens": len(e.tokens),
                    "n_bytes": e.nbytes,
                    "age_s": round((now - e.mtime_ns) / 1e9, 3),
                }
                for e in entries
            ],
        }
