"""The disk tier against other writers in its directory (issue 25, section 5): entries are
read with pread into one buffer, never mapped, so a file truncated or rewritten under the
reader is a counted miss, not a SIGBUS; and junk files, however many, are ignored unread,
with every listing on the scanner thread, never on the lookup's."""

from __future__ import annotations

import os
import struct
import threading
import time
from pathlib import Path

import pytest

from server.engine import disk_glue
from server.kv.store import Restored
from server.prefix.prefix_index import SlotBaseline
from server.tiers import disk as disk_mod
from server.tiers import disk_files, slot_file
from server.tiers.disk import DiskTier
from server.tiers.disk_files import EntryChanged, read_entry

from .test_disk_cache import CHECK, entry, tier, written


def _one_entry(tmp_path: Path, tokens=range(1, 40), payload: bytes = b"s" * 5000) -> DiskTier:
    t = tier(tmp_path)
    written(t, entry(tokens, payload=payload))
    assert len(t.index.entries) == 1
    return t


def _path(t: DiskTier) -> Path:
    return t.dir / t.index.entries[0].name


# ---- reading an entry -----------------------------------------------------------------


def test_an_entry_is_read_whole_into_one_buffer_with_the_state_header(tmp_path):
    t = _one_entry(tmp_path)
    e = t.index.entries[0]
    raw = _path(t).read_bytes()
    buf, off = read_entry(t.dir, e, CHECK, seq=3)
    assert type(buf) is bytearray and len(buf) == e.nbytes == len(raw)
    assert off == 12 + 4 * len(e.tokens) - 8
    assert struct.unpack_from("<Ii", buf, off) == (slot_file.STATE_HEADER_MAGIC, 3)
    assert buf[:off] == raw[:off] and buf[off + 8 :] == raw[off + 8 :]
    t.close()


