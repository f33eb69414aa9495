"""The disk tier (server.tiers.disk): naming, the index and its eviction order, the writer,
replicas sharing a directory, and hostile files."""

from __future__ import annotations

import os
import struct
import time
from pathlib import Path

import pytest

from server.prefix.prefix_index import SlotBaseline
from server.tiers import slot_file
from server.tiers.disk import DiskIndex, DiskTier
from server.tiers.disk_files import (
    NAME_RE,
    TRAILER,
    BadFile,
    DiskEntry,
    FileCheck,
    clean_temp_files,
    encode_trailer,
    entry_name,
    host_label,
    read_header,
    tmp_name,
    write_entry,
)
from server.tiers.prompt_cache import PromptCache
from server.tiers.saved import SavedState
from server.types import Checkpoint

CHECK = FileCheck(version=3, n_ctx=4096, n_vocab=1000, model="m:1000")


def state(payload: bytes = b"x" * 100) -> bytearray:
    """A state buffer shaped like llama_state_seq_get_data's: 8-byte header, then bytes."""
    return bytearray(struct.pack("<Ii", slot_file.STATE_HEADER_MAGIC, 0) + payload)


def entry(tokens, tenant: str = "", payload: bytes = b"x" * 100, ckpts=()) -> SavedState:
    return SavedState(list(tokens), state(payload), b"", list(ckpts), tenant=tenant)


def tier(d: Path, limit: int = 1 << 30, **kw) -> DiskTier:
    kw.setdefault("sync_scan_s", 10.0)  # a loaded test machine: lookups wait for their scan
    t = DiskTier(d, limit, CHECK, **kw)
    t.start()
    return t


def written(t: DiskTier, *entries: SavedState) -> None:
    for e in entries:
        assert t.put(e)
    assert t.flush(10)


# ---- naming ---------------------------------------------------------------------------


def test_names_are_unique_ordered_and_plain():
    names = [entry_name("h", 42, now_ns=1000 + i) for i in range(50)]
    assert names == sorted(names) and len(set(names)) == 50
    assert all(NAME_RE.match(n) for n in names)
    same_time = {entry_name("h", 42, now_ns=7) for _ in range(100)}
    assert len(same_time) == 100  # the random part tells replicas apart
    assert NAME_RE.match(entry_name(host_label(), os.getpid()))
    assert not NAME_RE.match(tmp_name("h", 1)) and tmp_name("h", 1).startswith(".tmp-h-1-")


def test_host_label_is_a_safe_name_part(monkeypatch):
    monkeypatch.setattr("socket.gethostname", lambda: "pod/../x y\n" + "z" * 100)
    label = host_label()
    assert len(label) == 64 and all(c.isalnum() or c in "_." for c in label)


# ---- the file format ------------------------------------------------------------------


def test_written_entry_reads_back_from_headers_and_as_a_slot_file(tmp_path):
    ck = Checkpoint(3, 0, 2, bytearray(b"ck"), b"")
    e = entry([1, 2, 3, 4], tenant="salt:s1", ckpts=[ck])
    name, size, mtime = write_entry(tmp_path, e, CHECK.version, CHECK.model)
    assert NAME_RE.match(name) and os.listdir(tmp_path) == [name]
    got = read_header(tmp_path, name, CHECK)
    assert (got.tokens, got.tenant, got.nbytes, got.mtime_ns) == (
        [1, 2, 3, 4],
        "salt:s1",
        size,
        mtime,
    )
    assert got.body_len == size - len(encode_trailer("salt:s1", CHECK.model, 0))
    # the body is a slot file: llama.cpp's layout, then the checkpoint appendix
    parsed = slot_file.read_file(tmp_path / name, 4096, 1000, 5, CHECK.version)
    assert parsed.tokens == [1, 2, 3, 4]
    start = parsed.state_off
    assert bytes(parsed.buf[start + 8 : start + 108]) == b"x" * 100
    app = slot_file.parse_appendices(memoryview(parsed.buf)[: got.body_len], start + 108, 4)
    assert [(c.n_tokens, bytes(c.data)) for c in app.checkpoints] == [(3, b"ck")]
    assert app.warnings == []


def test_a_failed_write_leaves_nothing(tmp_path):
    bad = SavedState([1, 2], bytearray(b"no header here"))
    with pytest.raises(ValueError):
        write_entry(tmp_path, bad, CHECK.version, CHECK.model)
    assert os.listdir(tmp_path) == []


# ---- the index ------------------------------------------------------------------------


def de(name: str, tokens, nbytes: int = 10, mtime: int = 0, tenant: str = "") -> DiskEntry:
    return DiskEntry(name, list(tokens), tenant, nbytes, nbytes, mtime)


