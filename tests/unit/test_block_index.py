"""The slots' block index (server.prefix.block_index, issue 41): slots and in-flight prompts
as paths of full blocks, kept as their tokens change; exact shared lengths."""

from __future__ import annotations

import random

from server.kv.locator import Holder, match_holders
from server.prefix.block_index import BlockIndex, Path
from server.prefix.items import ImageItem, common_prefix
from server.slot.slot import SlotState

from .helpers import make_engine, run, task

SYS = list(range(1, 201))


def shared(ix: BlockIndex, hid, prompt) -> int:
    return ix.shared(hid, ix.path(prompt), prompt)


def test_exact_shared_lengths_at_and_between_block_edges():
    ix = BlockIndex(4)
    ix.changed(0, SYS[:10], 0)  # blocks [1..4], [5..8], and 2 items beyond
    ix.changed(1, SYS[:8] + [99, 98, 97, 96], 0)  # shares 2 blocks, differs in the third
    ix.changed(2, [7] + SYS[1:10], 0)  # differs at the first item
    # [1..4] [5..8] [99..96], and [7 2 3 4] [5..8] under another first block
    assert ix.check_integrity() == [] and ix.n_nodes() == 5
    prompt = SYS[:12]
    assert [shared(ix, h, prompt) for h in (0, 1, 2, 3)] == [10, 8, 0, 0]
    assert [shared(ix, h, SYS[:9]) for h in (0, 1, 2)] == [9, 8, 0]  # prompt ends mid-block
    assert [shared(ix, h, SYS[:3]) for h in (0, 1, 2)] == [3, 3, 0]  # inside the first block
    assert [shared(ix, h, SYS[:4] + [0]) for h in (0, 1)] == [4, 4]
    assert shared(ix, 1, SYS[:8] + [99, 98, 0]) == 10  # inside a block it holds
    assert shared(ix, 2, [7, 2, 3, 4, 5, 6]) == 6


def test_append_cut_assign_and_drop_keep_the_trie_exact():
    ix = BlockIndex(4)
    toks = SYS[:3]
    ix.changed(0, toks, 0)
    assert ix.n_nodes() == 0  # no full block yet
    for t in SYS[3:9]:  # appends, one token a step, as generation does
        n = len(toks)
        toks.append(t)
        ix.changed(0, toks, n)
    assert ix.n_nodes() == 2 and shared(ix, 0, SYS) == 9
    ix.changed(1, SYS[:8], 0)  # a second holder of the same two blocks: no new node
    assert ix.n_nodes() == 2
    del toks[5:]
    ix.changed(0, toks, 5)  # a cut drops the blocks past it, but holder 1 keeps them
    assert ix.n_nodes() == 2 and shared(ix, 0, SYS) == 5 and shared(ix, 1, SYS) == 8
    ix.changed(1, [50, 51, 52, 53, 54], 0)  # an assign: its old blocks go (held by none)
    assert ix.n_nodes() == 2 and shared(ix, 1, SYS) == 0 and shared(ix, 1, [50, 51, 52]) == 3
    toks[2:4] = []  # a context shift removed items 2..3: blocks from there are recomputed
    ix.changed(0, toks, 2)
    assert shared(ix, 0, [1, 2, 5]) == 3 and shared(ix, 0, SYS) == 2
    ix.drop(1)
    ix.drop(0)
    assert ix.n_nodes() == 0 and len(ix) == 0 and ix.check_integrity() == []


def test_a_path_is_retaken_when_the_trie_changed():
    ix = BlockIndex(4)
    ix.changed(0, SYS[:4], 0)
    path = Path(ix, SYS[:12])
    assert len(path.nodes()) == 1
    ix.changed(1, SYS[:12], 0)  # new blocks after the path was taken
    assert len(path.nodes()) == 3 and ix.shared(1, path.nodes(), SYS[:12]) == 12


def test_images_are_items_of_a_block():
    a, a2, b = ImageItem("a", 300), ImageItem("a", 300), ImageItem("b", 300)
    ix = BlockIndex(2)
    ix.changed(0, [1, a, 2, 3], 0)
    assert shared(ix, 0, [1, a2, 2, 9]) == 3
    assert shared(ix, 0, [1, b, 2, 3]) == 1
    assert shared(ix, 0, [1, 300]) == 1


