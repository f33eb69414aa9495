"""KV-cache events, the pure parts: llm-d's block hash scheme (FNV-1a 64 over canonical
CBOR, checked against hand-encoded bytes and FNV's published vectors), chaining, the
per-medium ledger's events, the slot watcher's diffs, and the publisher's wire frames and
drop counting."""

from __future__ import annotations

import functools
import socket
import struct
import threading
import time

import msgpack
import zmq

from server.http import kv_setup
from server.kv_events.kv_blocks import (
    FNV_OFFSET,
    BlockHasher,
    block_hash,
    extra_cbor,
    fnv1a64,
    root_hash,
    tenant_extra,
)
from server.kv_events.kv_events import TOKENS_ALL, TOKENS_NONE, TOKENS_SHARED, Chain, KVEvents
from server.kv_events.kv_publisher import KVPublisher, encode, endpoint_problem, normalize_endpoint
from server.kv_events.kv_watch import SlotWatcher
from server.prefix.block_index import BlockIndex
from server.settings.config import Settings
from server.slot.slot import Slot
from tests import zmtp_peer


def _fnv(data: bytes) -> int:  # the textbook definition, independent of the server's
    h = 0xCBF29CE484222325
    for b in data:
        h ^= b
        h = (h * 0x100000001B3) % (1 << 64)
    return h


def test_fnv1a64_published_vectors():
    assert fnv1a64(b"") == FNV_OFFSET == 0xCBF29CE484222325
    assert fnv1a64(b"a") == 0xAF63DC4C8601EC8C
    assert fnv1a64(b"foobar") == 0x85944171F73967E8


def test_root_hash_is_llm_d_init_hash_bytes():
    # [fnv1a64(""), nil, "gemma"]: array(3), uint64 (0x1b + 8 bytes), null, text(5)
    payload = b"\x83\x1b" + struct.pack(">Q", 0xCBF29CE484222325) + b"\xf6\x65gemma"
    assert root_hash("gemma") == _fnv(payload)
    seeded = b"\x83\x1b" + struct.pack(">Q", _fnv(b"42")) + b"\xf6\x65gemma"
    assert root_hash("gemma", seed="42") == _fnv(seeded)


def test_block_hash_canonical_cbor_of_every_integer_width():
    toks = [0, 23, 24, 255, 256, 65535, 65536, 262143]
    body = (
        b"\x88"  # array of 8
        b"\x00\x17\x18\x18\x18\xff\x19\x01\x00\x19\xff\xff\x1a\x00\x01\x00\x00\x1a\x00\x03\xff\xff"
    )
    assert block_hash(7, toks) == _fnv(b"\x83\x07" + body + b"\xf6")
    parent = 0x1234  # two-byte parent
    assert block_hash(parent, toks) == _fnv(b"\x83\x19\x12\x34" + body + b"\xf6")


def test_tenant_extra_is_an_mm_hash_list():
    assert tenant_extra("") is None
    t = tenant_extra("salt:abc")
    assert t is not None and t.startswith("tenant:") and len(t) == 7 + 32
    assert extra_cbor(None) == b"\xf6"
    assert extra_cbor("xy") == b"\x81\xa1\x64Hash\x62xy"


def test_hasher_chains_full_blocks_only_and_extends_incrementally():
    h = BlockHasher(4, "m")
    toks = list(range(100, 111))  # 2 full blocks + 3 tokens
    got = h.hashes(toks)
    b0 = block_hash(root_hash("m"), toks[0:4])
    b1 = block_hash(b0, toks[4:8])
    assert got == [b0, b1]
    assert h.hashes(toks, start=1, parent=b0) == [b1]
    assert h.hashes(toks, end=1) == [b0]
    # under isolation every block mixes the tenant in; two tenants never share a hash
    a, b = h.hashes(toks, "key:a"), h.hashes(toks, "key:b")
    ext = extra_cbor(tenant_extra("key:a"))
    assert a[0] == block_hash(root_hash("m"), toks[0:4], ext)
    assert not set(a) & set(b) and not set(a) & set(got)