def test_eviction_order_is_oldest_first_by_mtime_then_name():
    ix = DiskIndex()
    for name, mtime in [("c", 30), ("a", 10), ("e", 20), ("b", 20), ("d", 40)]:
        ix.add(de(name, [ord(name)], 10, mtime))
    assert [e.name for e in ix.entries] == ["a", "b", "e", "c", "d"]
    assert ix.nbytes == 50
    assert [e.name for e in ix.over_limit(25)] == ["a", "b", "e"]
    assert [e.name for e in ix.entries] == ["c", "d"] and ix.nbytes == 20
    assert ix.over_limit(20) == []
    ix.add(de("c", [1]))  # a name already indexed is not added twice
    assert ix.nbytes == 20 and ix.remove("c").name == "c" and ix.remove("c") is None
    assert [e.name for e in ix.over_limit(0)] == ["d"] and ix.nbytes == 0


def test_find_follows_the_ram_rule_and_the_tenant():
    ix = DiskIndex()
    ix.add(de("long", range(100), mtime=1))
    ix.add(de("short", range(40), mtime=2))
    ix.add(de("other", range(200), mtime=3, tenant="k2"))
    prompt = list(range(150))
    e, n = ix.find(prompt, "", -1.0, 0.0)
    assert (e.name, n) == ("long", 100)
    # it must beat the slot's own state on f_sim too
    assert ix.find(prompt, "", -1.0, 100 / 150) is None
    assert ix.find(prompt, "k2", -1.0, 0.0)[0].name == "other"
    assert ix.find(prompt, "k3", -1.0, 0.0) is None
    # an entry sharing less than a quarter of itself is never taken
    assert ix.find(list(range(9)) + [999] * 100, "", -1.0, 0.0) is None  # 9/40, 9/100


def test_covers_and_prefixes_are_per_tenant():
    ix = DiskIndex()
    ix.add(de("a", [1, 2, 3], mtime=1))
    ix.add(de("b", [1, 2], mtime=2, tenant="t"))
    assert ix.covers([1, 2], "") and ix.covers([1, 2, 3], "") and not ix.covers([1, 2, 4], "")
    assert ix.covers([1, 2], "t") and not ix.covers([1, 2, 3], "t")
    assert [e.name for e in ix.prefixes_of([1, 2, 3, 4], "")] == ["a"]
    assert [e.name for e in ix.prefixes_of([1, 2, 3, 4], "", but="a")] == []


# ---- the tier -------------------------------------------------------------------------


def test_writer_indexes_replaces_prefixes_and_skips_covered(tmp_path):
    t = tier(tmp_path)
    written(t, entry(range(1, 50), "k"))
    written(t, entry(range(1, 30), "k"))  # covered by the longer one: not written
    written(t, entry(range(1, 30), "other"))  # another tenant's: written
    assert t.counters.writes == 2 and t.counters.covered == 1
    written(t, entry(range(1, 80), "k"))  # extends the first: replaces it
    assert t.counters.replaced == 1
    assert sorted(len(e.tokens) for e in t.index.entries) == [29, 79]
    assert sorted(os.listdir(tmp_path)) == sorted(e.name for e in t.index.entries)
    t.close()


def test_byte_limit_evicts_oldest_files_first(tmp_path):
    one = len(b"".join(bytes(p) for p in _parts(entry(range(10, 20)))))
    t = tier(tmp_path, limit=3 * one)
    for i in range(5):
        written(t, entry(range(100 * i + 1, 100 * i + 11)))
    assert t.counters.evictions == 2
    firsts = [e.tokens[0] for e in t.index.entries]
    assert firsts == [201, 301, 401]  # the two oldest went, in order
    assert len(os.listdir(tmp_path)) == 3 and t.index.nbytes == 3 * one
    assert not t.put(entry(range(1, 10), payload=b"y" * 4 * one))  # larger than the tier
    assert t.counters.too_large == 1
    t.close()


def _parts(e: SavedState):
    from server.tiers.disk_files import entry_parts

    return entry_parts(e, CHECK.version, CHECK.model)


def test_queued_entries_are_found_before_they_are_written(tmp_path):
    t = DiskTier(tmp_path, 1 << 30, CHECK)  # not started: nothing writes
    t.dir.mkdir(exist_ok=True)
    e = entry(range(1, 60), "k")
    assert t.put(e)
    hit = t.find(list(range(1, 70)), "k", SlotBaseline())
    assert hit is not None and hit.pending is e and hit.n_lcp == 59
    assert t.find(list(range(1, 70)), "other", SlotBaseline()) is None
    assert t.counters.misses == 1


