"""The router's map of named streams (server.router.conv_map) on its own: only streams an
instance accepted are remembered, each key's ids are bounded by themselves (exact eviction
order), stops reach requests on their way, and lookups go through the index."""

from __future__ import annotations

import time

import pytest

from server.router.conv_map import ConvMap, covering

pytestmark = pytest.mark.unit


def accept(m: ConvMap, owner: str, cid: str, model: str = "m") -> None:
    m.settle(m.begin(owner, cid, model), accepted=True)


def remembered(m: ConvMap, owner: str) -> list[str]:
    """The owner's ids, least recently accepted first."""
    ids = m.owners.get(owner)
    return list(ids.recent) if ids is not None else []


def test_each_key_is_bounded_by_itself_in_exact_lru_order():
    m = ConvMap(per_owner=3)
    for cid in ("a", "b", "c"):
        accept(m, "k1", cid)
    for i in range(10):  # k2's flood: far more than the bound
        accept(m, "k2", f"x{i}")
    assert remembered(m, "k1") == ["a", "b", "c"]  # untouched by k2
    assert remembered(m, "k2") == ["x7", "x8", "x9"]  # k2 evicted only its own, oldest first
    accept(m, "k1", "a")  # a new request of "a": the most recent again
    accept(m, "k1", "d")
    assert remembered(m, "k1") == ["c", "a", "d"]  # "b" was the least recently accepted
    assert m.get("k1", "b") is None and m.get("k1", "a") == "m"
    assert m.owners["k1"].ordered == ["a", "c", "d"]  # the index follows every eviction
    assert len(m) == 6


def test_a_refused_request_records_nothing_and_keeps_what_was_there():
    m = ConvMap(per_owner=2)
    accept(m, "k", "a", "m1")
    accept(m, "k", "b", "m1")
    for i in range(5):  # refused by their instance (400, 429, 5xx): nothing evicted
        p = m.begin("k", f"bad{i}", "m1")
        assert m.get("k", f"bad{i}") == "m1"  # on its way: a replay finds its model
        m.settle(p, accepted=False)
        assert m.get("k", f"bad{i}") is None
    p = m.begin("k", "a", "m2")  # a new request of "a" for another model
    assert m.get("k", "a") == "m2"
    m.settle(p, accepted=False)  # refused: "a" is still where its stream runs
    assert m.get("k", "a") == "m1"
    assert remembered(m, "k") == ["a", "b"] and m.pending == {}


def test_stops_reach_requests_on_their_way_and_later_requests_win():
    m = ConvMap()
    first = m.begin("k", "a", "m1")
    second = m.begin("k", "a", "m2")
    assert not m.wanted(first) and m.wanted(second)  # a newer request of the id
    assert m.models("k", "a") == {"m1", "m2"}
    m.settle(second, accepted=True)
    m.settle(first, accepted=True)  # answered last, but older: "a" stays on m2
    assert m.get("k", "a") == "m2"
    waiting = m.begin("k", "b", "m1")
    m.forget("k", "b")  # a stop while it waits for its model: it ends
    assert not m.wanted(waiting) and m.get("k", "b") is None
    # its instance accepted it all the same: the caller must stop it there
    assert m.settle(waiting, accepted=True) is True
    assert m.get("k", "b") is None
    m.forget("k", "a")
    assert m.get("k", "a") is None and m.models("k", "a") == set()


def test_variants_come_from_the_index_each_once():
    m = ConvMap()
    for owner, cid in (("k", "a"), ("k", "a::m/x"), ("k", "a::m/x::y"), ("k", "ab"), ("j", "a")):
        accept(m, owner, cid)
    assert sorted(m.variants("k", ["a"])) == ["a", "a::m/x", "a::m/x::y"]
    assert sorted(m.variants("k", ["a::m/x", "a", "a"])) == ["a", "a::m/x", "a::m/x::y"]
    assert list(m.variants("k", ["a:"])) == [] and list(m.variants("k", ["zz"])) == []
    assert list(m.variants("j", ["a"])) == ["a"] and m.variants("nobody", ["a"]) == {}
    assert covering(["a::b::c", "x", "a::b", "a", "x"]) == ["x", "a"]


def test_lookups_do_not_scan_every_entry():
    """The issue's numbers: 16 lookups of 256 ids against a full map took 10.8 s when each
    id scanned every entry; through the index they take milliseconds (bound: 100 times
    that, for a loaded machine)."""
    m = ConvMap(per_owner=4096)
    for owner in ("k1", "k2", "k3", "k4"):
        for i in range(4096):
            accept(m, owner, f"{owner}-{i}::model")
    rids = [f"k1-{i}" for i in range(0, 4096, 16)]
    t0 = time.perf_counter()
    for _ in range(16):
        found = m.variants("k1", rids)
    assert time.perf_counter() - t0 < 1.0
    assert len(found) == 256 and found["k1-16::model"] == "m"
