"""The slots' side of the disk tier (server.cache.disk): restoring entries into slots and
spilling slots and the RAM cache to disk at shutdown. Engine thread only.

A disk file is untrusted (another process, or another replica, may have written it): it is
read through a private mapping (slot_file.read_file bound-checks the header) and restored
with SlotStore.restore(..., untrusted=True), which proves the state's cells are exactly the
file's token positions before llama.cpp sees them. An entry still waiting for the writer
is our own memory and is restored like a RAM-cache entry.
"""

from __future__ import annotations

import logging
import time

from ..cache import slot_file
from ..cache.disk import DiskTier
from ..cache.disk_files import DiskEntry
from ..cache.prompt_cache import CacheEntry, PromptCache
from .slot import Slot
from .store import SlotStore

log = logging.getLogger("server.slots.disk")


def load(store: SlotStore, disk: DiskTier, slot: Slot, prompt: list[int], tenant: str) -> bool:
    """Restore ``tenant``'s best disk entry for ``prompt`` into ``slot``; True when one was
    loaded (the slot then holds the entry's tokens and checkpoints). A failed restore leaves
    the slot empty and forgets the entry."""
    hit = disk.find(prompt, tenant, slot.tokens, own=slot.tenant == tenant)
    if hit is None:
        return False
    t0 = time.perf_counter()
    if hit.pending is not None:
        p = hit.pending
        ok = store.restore(slot, p.data, list(p.tokens), p.checkpoints) > 0
        nbytes, why, refuse = 0, "its queued state did not restore", False
    else:
        assert hit.entry is not None
        ok, nbytes, why, refuse = _restore_file(store, disk, slot, hit.entry)
    if not ok:
        disk.failed(hit, why, refuse)
        return False
    slot.tenant = tenant
    ms = (time.perf_counter() - t0) * 1e3
    disk.loaded(hit, ms, nbytes)
    log.debug("slot %d: %d tokens from the disk cache in %.1f ms", slot.id, len(hit.tokens), ms)
    return True


def _restore_file(
    store: SlotStore, disk: DiskTier, slot: Slot, e: DiskEntry
) -> tuple[bool, int, str, bool]:
    """(loaded, bytes read, why not, whether the file itself is bad)."""
    try:
        parsed = slot_file.read_file(
            disk.path_of(e), slot.n_ctx, disk.check.n_vocab, slot.id, disk.check.version
        )
    except slot_file.SlotFileError as err:
        return False, 0, str(err), err.status != 404
    except OSError as err:  # removed by another replica meanwhile
        return False, 0, f"unreadable: {err.strerror or err}", False
    if parsed.tokens != e.tokens or len(parsed.buf) != e.nbytes:
        return False, 0, "the file changed since it was indexed", True
    # the state and the appendices, not the trailer
    app = store.restore_file(
        slot, parsed.buf, parsed.state_off, e.body_len, list(e.tokens), exact=False
    )
    if app is None:
        return False, 0, "its state does not match its tokens (refused before loading)", True
    for w in app.warnings:
        log.warning("disk cache entry %s: %s", e.name, w)
    return True, e.nbytes, "", False


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
        try:
            data = snap.read()
        except MemoryError:
            log.warning("slot %d: no memory to copy its state for the disk cache", s.id)
            continue
        e = CacheEntry(list(snap.tokens), data, b"", list(snap.checkpoints), tenant=s.tenant)
        n += disk.put(e, spill=True)
    return n