def test_random_changes_agree_with_the_item_compare():
    """Seeded: appends, cuts, shifts and assigns on 6 holders; every holder's shared length
    with every other holder's items and with edited prompts is the plain compare's."""
    rng = random.Random(41)
    ix = BlockIndex(3)
    held: list[list[int]] = [[] for _ in range(6)]
    for step in range(400):
        h = rng.randrange(6)
        toks = held[h]
        op = rng.random()
        if op < 0.5:
            n = len(toks)
            toks.extend(rng.choice([1, 2]) for _ in range(rng.randint(1, 5)))
            ix.changed(h, toks, n)
        elif op < 0.7:
            n = rng.randint(0, len(toks))
            del toks[n:]
            ix.changed(h, toks, n)
        elif op < 0.8 and len(toks) > 4:
            a = rng.randrange(len(toks) - 2)
            del toks[a : a + 2]
            ix.changed(h, toks, a)
        else:
            held[h] = toks = list(held[rng.randrange(6)][: rng.randint(0, 20)])
            ix.changed(h, toks, 0)
        if step % 20 == 0:
            assert ix.check_integrity() == []
        prompt = held[rng.randrange(6)] + [rng.choice([1, 2])]
        path = ix.path(prompt)
        for j in range(6):
            assert ix.shared(j, path, prompt) == common_prefix(held[j], prompt)


def test_match_holders_reads_the_block_index():
    holders = [
        Holder(0, SYS[:130] + [5]),
        Holder(1, SYS[:64], "", SYS[:190] + [6], ""),
        Holder(2, SYS, "other"),
        Holder(3, [], "", SYS, "other"),
    ]
    m = match_holders("", SYS + [1], holders)
    assert tuple(m.held) == (130, 64, 0, 0) and tuple(m.inflight) == (0, 190, 0, 0)
    m = match_holders("other", SYS[:150], holders)
    assert tuple(m.held) == (0, 0, 150, 0) and tuple(m.inflight) == (0, 0, 0, 150)


def test_engine_slots_are_indexed_as_their_tokens_change():
    """The engine's store keeps every slot's tokens in its block index through prefill,
    generation, cuts and releases (its integrity check runs after every step); the live
    match agrees with the plain compare, in-flight prompts included."""
    e, _ = make_engine(n_seq=3, n_batch=64, n_ubatch=64)
    run(e, task(SYS[:150] + [900], max_tokens=70)[0])  # generation crosses a block edge
    s0 = next(s for s in e.slots if s.tokens)
    assert e.store.blocks.holds_items(s0.id, s0.tokens) and len(s0.tokens) > 200
    run(e, task(SYS[:100] + [901], max_tokens=2, id_slot=s0.id)[0])  # cut to 100, regrown
    assert s0.tokens[:101] == SYS[:100] + [901] and e.store.check_integrity() == []
    long, _ = task(SYS + [902], max_tokens=2, id_slot=1)
    e.waiting.append(long)
    e.step()  # slot 1 prefills 64 of 201
    pre = e.slots[1]
    assert pre.state is SlotState.PREFILL
    prompt = SYS + [903]
    m = e.sharing.locator.match("", prompt)
    assert list(m.held) == [common_prefix(s.tokens, prompt) for s in e.slots]
    assert list(m.inflight) == [0, 200, 0]
    assert m.held[0] == 100 and 0 < m.held[1] < 200
    assert e.sharing.locator.match("other", prompt).held[0] == 0  # another tenant's


def test_appends_within_a_block_go_untold_and_a_late_listener_hears_everything():
    """A sequence tells its watch an append only when it reaches the length the watch
    returned (the end of the next block, of the index's or a listener's size); a listener
    that joins later is told the tokens as they are (``retell``)."""
    from server.slot.sequence import Sequence

    class Spy:
        def __init__(self, bs: int) -> None:
            self.bs, self.calls = bs, []

        def changed(self, hid, items, n_keep) -> int:
            self.calls.append((len(items), n_keep))
            return (len(items) // self.bs + 1) * self.bs

    ix = BlockIndex(8)
    seq = Sequence()
    seq.watch = lambda items, n_keep: ix.changed(0, items, n_keep)
    told = []
    real = ix.changed
    ix.changed = lambda *a, **k: told.append(len(a[1])) or real(*a, **k)  # type: ignore[method-assign]
    for t in range(20):
        seq.extend([t])
    assert told == [1, 8, 16]  # the first append, then each block's end
    assert ix.shared(0, ix.path(list(range(20))), list(range(20))) == 20
    spy = Spy(3)
    ix.listeners.append(spy)
    seq.retell()
    assert spy.calls == [(20, 20)]
    for t in range(20, 26):
        seq.extend([t])
    assert [n for n, _ in spy.calls] == [20, 21, 24]  # every 3 now (the listener's blocks)
    seq.truncate(5)  # a cut is always told
    assert spy.calls[-1] == (5, 5) and ix.check_integrity() == []
