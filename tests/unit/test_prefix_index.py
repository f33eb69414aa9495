"""The prefix index (server.prefix.prefix_index): exact match lengths, edge splits and
merges, removal leaving no dead nodes, tenant separation, the load rule against a linear
scan, and concurrent changes."""

from __future__ import annotations

import inspect
import random
import sys
import threading
from dataclasses import dataclass
from typing import ClassVar

from server.prefix.prefix_index import Held, PrefixIndex, SlotBaseline
from server.types import lcp


@dataclass(eq=False)
class H(Held):
    TIER: ClassVar[str] = "t"
    tokens: tuple = ()


@dataclass(eq=False)
class Q(Held):
    TIER: ClassVar[str] = "q"
    tokens: tuple = ()


def held(ix: PrefixIndex, tokens, order: int, key="", cls=H) -> Held:
    h = cls(key, (order,), tuple(tokens))
    ix.add(h, list(tokens))
    return h


def best(ix, prompt, key="", keep=-1.0, sim=0.0, tiers=("t",)):
    hit = ix.match(key, prompt).best(tiers, keep, sim)
    return None if hit is None else (hit.held.tokens, hit.n_lcp)


def scan(entries, prompt, keep=-1.0, sim=0.0):
    """The linear rule the index replaces (PromptCache.find before issue 27)."""
    out = None
    for e in entries:
        m = lcp(e, prompt)
        f_keep, f_sim = m / len(e), m / len(prompt)
        if f_keep < 0.25:
            continue
        if f_keep > keep and f_sim > sim:
            keep, sim, out = f_keep, f_sim, (tuple(e), m)
    return out


def test_match_lengths_are_exact():
    ix = PrefixIndex()
    held(ix, [1, 2, 3, 4, 5, 6, 7, 8], 1)
    held(ix, [1, 2, 9], 2)
    assert best(ix, [1, 2, 3, 4, 5, 6, 0, 0, 0, 0]) == ((1, 2, 3, 4, 5, 6, 7, 8), 6)
    assert best(ix, [1, 2, 9, 9]) == ((1, 2, 9), 3)
    # the first in order sharing both tokens wins: the second does not beat its f_sim
    assert best(ix, [1, 2]) == ((1, 2, 3, 4, 5, 6, 7, 8), 2)
    assert best(ix, [1, 2, 3]) == ((1, 2, 3, 4, 5, 6, 7, 8), 3)  # ends inside an edge
    assert best(ix, [1, 2, 3, 4, 5, 6, 7, 8]) == ((1, 2, 3, 4, 5, 6, 7, 8), 8)
    assert best(ix, [5]) is None and best(ix, []) is None
    assert ix.check_integrity() == []


def test_order_decides_between_trade_offs_as_a_scan_does():
    # a long match with a poor f_keep after a short exact one: the scan keeps the first
    ix = PrefixIndex()
    held(ix, [1, 2, 3, 4, 5, 6], 1)
    held(ix, [1, 2, 3, 4, 5, 6, 7, 8] + [50] * 22, 2)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 0]
    assert best(ix, prompt)[1] == 6
    ix2 = PrefixIndex()
    held(ix2, [1, 2, 3, 4, 5, 6, 7, 8] + [50] * 22, 1)
    held(ix2, [1, 2, 3, 4, 5, 6], 2)
    assert best(ix2, prompt)[1] == 8


def test_edges_split_and_merge_back():
    ix = PrefixIndex()
    a = held(ix, [1, 2, 3, 4], 1)
    assert ix.edges("") == [(4, [1, 2, 3, 4], 1)]
    b = held(ix, [1, 2, 5], 2)
    assert ix.edges("") == [(2, [1, 2], 0), (4, [3, 4], 1), (3, [5], 1)]
    c = held(ix, [1, 2], 3)  # ends on the split node
    assert ix.edges("") == [(2, [1, 2], 1), (4, [3, 4], 1), (3, [5], 1)]
    assert ix.check_integrity() == []
    assert ix.discard(c) and not ix.discard(c)
    assert ix.edges("") == [(2, [1, 2], 0), (4, [3, 4], 1), (3, [5], 1)]
    assert ix.discard(b)
    assert ix.edges("") == [(4, [1, 2, 3, 4], 1)]  # merged: no holder, one child
    assert ix.check_integrity() == []
    assert ix.discard(a)
    assert ix.edges("") == [] and len(ix) == 0 and ix.check_integrity() == []


def test_removing_a_middle_holder_merges_its_node():
    ix = PrefixIndex()
    mid = held(ix, [1, 2], 1)
    held(ix, [1, 2, 3, 4], 2)
    assert ix.edges("") == [(2, [1, 2], 1), (4, [3, 4], 1)]
    ix.discard(mid)
    assert ix.edges("") == [(4, [1, 2, 3, 4], 1)] and ix.check_integrity() == []


