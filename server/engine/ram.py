"""The slots' side of the RAM prompt cache: moving slot states in and out of it.

The cache (server.tiers.prompt_cache) decides what to keep; these functions move snapshots
between the slot store and the cache on the engine thread. The store keeps slot bookkeeping
true.
"""

from __future__ import annotations

from ..kv.store import SlotStore
from ..prefix.prefix_index import Match, SlotBaseline
from ..slot.slot import Slot
from ..tiers.prompt_cache import LoadChoice, PromptCache
from ..tiers.tenancy import is_private


def save(store: SlotStore, cache: PromptCache, slot: Slot) -> bool:
    """Copy an idle slot's state into the RAM cache (the slot keeps it too). Not a private
    tenant's (one salt-less request's under --cache-isolation salt): no later request can
    match it, so it would only push out entries that can."""
    if not slot.tokens or is_private(slot.tenant):
        return False
    return cache.put(store.snapshot(slot)).saved


def save_run(store: SlotStore, cache: PromptCache, slot: Slot) -> bool:
    """Keep a running slot's state (a preempted run's, engine/preempt.py) in the RAM cache,
    whoever's tenant it is (the run itself comes back for it); True when the cache holds it
    (saved, or covered by a longer entry of its tenant)."""
    if not slot.tokens:
        return False
    out = cache.put(store.snapshot(slot))
    cache.update()
    return out.saved or out.reason == "covered"


def find(cache: PromptCache, match: Match, held: SlotBaseline) -> LoadChoice | None:
    """The best cache entry for the prompt ``match`` walked down the cache's index
    (ARCHITECTURE §7's rule) that beats what the slot already ``held``; a miss is counted."""
    choice = cache.find(match, held)
    if choice is None:
        cache.counters.misses += 1
    return choice


def take(store: SlotStore, cache: PromptCache, slot: Slot, choice: LoadChoice) -> bool:
    """Restore the chosen entry into ``slot``: removed from the cache when loaded; a failed
    restore leaves it there and the slot empty."""
    # our own memory: trusted (the slot takes the entry's tenant with it)
    got = cache.take(choice, lambda e: store.restore(slot, e, trusted=True).ok)
    if got is None:
        return False
    store.recycle(got)  # out of the cache and loaded: its bytes are the next copy's
    return True


def cache_idle_slots(store: SlotStore, cache: PromptCache, unified: bool) -> None:
    """--cache-idle-slots: save every idle slot; in unified KV also clear it (its cells go
    back to the shared pool)."""
    for s in store.slots:
        if s.idle and s.tokens:
            save(store, cache, s)
            if unified:
                store.clear(s)
    cache.update()


def evict_idle(store: SlotStore, cache: PromptCache | None, slot: Slot) -> None:
    """An idle slot is about to lose its KV: keep it in the RAM cache when there is one."""
    if cache is not None:
        save(store, cache, slot)
        cache.update()
    store.clear(slot)