def test_hashing_from_many_threads_at_first_use():
    import server.kv_events.kv_blocks as kb

    kb._small = None  # as at import: the first hashes build the integer table
    toks = list(range(70000, 70000 + 64)) + list(range(64))
    want = [block_hash(1, toks[i : i + 16]) for i in range(0, 128, 16)]
    kb._small = None
    got: list[list[int]] = []
    errors: list[BaseException] = []

    def work() -> None:
        try:
            got.append([block_hash(1, toks[i : i + 16]) for i in range(0, 128, 16)])
        except BaseException as e:  # an unfinished table: IndexError
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and got == [want] * 8


def _ledger(bs: int = 2) -> tuple[KVEvents, list[list]]:
    out: list[list] = []
    return KVEvents(BlockHasher(bs, "m"), out.append), out


def test_ledger_publishes_first_holder_and_last_holder_only():
    ev, out = _ledger()
    hs = ev.hasher.hashes([1, 2, 3, 4, 5, 6])
    ev.change("GPU", [Chain(hs, [1, 2, 3, 4, 5, 6])], [])
    assert out == [[["BlockStored", hs, None, [1, 2, 3, 4, 5, 6], 2, None, "GPU"]]]
    # a second holder shares the first two blocks and adds one: only that one is new
    hs2 = ev.hasher.hashes([1, 2, 3, 4, 9, 9])
    ev.change("GPU", [Chain(hs2, [1, 2, 3, 4, 9, 9])], [])
    assert out[-1] == [["BlockStored", [hs2[2]], hs2[1], [9, 9], 2, None, "GPU"]]
    # the first holder goes: its own last block goes; the shared ones stay
    ev.change("GPU", [], hs)
    assert out[-1] == [["BlockRemoved", [hs[2]], "GPU"]]
    assert ev.held("GPU") == set(hs2)
    # media are apart: the same blocks in the RAM cache are stored again there
    ev.change("CPU", [Chain(hs2, [1, 2, 3, 4, 9, 9])], [])
    assert out[-1] == [["BlockStored", hs2, None, [1, 2, 3, 4, 9, 9], 2, None, "CPU"]]
    n = len(out)
    ev.change("GPU", [Chain(hs2, [1, 2, 3, 4, 9, 9])], hs2)  # moved: nothing to say
    assert len(out) == n
    ev.cleared()
    assert out[-1] == [["AllBlocksCleared"]] and ev.held("GPU") == set()


def test_ledger_tenant_blocks_carry_extra_keys():
    ev, out = _ledger()
    hs = ev.hasher.hashes([1, 2, 3, 4], "key:a")
    ev.change("GPU", [Chain(hs, [1, 2, 3, 4], None, "key:a")], [])
    t = tenant_extra("key:a")
    assert out[-1] == [["BlockStored", hs, None, [1, 2, 3, 4], 2, None, "GPU", None, [[t], [t]]]]


class _Held:
    TIER = "ram"

    def __init__(self, key: str = "") -> None:
        self.key = key


def test_index_listener_maps_tiers_and_survives_a_discard_before_the_add():
    ev, out = _ledger()
    h = _Held()
    ev.added(h, [5, 6, 7, 8, 9])
    hs = ev.hasher.hashes([5, 6, 7, 8])
    assert out[-1] == [["BlockStored", hs, None, [5, 6, 7, 8], 2, None, "CPU"]]
    ev.discarded(h)
    assert out[-1] == [["BlockRemoved", hs, "CPU"]]
    late = _Held()
    late.TIER = "disk"
    n = len(out)
    ev.discarded(late)  # another thread's discard ran first: the add is then ignored
    ev.added(late, [5, 6, 7, 8])
    assert len(out) == n and ev.held("DISK") == set()
    other = _Held()
    other.TIER = "elsewhere"
    ev.added(other, [1, 2])
    assert len(out) == n


def _slot(toks: list[int], w: SlotWatcher) -> Slot:
    """A slot wired as SlotStore wires them: its sequence tells the block index, which
    tells the watcher."""
    s = Slot(0, 100)
    ix = BlockIndex()
    ix.listeners.append(w)
    s.seq.watch = functools.partial(ix.changed, s.id)
    s.seq.extend(toks)
    return s


