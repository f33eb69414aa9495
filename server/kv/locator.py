"""One lookup: where the longest prefix of a prompt lives, over every holder (issue 41).

``Locator.match(key, prompt)`` answers once per admission, for every kind of holder
(each part computed on first read, so a placement pays only for what it consults):
- the slots' KV, idle and busy (``Match.held``: per slot, the items it holds of the prompt);
- the prompts being prefilled (``Match.inflight``: per prefilling slot, the items its
  prompt shares with this one, computed or not yet);
- the RAM and disk entries (``Match.tiers()``: the prefix index's walk, which each tier's
  rule reads; taken on first use, so a placement that never consults the caches never
  walks the tree, and one that saves its slot first finds that entry too).
Slot choice (``policy.choose_slot``), prefix sharing (``sharing.held_source`` and
``inflight_source``) and the tier loads (``ram.load``, ``disk_glue.load``) read it; none
computes a prefix itself (tests/unit/test_lookup_layout.py checks that no other module in
server/slots computes one against a slot's tokens, but the draft model's bookkeeping and
``--cache-reuse``'s chunk matcher).

Matching compares prompt *items* (server.prefix.items: a token, or an image as one item
with an identity) within one key (the tenant; nothing across keys): a match never ends
inside an item. The rule is the prefix index's (``shared_prefix``), so slots and entries
agree on what a prompt shares with a holder.

Slots are indexed as the tiers are (server.prefix.block_index): each slot's KV tokens and
each in-flight prompt are a path of full blocks in one trie, kept up to date as the slot's
tokens change (the slot store's ``Sequence`` tells it: an append costs the blocks it fills,
a cut the blocks it drops). A match walks the prompt's blocks down that trie once; what a
slot holds of it is then a bisection over the slot's blocks and one compare within a
block, so a match costs neither the slots' lengths nor anything per cached entry.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from ..prefix.block_index import BlockIndex, Path
from ..prefix.items import PromptItem, common_prefix
from ..prefix.prefix_index import Match as TierMatch
from ..prefix.prefix_index import PrefixIndex
from ..slot.slot import Slot, SlotState


class Holder(NamedTuple):
    """A slot as the locator sees it: what its KV holds (``tokens``, of ``tenant``) and the
    prompt it is prefilling (``inflight``, of ``inflight_tenant``; empty when none)."""

    id: int
    tokens: Sequence[PromptItem]
    tenant: str = ""
    inflight: Sequence[PromptItem] = ()
    inflight_tenant: str = ""


def holder_of(s: Slot) -> Holder:
    """``s`` as a holder: its prompt is in flight while it prefills."""
    task = s.task
    if s.state is SlotState.PREFILL and task is not None:
        return Holder(s.id, s.tokens, s.tenant, task.prompt, task.tenant)
    return Holder(s.id, s.tokens, s.tenant)


class PerSlot:
    """Per slot id, how many items of the prompt a holder kind of that slot shares,
    computed on first read and kept: a consumer pays only for the slots it reads (slot
    choice the idle ones, sharing the others), each once per match."""

    __slots__ = ("_of", "_memo")

    def __init__(self, n: int, of: Callable[[int], int]) -> None:
        self._of = of
        self._memo: list[int | None] = [None] * n

    def __len__(self) -> int:
        return len(self._memo)

    def __getitem__(self, i: int) -> int:
        v = self._memo[i]  # IndexError past the end ends iteration
        if v is None:
            v = self._memo[i] = self._of(i)
        return v

    def __iter__(self) -> Iterator[int]:
        return (self[i] for i in range(len(self._memo)))


@dataclass
class Match:
    """One prompt matched against every holder (see the module's docstring). ``held`` and
    ``inflight`` are indexed by slot id (0: nothing shared, another tenant's, or not
    prefilling), each read from the slot's tokens (prompt) as they are when first read;
    ``tiers()`` is the prefix index's walk (None without an index), taken once, on first
    use."""

    key: Hashable
    prompt: Sequence[PromptItem]
    held: PerSlot
    inflight: PerSlot
    index: PrefixIndex | None = None
    _tiers: TierMatch | None = field(default=None, repr=False)

    def tiers(self) -> TierMatch | None:
        if self._tiers is None and self.index is not None:
            self._tiers = self.index.match(self.key, self.prompt)
        return self._tiers


def held_len(tokens: Sequence[PromptItem], prompt: Sequence[PromptItem]) -> int:
    """What a slot holding ``tokens`` holds of ``prompt`` (one key): for callers that know
    the slot's tokens changed since their Match (a restore into it)."""
    return common_prefix(tokens, prompt)


def _inflight_id(slot_id: int) -> tuple[str, int]:
    return ("inflight", slot_id)


class Locator:
    """Matches prompts against ``slots`` (the engine's list, read live; their KV tokens
    indexed in ``blocks``, which their sequences keep up to date: kv/store.py) and
    ``index`` (the RAM and disk tiers' prefix index; None: no cache)."""

    def __init__(
        self,
        slots: Sequence[Slot] = (),
        index: PrefixIndex | None = None,
        blocks: BlockIndex | None = None,
    ) -> None:
        self.slots = slots
        self.index = index
        self.blocks = blocks
        # slot id -> the task whose prompt is indexed as in flight there (its id: no
        # reference kept to a finished task)
        self._inflight: dict[int, int] = {}

    def match(
        self,
        key: Hashable,
        prompt: Sequence[PromptItem],
        index: PrefixIndex | None = None,
        holders: Sequence[Holder] | None = None,
    ) -> Match:
        """``prompt`` of ``key`` against every holder: the slots (``holders`` when given,
        else this locator's slots) and the index (``index`` when given, else this
        locator's)."""
        ix = index if index is not None else self.index
        if holders is not None or self.blocks is None:
            hs = [holder_of(s) for s in self.slots] if holders is None else holders
            return match_holders(key, prompt, hs, ix)
        return self._live(key, prompt, self.blocks, ix)

    def match_slots(self, key: Hashable, prompt: Sequence[PromptItem]) -> Match:
        """The match over the slots alone (no tiers): admission's slot choice."""
        if self.blocks is None:
            return match_holders(key, prompt, [holder_of(s) for s in self.slots])
        return self._live(key, prompt, self.blocks, None)

    def _live(
        self,
        key: Hashable,
        prompt: Sequence[PromptItem],
        blocks: BlockIndex,
        ix: PrefixIndex | None,
    ) -> Match:
        """The match read from the slots' live block index."""
        slots, path = self.slots, Path(blocks, prompt)

        def held(i: int) -> int:
            s = slots[i]
            return blocks.shared(i, path.nodes(), prompt) if s.tenant == key else 0

        def inflight(i: int) -> int:
            s = slots[i]
            task = s.task if s.state is SlotState.PREFILL else None
            hid = _inflight_id(i)
            if task is None:
                if self._inflight.pop(i, None) is not None:
                    blocks.drop(hid)
                return 0
            if self._inflight.get(i) != task.id:  # its prompt, indexed once per task
                blocks.changed(hid, task.prompt, 0, quiet=True)
                self._inflight[i] = task.id
            return blocks.shared(hid, path.nodes(), prompt) if task.tenant == key else 0

        n = len(slots)
        return Match(key, prompt, PerSlot(n, held), PerSlot(n, inflight), ix)


def match_holders(
    key: Hashable,
    prompt: Sequence[PromptItem],
    holders: Sequence[Holder],
    index: PrefixIndex | None = None,
) -> Match:
    """The match over ``holders`` (listed by slot id) and ``index``: the holders indexed
    in a block index of their own (for pure callers and tests; the engine's locator keeps
    its slots indexed)."""
    blocks = BlockIndex()
    for i, h in enumerate(holders):
        if h.tenant == key and h.tokens:
            blocks.changed(i, h.tokens, 0)
        if h.inflight_tenant == key and h.inflight:
            blocks.changed(_inflight_id(i), h.inflight, 0)
    path = Path(blocks, prompt)

    def held(i: int) -> int:
        return blocks.shared(i, path.nodes(), prompt)

    def inflight(i: int) -> int:
        return blocks.shared(_inflight_id(i), path.nodes(), prompt)

    n = len(holders)
    return Match(key, prompt, PerSlot(n, held), PerSlot(n, inflight), index)
