"""Pure decisions: which slot a task goes to and how much of a slot's KV it may keep.

Nothing here touches llama.cpp; the engine gathers the inputs and carries out the result.

What a slot holds of a prompt is the locator's answer (server.kv.locator: one match
over every holder, once per admission); nothing here computes a prefix.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from ..prefix.items import PromptItem
from . import images
from .locator import Holder, Match, held_len, match_holders


class SlotView(NamedTuple):
    id: int
    idle: bool
    tokens: Sequence[int]
    last_used: float
    tenant: str = ""


def match_views(slots: Sequence[SlotView], prompt: Sequence[PromptItem], tenant: str) -> Match:
    """The locator's match of ``prompt`` over ``slots`` (listed by id)."""
    return match_holders(tenant, prompt, [Holder(s.id, s.tokens, s.tenant) for s in slots])


@dataclass(frozen=True)
class SlotChoice:
    slot: int
    lcp: int
    by: str  # "id_slot" | "similarity" | "lru"
    # The slot is about to lose most of what it holds: keep it in the RAM cache first.
    save_first: bool

    @property
    def update_cache(self) -> bool:
        """Whether to consult the RAM cache: LRU picks always, others when context is lost."""
        return self.by == "lru" or self.save_first


def choose_slot(
    slots: Sequence[SlotView],
    prompt: Sequence[int],
    id_slot: int,
    similarity: float,
    tenant: str = "",
    match: Match | None = None,
) -> SlotChoice | None:
    """ARCHITECTURE §5. Returns None when the task must wait (no idle slot, or its slot is busy).
    What each slot holds of the prompt is read from ``match`` (the locator's, over
    ``slots``; taken here when not given): a slot holding another tenant's tokens matches
    nothing of the prompt."""
    if id_slot >= 0:
        s = slots[id_slot]
        if not s.idle:
            return None
        held = (match or match_views(slots, prompt, tenant)).held
        n = held[s.id]
        return SlotChoice(s.id, n, "id_slot", _loses_most(n, s.tokens) or not s.tokens)
    idle = [s for s in slots if s.idle]
    if not idle:
        return None
    held = (match or match_views(slots, prompt, tenant)).held
    if similarity > 0 and prompt:
        best: SlotChoice | None = None
        best_sim = -1.0
        for s in idle:
            if not s.tokens:
                continue
            n = held[s.id]
            sim = n / len(prompt)
            if sim > similarity and sim > best_sim:
                best_sim = sim
                best = SlotChoice(s.id, n, "similarity", _loses_most(n, s.tokens))
        if best is not None:
            return best
    # Least recently used; an empty slot counts as the least recently used of all.
    s = min(idle, key=lambda v: (bool(v.tokens), v.last_used))
    n = held[s.id]
    return SlotChoice(s.id, n, "lru", bool(s.tokens) and n < len(s.tokens))


# A slot about to lose at least this many tokens is saved first even when it keeps most of
# what it holds (llama-server saves only below f_keep 0.5). Computing them again costs far
# more than the copy (256 tokens of Gemma 3 270M: ~0.6 s of a laptop CPU; its state: ~5 ms),
# and it is what conversations need when there are more of them than slots and they share a
# long system prompt: each turn's slot keeps the system prompt of the one before (f_keep
# ~0.9) while that conversation's own turns would be lost (workload 16).
SAVE_LOST_TOKENS = 256


def _loses_most(n_lcp: int, tokens: Sequence[int]) -> bool:
    """Whether a slot keeping ``n_lcp`` of its ``tokens`` is saved to the RAM cache first:
    llama-server's f_keep < 0.5, or at least SAVE_LOST_TOKENS lost."""
    return bool(tokens) and (n_lcp / len(tokens) < 0.5 or len(tokens) - n_lcp >= SAVE_LOST_TOKENS)


class CheckpointView(NamedTuple):
    n_tokens: int
    pos_min: int
    pos_max: int


@dataclass(frozen=True)
class ReusePlan:
    """How much of a slot's KV a new prompt keeps.

    ``n_past`` tokens stay; everything after is removed. When ``checkpoint`` >= 0 that
    checkpoint is restored first (its n_tokens == n_past).
    """

    n_past: int
    checkpoint: int = -1
    reason: str = "lcp"


def window_intact(pos_min: int, n_past: int, n_swa: int) -> bool:
    """True when the sequence still holds every position the token at ``n_past`` attends to.

    llama.cpp masks key p0 for query p1 when p1 - p0 >= n_swa (is_masked_swa), so the token
    at ``n_past`` sees keys n_past - n_swa + 1 .. n_past; cells below ``pos_min`` are gone.
    The cut is usable iff pos_min <= max(0, n_past - n_swa + 1). This bound is tight on
    purpose: a live sequence under cache pressure, and so a state saved from it, holds only
    the cells its next token sees (positions >= len - n_swa + 1), and such a state must
    serve a cut at its own length.
    """
    if n_swa <= 0:
        return True
    return pos_min <= max(0, n_past - n_swa + 1)


def plan_reuse(
    slot_tokens: Sequence[int],
    prompt: Sequence[int],
    *,
    cache_prompt: bool,
    pos_min: int,
    n_swa: int,
    checkpoints: Sequence[CheckpointView] = (),
    n_lcp: int | None = None,
    recurrent: bool = False,
) -> ReusePlan:
    """ARCHITECTURE §4: LCP reuse, the last prompt token always re-evaluated, SWA guarded.

    ``pos_min`` is the sequence's lowest position still in memory (-1 when empty).
    Recurrent (and hybrid) memory holds only its latest state: any cut short of the
    slot's whole length needs a checkpoint.
    """
    if not cache_prompt or not slot_tokens or not prompt:
        return ReusePlan(0, reason="off" if not cache_prompt else "empty")
    n = held_len(slot_tokens, prompt) if n_lcp is None else n_lcp
    if n >= len(prompt):
        n = len(prompt) - 1  # logits are needed for the last prompt token
    n = images.outside(prompt, n)  # never keep part of an image
    if n <= 0:
        return ReusePlan(0, reason="no-match")
    if pos_min < 0:
        return ReusePlan(0, reason="empty-seq")
    if window_intact(pos_min, n, n_swa) and not (recurrent and n < len(slot_tokens)):
        return ReusePlan(n)
    # The window behind the cut is gone: fall back to the newest usable checkpoint.
    for i in range(len(checkpoints) - 1, -1, -1):
        c = checkpoints[i]
        if 0 < c.n_tokens <= n and window_intact(c.pos_min, c.n_tokens, n_swa):
            return ReusePlan(c.n_tokens, checkpoint=i, reason="checkpoint")
    return ReusePlan(0, reason="swa-reset")