def test_a_file_truncated_after_it_was_indexed_is_a_miss(tmp_path):
    t = _one_entry(tmp_path)
    e = t.index.entries[0]
    os.truncate(_path(t), e.nbytes // 2)
    with pytest.raises(EntryChanged, match="changed since it was indexed"):
        read_entry(t.dir, e, CHECK, seq=0)
    t.close()


def _hook_preadv(monkeypatch, act) -> list[int]:
    """Run ``act`` once, just before the first pread of an entry: another writer, mid-read."""
    real, calls = os.preadv, []

    def preadv(fd, buffers, offset):
        if not calls:
            act()
        calls.append(offset)
        return real(fd, buffers, offset)

    monkeypatch.setattr(disk_files.os, "preadv", preadv)
    return calls


def test_a_file_truncated_while_read_is_a_miss(tmp_path, monkeypatch):
    t = _one_entry(tmp_path)
    e, path = t.index.entries[0], _path(t)
    calls = _hook_preadv(monkeypatch, lambda: os.truncate(path, 100))
    with pytest.raises(EntryChanged, match=f"truncated while read \\(100 of {e.nbytes} bytes"):
        read_entry(t.dir, e, CHECK, seq=0)
    assert calls == [0, 100]  # read up to the new end, then nothing: short
    t.close()


def test_a_file_rewritten_in_place_while_read_is_a_miss(tmp_path, monkeypatch):
    t = _one_entry(tmp_path)
    e, path = t.index.entries[0], _path(t)

    def scribble() -> None:
        st = os.stat(path)
        with open(path, "r+b") as f:
            f.seek(2000)
            f.write(b"\x00" * 64)  # same size
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # mtime put back: ctime moves

    _hook_preadv(monkeypatch, scribble)
    with pytest.raises(EntryChanged, match="written while it was read"):
        read_entry(t.dir, e, CHECK, seq=0)
    t.close()


def test_a_file_that_grows_while_read_is_a_miss(tmp_path, monkeypatch):
    t = _one_entry(tmp_path)
    path = _path(t)

    def grow() -> None:
        with open(path, "ab") as f:
            f.write(b"more")

    _hook_preadv(monkeypatch, grow)
    with pytest.raises(EntryChanged, match="grew while it was read"):
        read_entry(t.dir, t.index.entries[0], CHECK, seq=0)
    t.close()


class _Slot:
    def __init__(self) -> None:
        self.id, self.tokens, self.tenant, self.n_ctx = 0, [7, 7, 7], "", 4096


class _Store:
    """Records restores; a real SlotStore is exercised end to end (tests/e2e)."""

    def __init__(self) -> None:
        self.restored: list[tuple[bytes, int]] = []

    def restore(self, slot, state, trusted):
        w = state.data
        self.restored.append((bytes(w.buf[w.state_off : w.end]), len(state.tokens)))
        slot.tokens = state.tokens
        return Restored(True, len(w))


def test_the_loader_counts_a_truncated_entry_as_a_miss_and_the_slot_stays(tmp_path):
    t = _one_entry(tmp_path)
    e = t.index.entries[0]
    store, slot = _Store(), _Slot()
    prompt = list(range(1, 50))
    os.truncate(_path(t), e.nbytes - 10)  # another process, just before the load
    assert not disk_glue.load(store, t, slot, prompt, "")  # type: ignore[arg-type]
    c = t.counters
    assert (c.changed_files, c.load_failures, c.misses, c.hits) == (1, 1, 1, 0)
    assert store.restored == [] and slot.tokens == [7, 7, 7] and t.index.entries == []
    t.scan()  # the truncated file is examined afresh: bad (its trailer is gone), once
    t.scan()
    assert t.counters.bad_files == 1 and t.index.entries == []
    t.close()


def test_the_loader_restores_from_the_buffer_read(tmp_path):
    t = _one_entry(tmp_path, payload=b"p" * 3000)
    store, slot = _Store(), _Slot()
    assert disk_glue.load(store, t, slot, list(range(1, 50)), "")  # type: ignore[arg-type]
    ((state, n),) = store.restored
    assert n == 39 and state[8:].startswith(b"p" * 3000)  # then the appendices
    assert b"p" * 3001 not in state
    assert state[:8] == struct.pack("<Ii", slot_file.STATE_HEADER_MAGIC, 0)
    assert t.counters.hits == 1 and t.counters.bytes_read == t.index.entries[0].nbytes
    t.close()


# ---- junk in the directory ------------------------------------------------------------

N_JUNK = 20_000


def _junk(d: Path, n: int, tag: str = "junk") -> None:
    for i in range(n):
        os.close(os.open(d / f"{tag}-{i:05d}.bin", os.O_CREAT | os.O_WRONLY, 0o644))


class _Calls:
    """os.listdir / os.lstat calls the disk tier makes, by thread."""

    def __init__(self, monkeypatch) -> None:
        self.listdir: list[str] = []
        self.lstat: list[str] = []
        real_listdir, real_lstat = os.listdir, os.lstat

        def listdir(p):
            self.listdir.append(threading.current_thread().name)
            return real_listdir(p)

        def lstat(p):
            self.lstat.append(os.path.basename(p))
            return real_lstat(p)

        monkeypatch.setattr(disk_mod.os, "listdir", listdir)  # the os module: every caller
        monkeypatch.setattr(disk_mod.os, "lstat", lstat)


def test_junk_files_are_ignored_unread_and_never_listed_by_lookups(tmp_path, monkeypatch):
    _junk(tmp_path, N_JUNK)
    calls = _Calls(monkeypatch)
    t = tier(tmp_path, rescan_s=0.0)
    other = tier(tmp_path, rescan_s=3600.0)  # a replica writing into the same directory
    info = t.describe()
    assert info["ignored_files"] == N_JUNK and info["counters"]["bad_files"] == 0
    assert not any(n.startswith("junk-") for n in calls.lstat)  # start-up: never examined
    calls.listdir.clear()  # start-up listed on this thread; lookups must not
    for i in range(5):  # misses, each after the directory changed: all listings elsewhere
        written(other, entry([100 + i] * 3))
        (tmp_path / f"more-{i}.bin").write_bytes(b"x")
        hit = t.find([100 + i] * 3 + [5], "", SlotBaseline())
        assert hit is not None and hit.entry is not None and hit.n_lcp == 3
    assert calls.listdir and threading.current_thread().name not in calls.listdir
    assert not any(n.startswith(("junk-", "more-")) for n in calls.lstat)  # never examined
    assert t.describe()["ignored_files"] == N_JUNK + 5
    assert t.counters.bad_files == 0 and len(t.index.entries) == 5
    t.close(), other.close()


def test_a_slow_scan_is_not_waited_for_and_catches_up_off_the_lookup(tmp_path):
    a, t = tier(tmp_path, rescan_s=3600.0), tier(tmp_path, rescan_s=3600.0, sync_scan_s=0.2)
    written(a, entry([1, 2, 3]))
    t._last_scan_s = 1.0  # as if the last listing took a second: the lookup must not wait
    t0 = time.monotonic()
    assert t.find([1, 2, 3, 4], "", SlotBaseline()) is None
    assert time.monotonic() - t0 < 0.15 and t.counters.misses == 1
    deadline = time.monotonic() + 10
    while not t.index.entries and time.monotonic() < deadline:
        time.sleep(0.01)  # the scanner it asked for indexes the file meanwhile
    assert [e.tokens for e in t.index.entries] == [[1, 2, 3]]
    hit = t.find([1, 2, 3, 4], "", SlotBaseline())
    assert hit is not None and hit.n_lcp == 3
    a.close(), t.close()


def test_junk_removed_is_forgotten(tmp_path):
    _junk(tmp_path, 50)
    t = tier(tmp_path)
    assert t.describe()["ignored_files"] == 50
    for n in os.listdir(tmp_path):
        os.unlink(tmp_path / n)
    t.scan()
    assert t.describe()["ignored_files"] == 0
    t.close()
