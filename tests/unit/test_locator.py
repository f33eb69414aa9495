"""The locator (server.kv.locator): one match over every holder (idle and busy slots,
in-flight prefills, RAM and disk entries), and prompt items matched whole (an image is one
item: a match never ends inside it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import pytest

from server.kv.locator import Holder, Locator, match_holders
from server.kv.policy import SlotView, choose_slot, plan_reuse
from server.prefix.items import ImageItem, common_prefix, n_positions
from server.prefix.prefix_index import Held, PrefixIndex
from server.slot.slot import SlotState
from server.tiers.prompt_cache import PromptCache

from .helpers import make_engine, run, task

SYS = list(range(1, 201))


@dataclass(eq=False)
class Ram(Held):
    TIER: ClassVar[str] = "ram"
    tokens: tuple = ()


@dataclass(eq=False)
class Disk(Held):
    TIER: ClassVar[str] = "disk"
    tokens: tuple = ()


def add(ix: PrefixIndex, cls, tokens, order: int, key="") -> Held:
    h = cls(key, (order,), tuple(tokens))
    ix.add(h, list(tokens))
    return h


def test_match_reports_every_holder_kind():
    ix = PrefixIndex()
    ram = add(ix, Ram, SYS[:150] + [7000], 0)
    disk = add(ix, Disk, SYS + [8000, 8001], 1)
    add(ix, Ram, SYS, 2, key="other")  # another tenant's: never reported
    holders = [
        Holder(0, SYS[:120] + [5], ""),  # idle, holds 120 of the prompt
        Holder(1, SYS[:40], "", SYS[:180] + [6], ""),  # prefilling: 40 held, 180 in flight
        Holder(2, SYS, "other"),  # another tenant's tokens
        Holder(3, []),  # empty
    ]
    prompt = SYS + [9]
    m = Locator(index=ix).match("", prompt, holders=holders)
    assert tuple(m.held) == (120, 40, 0, 0)
    assert tuple(m.inflight) == (0, 180, 0, 0)
    tiers = m.tiers()
    assert tiers is not None and tiers is m.tiers()  # walked once
    hit = tiers.best(("ram",), -1.0, 0.0)
    assert hit is not None and (hit.held, hit.n_lcp) == (ram, 150)
    hit = tiers.best(("disk",), -1.0, 0.0)
    assert hit is not None and (hit.held, hit.n_lcp) == (disk, 200)
    # the same holders under the other tenant
    m2 = match_holders("other", prompt, holders, ix)
    assert tuple(m2.held) == (0, 0, 200, 0) and tuple(m2.inflight) == (0, 0, 0, 0)
    assert Locator().match("", prompt, holders=holders).tiers() is None  # no index


def test_tiers_are_walked_on_first_use_not_at_match_time():
    ix = PrefixIndex()
    m = Locator(index=ix).match("", SYS + [1], holders=[])
    saved = add(ix, Ram, SYS, 0)  # e.g. the chosen slot saved first (ARCHITECTURE §5)
    hit = m.tiers().best(("ram",), -1.0, 0.0)
    assert hit is not None and hit.held is saved and hit.n_lcp == 200


def test_engine_match_sees_idle_busy_prefilling_slots_and_the_ram_cache():
    e, b = make_engine(n_seq=3, n_batch=64, n_ubatch=64)
    e.cache = PromptCache(-1, 0)
    e.opts.cache_idle_slots = False
    run(e, task(SYS[:100] + [900], max_tokens=2)[0])  # slot 0 idle, holds 100 of SYS
    long, _ = task(SYS + [901], max_tokens=2, id_slot=1)
    e.waiting.append(long)
    e.step()  # the long prompt prefills 64 tokens a step
    pre = next(s for s in e.slots if s.state is SlotState.PREFILL)
    e.cache.save(SYS[:150] + [902], 16, lambda: bytearray(16))
    m = e.sharing.locator.match("", SYS + [903], e.cache.index)
    held = [0] * 3
    held[0] = 100
    held[pre.id] = len(pre.tokens)
    assert pre.id != 0 and 0 < len(pre.tokens) < 200
    assert list(m.held) == held
    assert m.inflight[pre.id] == 200 and sum(m.inflight) == 200
    hit = m.tiers().best(("ram",), -1.0, 0.0)
    assert hit is not None and hit.n_lcp == 150


def test_choose_slot_reads_the_match_it_is_given():
    slots = [SlotView(0, True, SYS, 1.0), SlotView(1, True, SYS[:10], 2.0)]
    prompt = SYS + [1]
    assert choose_slot(slots, prompt, -1, 0.1).slot == 0
    # a match that says otherwise wins: choose_slot computes no prefix itself
    fake = match_holders("", prompt, [Holder(0, []), Holder(1, SYS)])
    c = choose_slot(slots, prompt, -1, 0.1, "", fake)
    assert (c.slot, c.lcp, c.by) == (1, 200, "similarity")


IMG_A = ImageItem("a" * 64, 256)
IMG_A2 = ImageItem("a" * 64, 256)  # the same image again: equal
IMG_B = ImageItem("b" * 64, 256)


def test_items_match_whole():
    p = [1, 2, IMG_A, 3, 4]
    assert common_prefix(p, [1, 2, IMG_A2, 3, 5]) == 4
    assert common_prefix(p, [1, 2, IMG_B, 3, 4]) == 2  # another image: stops before it
    assert common_prefix(p, [1, 2, 3]) == 2  # a token is never an image
    assert common_prefix(p, [1, 2, ImageItem("a" * 64, 255)]) == 2  # length is identity too
    assert n_positions(p) == 4 + 256 and n_positions(p, 2) == 2 and n_positions(p, 3) == 258
    long = list(range(100)) + [IMG_A] + list(range(100))
    assert common_prefix(long, list(range(100)) + [IMG_A2] + list(range(50))) == 151
    assert common_prefix(long, list(range(100)) + [IMG_B]) == 100
    with pytest.raises(ValueError):
        ImageItem("x", 0)


def test_an_image_is_one_item_in_the_index_and_for_slots():
    ix = PrefixIndex()
    a = add(ix, Ram, [1, 2, IMG_A, 3], 0)
    add(ix, Ram, [1, 2, IMG_B, 3, 4], 1)  # splits the edge before the image, never inside
    assert ix.check_integrity() == []
    assert [d for d, _, _ in ix.edges("")] == [2, 4, 5]
    m = match_holders("", [1, 2, IMG_A2, 3, 9], [Holder(0, [1, 2, IMG_B, 3])], ix)
    assert tuple(m.held) == (2,)  # the slot's image differs: its match ends before it
    hit = m.tiers().best(("ram",), -1.0, 0.0)
    assert hit is not None and hit.held is a and hit.n_lcp == 4
    # a cut (n_past) counts items, and the last item is re-evaluated as with tokens
    plan = plan_reuse([1, 2, IMG_A], [1, 2, IMG_A2], cache_prompt=True, pos_min=0, n_swa=0)
    assert plan.n_past == 2
