"""The resumable streams' buffer and registry (server.service.stream_buffers) on their own: framing,
bounds, positions, limits, expiry and stop, with async generators standing in for routes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from server.schemas.errors import APIError
from server.schemas.stream_ids import check_id, valid_id
from server.service.stream_buffers import StreamLimits, StreamRegistry, StreamSession

pytestmark = pytest.mark.unit


def ev(i: int) -> str:
    return f'data: {{"i": {i}}}\n\n'


def test_ids():
    assert valid_id("conv-1::ggml-org/tinygemma3-GGUF:Q8_0")
    for bad in ("", "a b", "x" * 257, "a?b", "a#b", "a%20", 'q"', "é"):
        assert not valid_id(bad), bad
        with pytest.raises(APIError) as e:
            check_id(bad)
        assert e.value.status == 400


def test_a_batch_is_split_into_its_events_and_positions_map_bytes_to_them():
    s = StreamSession("c", "", StreamLimits())
    s.append(ev(0) + ev(1) + ":\n\n")
    s.append(ev(2))
    assert s.total_events == 4 and s.events[2] == b":\n\n"
    whole = b"".join(s.events)
    assert s.total_bytes == len(whole)
    assert s.position(None, None) == (0, 0)
    assert s.position(len(ev(0)), None) == (1, 0)
    assert s.position(len(ev(0)) + 3, None) == (1, 3)
    assert s.position(None, 2) == (2, 0)
    assert s.position(len(whole), None) == (4, 0)
    assert s.take(1) == whole[len(ev(0)) :]
    for off, event in ((len(whole) + 1, None), (None, 5)):
        with pytest.raises(APIError):
            s.position(off, event)


def test_a_full_buffer_drops_its_oldest_events_and_those_positions_are_lost():
    s = StreamSession("c", "", StreamLimits(max_events=3, max_bytes=10_000))
    for i in range(5):
        s.append(ev(i))
    assert s.first_event == 2 and s.total_events == 5
    assert s.take(2) == (ev(2) + ev(3) + ev(4)).encode()
    assert s.take(1) is None
    with pytest.raises(APIError, match="lost"):
        s.position(0, None)
    small = StreamSession("c", "", StreamLimits(max_bytes=len(ev(0)) * 2))
    for i in range(4):
        small.append(ev(i))
    assert small.buffered <= len(ev(0)) * 2 and small.first_event == 2
    big = StreamSession("c", "", StreamLimits(max_bytes=4))
    big.append(ev(0))
    assert big.take(0) == ev(0).encode()  # the newest event is always kept


async def _source(n: int, gate: asyncio.Event, closed: list[bool]) -> AsyncIterator[str]:
    try:
        for i in range(n):
            yield ev(i)
        await gate.wait()
        yield "data: [DONE]\n\n"
    finally:
        closed.append(True)


def test_replay_follows_live_and_stop_closes_the_source():
    async def run() -> None:
        reg = StreamRegistry(StreamLimits())
        gate, closed = asyncio.Event(), []
        s = reg.open("", "a", _source(3, gate, closed))
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        got = []

        async def read() -> None:
            async for b in reg.read(s, 1):
                got.append(b)

        reader = asyncio.create_task(read())
        await asyncio.sleep(0.01)
        gate.set()
        await reader
        assert b"".join(got) == (ev(1) + ev(2) + "data: [DONE]\n\n").encode()
        assert s.done and closed == [True]
        # a stop of a generating stream cancels its source (its tasks end)
        gate2, closed2 = asyncio.Event(), []
        reg.open("", "b", _source(1, gate2, closed2))
        await asyncio.sleep(0.01)
        assert reg.stop("", "b") and reg.get("", "b") is None
        await asyncio.sleep(0.01)
        assert closed2 == [True]
        assert reg.stats.stopped == 1

    asyncio.run(run())


def test_limits_per_owner_and_in_all_and_expiry():
    async def run() -> None:
        reg = StreamRegistry(StreamLimits(ttl=0.05, max_streams=3, per_owner=2))
        gates = [asyncio.Event() for _ in range(4)]
        reg.open("k1", "a", _source(1, gates[0], []))
        reg.open("k1", "b", _source(1, gates[1], []))
        with pytest.raises(APIError) as e:
            reg.check_room("k1", "c")
        assert e.value.status == 429
        reg.check_room("k1", "a")  # the same id replaces: no new room needed
        reg.open("k2", "a", _source(1, gates[2], []))  # another key's "a": its own
        with pytest.raises(APIError):
            reg.open("k3", "x", _source(1, gates[3], []))
        assert reg.stats.refused == 2
        # nobody reads: after the ttl every stream is stopped and dropped
        await asyncio.sleep(0.2)
        assert reg.sessions == {} and reg.stats.expired_running == 3

    asyncio.run(run())


def test_a_finished_stream_makes_room_for_a_new_one():
    async def run() -> None:
        reg = StreamRegistry(StreamLimits(per_owner=1))
        gate = asyncio.Event()
        gate.set()
        reg.open("", "a", _source(1, gate, []))
        await asyncio.sleep(0.01)
        assert reg.get("", "a").done
        reg.open("", "b", _source(1, gate, []))
        assert reg.get("", "a") is None and reg.get("", "b") is not None
        reg.close()

    asyncio.run(run())


def test_lookup_names_only_what_it_is_asked_for():
    async def run() -> None:
        reg = StreamRegistry(StreamLimits())
        gate = asyncio.Event()
        for owner, cid in (("", "a"), ("", "a::m/x"), ("", "ab"), ("k", "a")):
            reg.open(owner, cid, _source(1, gate, []))
        found = sorted(e["conversation_id"] for e in reg.lookup("", ["a"]))
        assert found == ["a", "a::m/x"]
        assert reg.lookup("", []) == [] and reg.lookup("", ["zz"]) == []
        reg.close()

    asyncio.run(run())


def test_without_keys_one_client_does_not_take_everyone_s_quota():
    """Keyless (or one key): every client is owner "" — the per-owner bound would let one
    client's streams refuse every other client's named chat; only the bound in all holds."""

    async def run() -> None:
        reg = StreamRegistry(StreamLimits(max_streams=4, per_owner=1, keyed=False))
        gate = asyncio.Event()
        for cid in ("a", "b", "c", "d"):  # four clients' streams, all generating
            reg.check_room("", cid)
            reg.open("", cid, _source(1, gate, []))
        with pytest.raises(APIError) as e:
            reg.check_room("", "e")  # the server's bound still holds
        assert e.value.status == 429 and "at most 4" in e.value.message
        reg.close()

    asyncio.run(run())


def test_a_queued_stream_holds_no_quota_until_it_reaches_a_slot():
    async def run() -> None:
        reg = StreamRegistry(StreamLimits(max_streams=8, per_owner=2))
        gate = asyncio.Event()
        in_slot = {"a": False, "b": False}
        for cid in in_slot:  # both queued behind other requests
            reg.open("k1", cid, _source(1, gate, []), started=lambda c=cid: in_slot[c])
        reg.check_room("k1", "c")  # neither holds k1's quota yet
        reg.open("k1", "c", _source(1, gate, []), started=lambda: False)
        assert len(reg.sessions) == 3  # kept beyond the bound: none of them generates
        in_slot["a"] = in_slot["b"] = True  # both reached a slot: now they count
        with pytest.raises(APIError) as e:
            reg.check_room("k1", "d")
        assert e.value.status == 429 and "at most 2" in e.value.message
        reg.check_room("k2", "d")  # another key's quota is its own
        assert reg.stats.refused == 1
        reg.close()

    asyncio.run(run())


def test_finished_streams_beyond_the_bounds_go_oldest_first():
    """Queued streams let the kept sessions pass a bound; as streams end, the oldest
    finished ones go until the bound holds again (the buffers kept stay bounded)."""

    async def run() -> None:
        reg = StreamRegistry(StreamLimits(max_streams=8, per_owner=2))
        gates = {cid: asyncio.Event() for cid in "abcd"}
        for cid, gate in gates.items():
            reg.open("k1", cid, _source(1, gate, []), started=lambda: False)
        for cid in "abc":  # three end, in order: the first two over the bound go
            gates[cid].set()
            await asyncio.sleep(0.01)
        assert sorted(k[1] for k in reg.sessions) == ["c", "d"]
        reg.close()

    asyncio.run(run())