def test_slot_watcher_follows_extend_cut_shift_and_assign():
    ev, out = _ledger(2)
    w = SlotWatcher(ev, 1)
    s = _slot([1, 2, 3], w)
    w.sync([s])
    b = ev.hasher.hashes([1, 2, 3, 4, 5, 6])
    assert out[-1] == [["BlockStored", [b[0]], None, [1, 2], 2, None, "GPU"]]
    s.seq.extend([4])
    w.sync([s])
    assert out[-1] == [["BlockStored", [b[1]], b[0], [3, 4], 2, None, "GPU"]]
    n = len(out)
    s.seq.extend([5])
    w.sync([s])  # no full block yet: nothing
    assert len(out) == n
    s.seq.truncate(3)  # cut inside block 1: block 1 goes
    s.seq.extend([9, 9])
    w.sync([s])
    c = ev.hasher.hashes([1, 2, 3, 9])
    assert out[-1] == [
        ["BlockStored", [c[1]], b[0], [3, 9], 2, None, "GPU"],
        ["BlockRemoved", [b[1]], "GPU"],
    ]
    s.tokens = [1, 2, 3, 9, 9]  # assigned the same tokens (a restore): nothing changes
    n = len(out)
    w.sync([s])
    assert len(out) == n
    s.seq.remove(0, 2)  # a shift: every block after the removed tokens moves
    w.sync([s])
    d = ev.hasher.hashes([3, 9, 9])
    assert out[-1] == [["BlockStored", d, None, [3, 9], 2, None, "GPU"], ["BlockRemoved", c, "GPU"]]
    s.tokens = []  # cleared
    w.sync([s])
    assert out[-1] == [["BlockRemoved", d, "GPU"]] and ev.held("GPU") == set()


def test_wire_frames_are_vllm_batches():
    seq, payload = encode(258, 12.5, [["AllBlocksCleared"]])
    assert seq == b"\x00\x00\x00\x00\x00\x00\x01\x02"
    assert msgpack.unpackb(payload) == [12.5, [["AllBlocksCleared"]], 0]


def test_publisher_never_blocks_and_counts_drops_with_gaps():
    gate = threading.Event()
    frames: list[list[bytes]] = []

    def send(f: list[bytes]) -> bool:
        gate.wait(5)
        frames.append(f)
        return True

    pub = KVPublisher("inproc://x", "kv@h@m", max_queue=2, settle_s=0, sender=send)
    pub.start()
    for i in range(6):  # the sender holds one, the queue two: three are dropped
        pub.publish([["AllBlocksCleared"]])
        if i == 0:
            while pub._q.qsize():  # the sender took the first
                pass
    assert pub.dropped == 3 and pub.seq == 5
    gate.set()
    pub.close()
    seqs = [int.from_bytes(f[1], "big") for f in frames]
    assert [f[0] for f in frames] == [b"kv@h@m"] * 3
    assert seqs == [0, 1, 2] and pub.sent == 3
    # a refused send (ZMQ high-water mark) counts as a drop too
    pub2 = KVPublisher("inproc://y", "t", settle_s=0, sender=lambda f: False)
    pub2.start()
    pub2.publish([])
    pub2.close()
    assert pub2.dropped == 1 and pub2.sent == 0


# ---- exposure (issue 40) ---------------------------------------------------------------


