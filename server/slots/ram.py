"""The engine's side of the RAM prompt cache: moving slot states in and out of it.

The cache (server.cache.prompt_cache) decides what to keep; these functions copy bytes between
llama.cpp and the cache on the engine thread, and keep slot bookkeeping true.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .slot import Slot

if TYPE_CHECKING:
    from .engine import Engine


def save(e: Engine, slot: Slot) -> bool:
    """Copy an idle slot's state into the RAM cache (the slot keeps it too)."""
    if e.cache is None or not slot.tokens:
        return False
    size = e.b.state_size(slot.id)
    out = e.cache.save(
        slot.tokens, size, lambda: e.b.state_get(slot.id, size=size), list(slot.checkpoints)
    )
    return out.saved


def load(e: Engine, slot: Slot, prompt: list[int]) -> bool:
    """Restore the best cache entry for ``prompt`` into ``slot``; True when one was loaded.

    The entry is removed from the cache when loaded; a failed restore leaves it there and the
    slot empty.
    """
    choice = e.cache.find(slot.tokens, prompt)
    if choice is None:
        e.cache.counters.misses += 1
        return False

    def restore(entry) -> bool:
        return e.b.state_set(slot.id, entry.data) == len(entry.data)

    entry = e.cache.take(choice, restore)
    if entry is None:
        clear(e, slot)  # a failed restore may have left part of the state behind
        return False
    slot.tokens = entry.tokens
    slot.checkpoints = entry.checkpoints
    return True


def clear(e: Engine, slot: Slot) -> None:
    e.b.seq_clear(slot.id)
    slot.tokens = []
    slot.checkpoints = []


def cache_idle_slots(e: Engine) -> None:
    """--cache-idle-slots: save every idle slot; in unified KV also clear it (its cells go
    back to the shared pool)."""
    for s in e.slots:
        if s.idle and s.tokens:
            save(e, s)
            if e.b.kv_unified:
                clear(e, s)
    e.cache.update()


def evict_idle(e: Engine, slot: Slot) -> None:
    """An idle slot is about to lose its KV: keep it in the RAM cache when there is one."""
    if e.cache is not None:
        save(e, slot)
        e.cache.update()
    clear(e, slot)