def test_tenants_are_separate_trees():
    ix = PrefixIndex()
    held(ix, [1, 2, 3], 1, key="a")
    held(ix, [1, 2, 3, 4], 2, key="b")
    assert best(ix, [1, 2, 3, 4, 5], key="a") == ((1, 2, 3), 3)
    assert best(ix, [1, 2, 3, 4, 5], key="b") == ((1, 2, 3, 4), 4)
    assert best(ix, [1, 2, 3, 4, 5], key="c") is None
    assert ix.covers("t", "a", [1, 2]) and not ix.covers("t", "a", [1, 2, 3, 4])
    assert [h.tokens for h in ix.prefixes_of("t", "b", [1, 2, 3, 4, 9])] == [(1, 2, 3, 4)]
    assert ix.prefixes_of("t", "a", [1, 2, 3, 4, 9])[0].key == "a"
    assert ix.count("t") == 2 and ix.check_integrity() == []


def test_covers_and_prefixes_follow_the_tier():
    ix = PrefixIndex()
    held(ix, [1, 2, 3], 1)
    held(ix, [1], 2)
    held(ix, [1, 2, 3, 4, 5], 3, cls=Q)
    assert ix.covers("t", "", [1, 2]) and ix.covers("t", "", [1, 2, 3])
    assert not ix.covers("t", "", [1, 2, 3, 4]) and ix.covers("q", "", [1, 2, 3, 4])
    assert not ix.covers("t", "", [1, 3])
    got = ix.prefixes_of("t", "", [1, 2, 3, 4])
    assert [h.tokens for h in got] == [(1, 2, 3), (1,)]  # in order
    assert ix.prefixes_of("t", "", [1, 2]) == got[1:]
    assert [h.tokens for h in ix.prefixes_of("q", "", [1, 2, 3, 4, 5, 6])] == [(1, 2, 3, 4, 5)]


def test_tiers_scanned_together_keep_one_order():
    ix = PrefixIndex()
    held(ix, [1, 2, 3, 4, 5, 6, 7, 8] + [50] * 22, 5)  # t, later in the common order
    held(ix, [1, 2, 3, 4, 5, 6], 9, cls=Q)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 0]
    assert best(ix, prompt, tiers=("t", "q"))[1] == 8
    assert best(ix, prompt, tiers=("q",))[1] == 6


def test_records_survive_removal_of_a_record():
    ix = PrefixIndex()
    base = [7] * 10
    hs = [held(ix, base + [i] * n, i) for i, n in enumerate([30, 5, 40, 20, 3, 8])]
    assert ix.check_integrity() == []
    ix.discard(hs[1])  # a record: the holders after it until the next may be records now
    assert ix.check_integrity() == []
    ix.discard(hs[0])
    assert ix.check_integrity() == []
    ix.discard(hs[4])
    assert ix.check_integrity() == [] and len(ix) == 3


def _random_tokens(rng: random.Random, stems: list[list[int]]) -> list[int]:
    stem = rng.choice(stems)
    return stem[: rng.randint(0, len(stem))] + [rng.randrange(4) for _ in range(rng.randint(1, 6))]


def test_the_rule_equals_a_linear_scan_under_random_changes():
    rng = random.Random(27)
    stems = [[rng.randrange(4) for _ in range(12)] for _ in range(3)]
    ix = PrefixIndex()
    live: list[Held] = []
    for step in range(1500):
        if live and rng.random() < 0.4:
            ix.discard(live.pop(rng.randrange(len(live))))
        else:
            live.append(held(ix, _random_tokens(rng, stems), step))
        prompt = _random_tokens(rng, stems)
        base = rng.choice([(-1.0, 0.0), (0.5, 0.2), (0.9, 0.0)])
        order = sorted(live, key=lambda h: h.order)
        assert best(ix, prompt, "", *base) == scan([h.tokens for h in order], prompt, *base)
        if step % 100 == 0:
            assert ix.check_integrity() == []
    for h in live:
        ix.discard(h)
    assert len(ix) == 0 and ix.edges("") == [] and ix.check_integrity() == []


def test_insertion_out_of_order_keeps_the_scan_order():
    rng = random.Random(5)
    ix = PrefixIndex()
    entries = []
    for i in rng.sample(range(200), 200):  # orders arrive shuffled (files of other replicas)
        toks = [1, 2, 3] + [rng.randrange(3) for _ in range(rng.randint(1, 8))]
        entries.append((i, toks))
        held(ix, toks, i)
    ordered = [t for _, t in sorted(entries)]
    for _ in range(200):
        prompt = [1, 2, 3] + [rng.randrange(3) for _ in range(rng.randint(0, 9))]
        assert best(ix, prompt) == scan(ordered, prompt)
    assert ix.check_integrity() == []