def test_only_the_loopback_binds_without_confirmation():
    for ok in ("tcp://127.0.0.1:5557", "tcp://localhost:5557", "tcp://[::1]:5557",
               "tcp://127.0.0.2:1", "ipc:///tmp/kv.sock", "inproc://kv"):  # fmt: skip
        assert endpoint_problem(ok) == "", ok
    for bad in ("tcp://*:5557", "tcp://0.0.0.0:5557", "tcp://[::]:5557", "tcp://10.1.2.3:5557",
                "tcp://eth0:5557", "tcp://example.com:5557"):  # fmt: skip
        assert "--kv-events-allow-remote" in endpoint_problem(bad), bad
    assert normalize_endpoint("5557") == "tcp://127.0.0.1:5557"
    assert normalize_endpoint("tcp://*:1") == "tcp://*:1"
    # the flags: refused unless confirmed; a bare port is the loopback
    assert "every interface" in kv_setup.check(Settings(kv_events_endpoint="tcp://*:5557"))
    assert (
        kv_setup.check(Settings(kv_events_endpoint="tcp://*:1", kv_events_allow_remote=True)) == ""
    )
    assert kv_setup.check(Settings(kv_events_endpoint="5557")) == ""
    assert kv_setup.check(Settings()) == ""


def test_token_ids_are_withheld_under_a_key_or_isolation():
    assert kv_setup.token_policy(Settings()) == TOKENS_ALL
    assert kv_setup.token_policy(Settings(api_key="k")) == TOKENS_NONE
    assert kv_setup.token_policy(Settings(cache_isolation="salt")) == TOKENS_SHARED
    both = Settings(api_key="k", cache_isolation="key")
    assert kv_setup.token_policy(both) == TOKENS_NONE
    allowed = Settings(api_key="k", cache_isolation="key", kv_events_token_ids=True)
    assert kv_setup.token_policy(allowed) == TOKENS_ALL


def test_ledger_publishes_hashes_only_for_withheld_blocks():
    for policy, shown in ((TOKENS_ALL, (True, True)), (TOKENS_SHARED, (True, False)),
                          (TOKENS_NONE, (False, False))):  # fmt: skip
        out: list[list] = []
        ev = KVEvents(BlockHasher(2, "m"), out.append, policy)
        for tenant, show in zip(("", "key:abc"), shown, strict=True):
            hs = ev.hasher.hashes([1, 2, 3, 4], tenant)
            ev.change("GPU", [Chain(hs, [1, 2, 3, 4], None, tenant)], [])
            stored = out[-1][0]
            assert stored[1] == hs and stored[3] == ([1, 2, 3, 4] if show else []), policy
        # a tenant's blocks under an adapter set are still the tenant's
        hs = ev.hasher.hashes([7, 8], "key:abc|lora:00")
        ev.change("CPU", [Chain(hs, [7, 8], None, "key:abc|lora:00")], [])
        assert out[-1][0][3] == ([7, 8] if shown[1] else [])


def test_publisher_caps_subscription_size_and_count():
    port = _free_port()
    pub = KVPublisher(f"tcp://127.0.0.1:{port}", "kv@h@m", settle_s=0)
    pub.start()
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    sub.connect(f"tcp://127.0.0.1:{port}")
    try:
        _until_received(pub, sub)
        # a 1 MiB subscription: the peer is dropped at its frame's header
        big = zmtp_peer.connect(port)
        zmtp_peer.send_quietly(big, zmtp_peer.subscribe(b"x" * (1 << 20)))
        assert zmtp_peer.closed(big)
        big.close()
        assert pub.resets == 0
        _until_received(pub, sub)  # the real subscriber is not disturbed
        # too many distinct small ones: the socket is reset, freeing them all
        many = zmtp_peer.connect(port)
        many.sendall(b"".join(zmtp_peer.subscribe(f"junk{i}".encode()) for i in range(200)))
        deadline = time.time() + 10
        while pub.resets == 0 and time.time() < deadline:
            time.sleep(0.02)
        assert pub.resets == 1 and zmtp_peer.closed(many)
        many.close()
        _until_received(pub, sub)  # the real subscriber reconnects by itself
    finally:
        sub.close(0)
        ctx.term()
        pub.close()


def _until_received(pub: KVPublisher, sub: zmq.Socket, timeout: float = 15) -> None:
    """Publish until ``sub`` receives a batch (it may still be (re)subscribing)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        pub.publish([["AllBlocksCleared"]])
        if sub.poll(100):
            while sub.poll(0):
                sub.recv_multipart()
            return
    raise AssertionError("the subscriber received nothing")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