def test_a_replica_sees_files_another_one_wrote_and_forgets_evicted_ones(tmp_path):
    a, b = tier(tmp_path), tier(tmp_path, rescan_s=0.0)
    written(a, entry(range(1, 40), "k"))
    hit = b.find(list(range(1, 45)), "k", SlotBaseline())  # miss, rescan, hit
    assert hit is not None and hit.entry is not None and hit.n_lcp == 39
    assert hit.entry.name == a.index.entries[0].name
    os.unlink(tmp_path / hit.entry.name)  # evicted by the other replica
    b.scan()
    assert b.index.entries == [] and b.index.nbytes == 0
    a.close(), b.close()


def test_misses_rescan_only_when_the_directory_changed(tmp_path):
    a, t = tier(tmp_path), tier(tmp_path, rescan_s=60.0)
    scans = t.counters.scans
    for _ in range(5):
        assert t.find([1, 2, 3], "", SlotBaseline()) is None
    assert t.counters.scans == scans and t.counters.misses == 5  # unchanged: no listing
    written(a, entry([1, 2, 3]))  # another replica renames a file in: the mtime moves
    hit = t.find([1, 2, 3, 4], "", SlotBaseline())
    assert hit is not None and hit.entry is not None and t.counters.scans == scans + 1
    a.close(), t.close()


def test_write_failure_is_counted_not_raised(tmp_path):
    d = tmp_path / "gone"
    t = tier(d)
    os.rmdir(d)
    written(t, entry(range(1, 9)))
    assert t.counters.write_failures == 1 and t.counters.writes == 0
    t.close()


def test_a_writer_too_far_behind_drops_evictions_but_not_a_spill(tmp_path):
    t = DiskTier(tmp_path, 1 << 30, CHECK, max_pending_bytes=250)  # not started
    assert t.put(entry([1]))  # ~108 bytes
    assert t.put(entry([2]))
    assert not t.put(entry([3])) and t.counters.write_drops == 1
    assert t.put(entry([3]), spill=True)  # the shutdown spill holds its buffers anyway
    assert len(t._q.items) == 3


def test_close_drops_what_is_still_queued(tmp_path):
    t = tier(tmp_path)
    t.close()
    assert not t.put(entry([1, 2])) and t.counters.write_drops == 1


def test_ram_cache_hands_evicted_and_too_large_entries_to_the_hook():
    got: list[SavedState] = []
    c = PromptCache(limit_bytes=250, limit_tokens=0)
    c.on_evict = got.append

    def save(tokens, size):
        return c.save(tokens, size, lambda: bytearray(size))

    assert save([1, 2, 3], 100).saved and save([4, 5, 6], 100).saved
    assert save([7, 8, 9], 100).saved  # evicts [1, 2, 3]
    assert [e.tokens for e in got] == [[1, 2, 3]]
    assert save([10, 11], 300).reason == "too-large"  # straight to the next tier
    assert [e.tokens for e in got] == [[1, 2, 3], [10, 11]] and len(got[1].data) == 300
    assert c.check_integrity() == []


# ---- hostile files --------------------------------------------------------------------


def _good(tokens=(1, 2, 3), tenant: bytes = b"", model: bytes = CHECK.model.encode()) -> bytes:
    body = struct.pack("<III", slot_file.GGSQ_MAGIC, CHECK.version, len(tokens))
    body += struct.pack(f"<{len(tokens)}i", *tokens) + bytes(state())
    return body + tenant + model + TRAILER.pack(len(tenant), len(model), len(body), 1, 0x4B534453)


def _name(i: int) -> str:
    return f"{i:016x}-h-1-{i:012x}.lsc"