def test_concurrent_changes_keep_the_tree_whole():
    ix = PrefixIndex()
    stop = threading.Event()

    def churn(seed: int) -> None:
        rng = random.Random(seed)
        mine: list[Held] = []
        for i in range(3000):
            if mine and rng.random() < 0.5:
                ix.discard(mine.pop(rng.randrange(len(mine))))
            else:
                mine.append(
                    held(ix, [1, 2] + [rng.randrange(3) for _ in range(5)], seed * 10**6 + i)
                )
        for h in mine:
            ix.discard(h)

    threads = [threading.Thread(target=churn, args=(s,)) for s in (1, 2)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        ix.match("", [1, 2, 0, 1, 2]).best(("t",), -1.0, 0.0)
    stop.set()
    for t in threads:
        t.join()
    assert len(ix) == 0 and ix.check_integrity() == []


def test_ram_and_disk_share_one_index_without_seeing_each_other(tmp_path):
    from server.tiers.disk import DiskTier
    from server.tiers.disk_files import DiskEntry, FileCheck
    from server.tiers.prompt_cache import PromptCache
    from server.tiers.saved import SavedState

    ix = PrefixIndex()
    ram = PromptCache(-1, 0, index=ix)
    disk = DiskTier(tmp_path, 1 << 30, FileCheck(3, 4096, 1000, "m"), index=ix)  # not started
    ram.save([1, 2, 3, 4], 10, lambda: bytearray(10), tenant="k")
    disk.index.add(DiskEntry("f", [1, 2, 3, 4, 5, 6, 9, 9], "k", 10, 10, 1))
    assert disk.put(SavedState([1, 2, 3, 4, 5, 6, 7], bytearray(10), tenant="k"))
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]
    m = ix.match("k", prompt)
    assert ram.find(m, SlotBaseline()).n_lcp == 4
    hit = disk.find(prompt, "k", SlotBaseline(), m)  # the queued entry beats the file
    assert hit.pending is not None and hit.n_lcp == 7
    assert disk.index.find(prompt, "k", -1.0, 0.0)[1] == 6  # files alone
    assert (
        ram.find(ix.match("j", prompt), SlotBaseline()) is None
        and disk.find(prompt, "j", SlotBaseline()) is None
    )
    assert ram.save([1, 2], 10, lambda: bytearray(10), tenant="k").reason == "covered"
    assert ram.check_integrity() == [] and disk.check_integrity() == []
    assert disk.index.remove("f") is not None and ram.check_integrity() == []
    assert disk.check_integrity() == []


def test_a_path_through_hundreds_of_branches_is_checked_without_recursion():
    ix = PrefixIndex()
    hs = [held(ix, [0] * k + [1], k) for k in range(1, 301)]  # each branches off deeper
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(len(inspect.stack()) + 100)  # a recursive walk of 300 would fail
    try:
        assert ix.check_integrity() == []
    finally:
        sys.setrecursionlimit(limit)
    assert best(ix, [0] * 200 + [1]) == (tuple([0] * 200 + [1]), 201)
    assert ix.path_of(hs[9]) == [0] * 10 + [1]
    for h in hs:
        ix.discard(h)
    assert ix.edges("") == [] and ix.check_integrity() == []


def test_two_tiers_scanned_together_equal_a_scan_of_both_in_order():
    rng = random.Random(99)
    stems = [[rng.randrange(3) for _ in range(20)] for _ in range(2)]
    ix = PrefixIndex()
    live: list[Held] = []
    taken_later = 0  # choices that are not the first holder passing: the rule's order matters
    for step in range(2000):
        if live and rng.random() < 0.35:
            ix.discard(live.pop(rng.randrange(len(live))))
        else:  # "t" before "q" in the common order, as files come before the queue
            cls = rng.choice([H, Q])
            order = (0 if cls is H else 1, rng.randrange(10**6), step)
            h = cls("", order, tuple(_random_tokens(rng, stems)))
            ix.add(h, list(h.tokens))
            live.append(h)
        prompt = _random_tokens(rng, stems)
        base = rng.choice([(-1.0, 0.0), (0.3, 0.1), (0.6, 0.3), (0.95, 0.0)])
        got = best(ix, prompt, "", *base, tiers=("t", "q"))
        ordered = [h.tokens for h in sorted(live, key=lambda h: h.order)]
        assert got == scan(ordered, prompt, *base)
        first = next((t for t in ordered if scan([t], prompt, *base)), None)
        taken_later += got is not None and got[0] != first
    assert taken_later > 50 and ix.check_integrity() == []


def test_cache_integrity_finds_prefixes_through_the_index_within_a_tenant():
    from server.tiers.prompt_cache import PromptCache

    c = PromptCache(-1, 0)
    c.save([1, 2, 3], 8, lambda: bytearray(8), tenant="a")
    c.save([1, 2, 3, 4], 8, lambda: bytearray(8), tenant="b")  # another tenant's: no problem
    assert c.check_integrity() == []
    c._append(c.entries[0].__class__([1, 2], bytearray(8), tenant="a"))  # behind save's back
    assert "entry 2 is a prefix of entry 0" in c.check_integrity()
    ix = PrefixIndex()
    a = held(ix, [1, 2], 1)
    b = held(ix, [1, 2, 3], 2)
    held(ix, [1, 2, 3], 3, key="other")
    assert ix.below(a) == [b] and ix.below(b) == []
