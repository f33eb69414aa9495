"""The slots' side of the disk tier (server.tiers.disk): restoring entries into slots and
spilling slots and the RAM cache to disk at shutdown. Engine thread only.

A disk file is untrusted (another process, or another replica, may have written it): it is
read with pread into one buffer (DiskTier.read: never a mapping, which another process
truncating the file would turn into a SIGBUS; a file truncated or rewritten by then, or
while read, is a miss) and restored as a SavedState in that buffer with
SlotStore.restore(..., trusted=False), which proves the state's cells are exactly the
file's token positions before llama.cpp sees them. An entry still waiting for the writer
is our own memory and is restored like a RAM-cache entry (trusted).
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import NamedTuple

from ..kv.store import SlotStore
from ..prefix.prefix_index import Match, SlotBaseline
from ..slot.slot import Slot
from ..tiers.disk import DiskHit, DiskTier
from ..tiers.disk_files import BadFile, DiskEntry, EntryChanged
from ..tiers.prompt_cache import PromptCache
from ..tiers.saved import InSlot

log = logging.getLogger("server.engine.disk_glue")


class _Outcome(NamedTuple):
    ok: bool
    nbytes: int = 0  # bytes read from disk
    why: str = ""
    refuse: bool = False  # the file itself is bad: never index it again
    changed: bool = False  # truncated or rewritten by another process since indexed


def load(
    store: SlotStore,
    disk: DiskTier,
    slot: Slot,
    prompt: list[int],
    tenant: str,
    held: SlotBaseline | None = None,
    match: Match | None = None,
) -> bool:
    """Restore ``tenant``'s best disk entry for ``prompt`` into ``slot``; True when one was
    loaded (the slot then holds the entry's tokens and checkpoints). A failure forgets the
    entry; a refused state leaves the slot empty, a file that could not be read leaves the
    slot as it was. ``held``: what the slot holds of the prompt, which the entry must beat
    (default: nothing, as an empty slot); ``match``: the prompt's walk down the prefix index
    (the RAM lookup's)."""
    hit = disk.find(prompt, tenant, SlotBaseline() if held is None else held, match)
    return hit is not None and load_hit(store, disk, slot, hit, tenant)


def load_hit(store: SlotStore, disk: DiskTier, slot: Slot, hit: DiskHit, tenant: str) -> bool:
    """Restore the entry ``disk.find`` chose into ``slot`` (see ``load``)."""
    t0 = time.perf_counter()
    if hit.pending is not None:
        # the target state and checkpoints (its draft state is not restored from the queue)
        p = replace(hit.pending, tokens=list(hit.pending.tokens), data_dft=b"")
        ok = store.restore(slot, p, trusted=True).ok
        out = _Outcome(ok, why="" if ok else "its queued state did not restore")
    else:
        assert hit.entry is not None
        out = _load_file(store, disk, slot, hit.entry)
    if not out.ok:
        disk.failed(hit, out.why, out.refuse, out.changed)
        return False
    slot.tenant = tenant
    ms = (time.perf_counter() - t0) * 1e3
    disk.loaded(hit, ms, out.nbytes)
    log.debug("slot %d: %d tokens from the disk cache in %.1f ms", slot.id, len(hit.tokens), ms)
    return True


def _load_file(store: SlotStore, disk: DiskTier, slot: Slot, e: DiskEntry) -> _Outcome:
    """Read ``e``'s file into one buffer and restore it (its cells proven first)."""
    try:
        state = disk.read(e, slot.id)
    except EntryChanged as err:  # truncated or rewritten by another process
        return _Outcome(False, why=str(err), changed=True)
    except BadFile as err:
        return _Outcome(False, why=str(err), refuse=True)
    except OSError as err:  # removed by another replica meanwhile
        return _Outcome(False, why=f"unreadable: {err.strerror or err}")
    except MemoryError:
        return _Outcome(False, why="no memory to read it")
    if not store.restore(slot, state, trusted=False).ok:
        why = "its state does not match its tokens (refused before loading)"
        return _Outcome(False, why=why, refuse=True)
    for w in state.warnings:
        log.warning("disk cache entry %s: %s", e.name, w)
    return _Outcome(True, nbytes=e.nbytes)


def spill(store: SlotStore, cache: PromptCache | None, disk: DiskTier) -> int:
    """Queue the RAM cache's entries (oldest first) and every idle slot's state for the
    disk tier, for a warm restart; returns how many were queued. Entries already on disk
    are skipped by the writer."""
    n = 0
    if cache is not None:
        n += sum(disk.put(e, spill=True) for e in list(cache.entries))
    for s in store.slots:
        if not s.idle or not s.tokens:
            continue
        snap = store.snapshot(s)
        # the target state only (as before: a spilled slot's draft state is not kept)
        assert isinstance(snap.data, InSlot)  # a snapshot reads the slot's KV
        snap.data = replace(snap.data, read_draft=None)
        try:
            e = snap.read()
        except MemoryError:
            log.warning("slot %d: no memory to copy its state for the disk cache", s.id)
            continue
        n += disk.put(e, spill=True)
    return n