HOSTILE = {
    "wrong magic": b"XXXX" + _good()[4:],
    "truncated": _good()[:-5],
    "half": _good()[:40],
    "empty": b"",
    "huge token count": struct.pack("<III", slot_file.GGSQ_MAGIC, CHECK.version, 2**31)
    + b"\0" * 64,
    "too many tokens": _good(tuple(range(5000))),
    "token outside vocab": _good((1, 5000, 2)),
    "negative token": _good((1, -1, 2)),
    "wrong version": _good()[:4] + struct.pack("<I", 99) + _good()[8:],
    "oversized labels": _good()[:-24] + struct.pack("<IIQII", 2**31, 2**31, 2**60, 1, 0x4B534453),
    "body_len lies": _good()[:-24] + struct.pack("<IIQII", 0, 6, 10, 1, 0x4B534453),
    "trailer version": _good()[:-8] + struct.pack("<II", 7, 0x4B534453),
    "tenant not utf-8": _good(tenant=b"\xff\xfe"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_file_is_refused(tmp_path, case):
    (tmp_path / _name(1)).write_bytes(HOSTILE[case])
    with pytest.raises(BadFile):
        read_header(tmp_path, _name(1), CHECK)


def test_another_models_file_is_foreign(tmp_path):
    (tmp_path / _name(1)).write_bytes(_good(model=b"other:1"))
    with pytest.raises(BadFile) as e:
        read_header(tmp_path, _name(1), CHECK)
    assert e.value.foreign


def test_hostile_directory_is_skipped_and_counted_once(tmp_path):
    d, outside = tmp_path / "d", tmp_path / "out"
    d.mkdir(), outside.mkdir()
    for i, data in enumerate(HOSTILE.values()):
        (d / _name(i + 10)).write_bytes(data)
    (outside / "x.lsc").write_bytes(_good())
    os.symlink(outside / "x.lsc", d / _name(1))  # a symlink out: a whole entry, not read
    os.symlink(outside / "missing", d / _name(2))  # a dangling one
    os.mkdir(d / _name(3))
    (d / "stray.txt").write_bytes(b"hi")  # not an entry's name: ignored, not counted
    (d / _name(4)).write_bytes(_good(model=b"other"))
    (d / _name(5)).write_bytes(_good((7, 8, 9), tenant=b"k"))  # the one good entry
    t = tier(d)
    n_bad = len(HOSTILE) + 3
    assert t.counters.bad_files == n_bad and t.counters.foreign_files == 1
    assert [(e.name, e.tenant) for e in t.index.entries] == [(_name(5), "k")]
    assert t.describe()["ignored_files"] == 1
    t.scan(), t.scan()
    assert t.counters.bad_files == n_bad  # unchanged files are not counted again
    (d / _name(10)).write_bytes(_good((4, 5)))  # repaired: examined again, and indexed
    t.scan()
    assert len(t.index.entries) == 2 and t.counters.bad_files == n_bad
    assert (outside / "x.lsc").exists()
    t.close()


def test_a_file_larger_than_the_tier_evicts_nothing(tmp_path):
    t = tier(tmp_path, limit=4000)
    written(t, entry([1, 2, 3]))
    with open(tmp_path / _name(1), "wb") as f:
        f.write(_good((4, 5)))
        f.truncate(1 << 40)  # sparse: a terabyte on paper
    t.scan()
    assert [e.tokens for e in t.index.entries] == [[1, 2, 3]] and t.counters.bad_files == 1
    t.close()


def test_refused_state_is_forgotten_and_not_indexed_again(tmp_path):
    (tmp_path / _name(1)).write_bytes(_good((1, 2, 3)))
    t = tier(tmp_path, rescan_s=0.0)
    hit = t.find([1, 2, 3, 4], "", SlotBaseline())
    assert hit is not None and hit.entry is not None
    t.failed(hit, "state refused", refuse=True)
    assert t.index.entries == [] and t.counters.load_failures == 1
    assert t.find([1, 2, 3, 4], "", SlotBaseline()) is None  # rescanned, still refused
    assert t.counters.bad_files == 1
    t.close()


# ---- interrupted writes ---------------------------------------------------------------


def test_temp_files_of_dead_writers_are_removed_and_never_indexed(tmp_path):
    me = host_label()
    dead = tmp_path / f".tmp-{me}-999999999-0123456789ab.lsc"
    dead.write_bytes(_good()[:50])  # a writer killed half way
    mine = tmp_path / f".tmp-{me}-{os.getpid()}-0123456789ab.lsc"  # a previous life's
    mine.write_bytes(_good())
    live = tmp_path / ".tmp-otherhost-1-0123456789ab.lsc"  # another replica, writing now
    live.write_bytes(b"ggsq")
    stale = tmp_path / ".tmp-otherhost-2-0123456789ab.lsc"
    stale.write_bytes(b"ggsq")
    old = time.time() - 7200
    os.utime(stale, (old, old))
    assert clean_temp_files(tmp_path) == 3
    assert sorted(os.listdir(tmp_path)) == [live.name]
    t = tier(tmp_path)
    assert t.index.entries == [] and t.counters.bad_files == 0
    t.close()


def test_slow_writer_leaves_only_a_temp_file_until_done(tmp_path):
    big = entry(range(1, 10), payload=b"z" * (3 << 20))
    t = tier(tmp_path, write_delay_s=0.05)
    assert t.put(big)
    deadline = time.time() + 10
    while not os.listdir(tmp_path) and time.time() < deadline:
        time.sleep(0.005)
    names = os.listdir(tmp_path)
    assert len(names) == 1 and names[0].startswith(".tmp-")
    assert t.scan() == 0  # never indexed while being written
    assert t.flush(10)
    assert len(t.index.entries) == 1 and not any(
        n.startswith(".tmp-") for n in os.listdir(tmp_path)
    )
    t.close()
