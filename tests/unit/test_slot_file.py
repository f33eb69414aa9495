"""Slot file format: filenames, hostile bodies, appendix rules, round trips (no model)."""

from __future__ import annotations

import os
import struct
from array import array
from pathlib import Path

import pytest

from server.tiers import durable, file_io
from server.tiers import slot_file as sf
from server.types import Checkpoint

VERSION = 3


def state_buf(n: int = 64) -> bytearray:
    return bytearray(struct.pack("<Ii", sf.STATE_HEADER_MAGIC, 0)) + bytearray(range(n))


@pytest.mark.parametrize(
    "name",
    ["../x", "a/b", "..", "", "/etc/passwd", "a\nb", "a\x00b", ".hidden", " x", "x" * 256, "a\\b"],
)
def test_bad_filenames_are_rejected(name, tmp_path):
    with pytest.raises(sf.SlotFileError):
        sf.resolve(tmp_path, name)


def test_plain_names_resolve_inside(tmp_path):
    assert sf.resolve(tmp_path, "chat-1.bin") == tmp_path.resolve() / "chat-1.bin"
    assert sf.resolve(tmp_path, "é" * 100).parent == tmp_path.resolve()


def test_symlink_pointing_outside_is_rejected(tmp_path):
    (tmp_path / "out").mkdir()
    save = tmp_path / "save"
    save.mkdir()
    os.symlink(tmp_path / "out" / "target", save / "link")
    with pytest.raises(sf.SlotFileError, match="outside"):
        sf.resolve(save, "link")


def test_write_then_read_round_trip(tmp_path):
    ck = Checkpoint(3, 0, 2, bytearray(b"partial-state"), b"")
    path = tmp_path / "s.bin"
    n = sf.write_file(path, [5, 6, 7, 8], state_buf(), VERSION, [ck])
    assert n == path.stat().st_size
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".tmp")]
    p = sf.read_file(path, n_ctx=100, n_vocab=1000, seq=2, version=VERSION)
    assert p.tokens == [5, 6, 7, 8]
    hdr = struct.unpack_from("<Ii", p.buf, p.state_off)
    assert hdr == (sf.STATE_HEADER_MAGIC, 2)
    assert bytes(p.buf[p.state_off + 8 : p.state_off + 8 + 64]) == bytes(range(64))
    app = sf.parse_appendices(p.buf, p.state_off + 8 + 64, 4)
    assert [(c.n_tokens, bytes(c.data)) for c in app.checkpoints] == [(3, b"partial-state")]
    assert app.warnings == []


def write_raw(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def header(n_tokens: int, tokens=None, magic=sf.GGSQ_MAGIC, version=VERSION) -> bytes:
    toks = array("i", tokens if tokens is not None else range(n_tokens)).tobytes()
    return struct.pack("<III", magic, version, n_tokens) + toks


@pytest.mark.parametrize(
    "data,match",
    [
        (b"", "truncated"),
        (os.urandom(5000), "magic"),
        (header(3, magic=0x12345678) + b"x" * 50, "magic"),
        (header(3, version=99) + b"x" * 50, "version"),
        (struct.pack("<III", sf.GGSQ_MAGIC, VERSION, 2**31) + b"x" * 64, "claims"),
        (header(200) + b"x" * 50, "more than the slot"),
        (header(3, [1, 2, 5000]) + b"x" * 50, "vocabulary"),
        (header(3), "no sequence state"),
    ],
)
def test_hostile_bodies_are_rejected(tmp_path, data, match):
    with pytest.raises(sf.SlotFileError, match=match):
        sf.read_file(
            write_raw(tmp_path / "f", data), n_ctx=100, n_vocab=1000, seq=0, version=VERSION
        )


def test_missing_file_is_404(tmp_path):
    with pytest.raises(sf.SlotFileError) as e:
        sf.read_file(tmp_path / "nope", 100, 1000, 0, VERSION)
    assert e.value.status == 404


def test_llama_server_packed_token_list_is_read(tmp_path):
    packed = [-1, 1, 3, 11, 12, 13, 0]
    data = header(len(packed), packed) + b"s" * 40
    p = sf.read_file(write_raw(tmp_path / "f", data), 100, 1000, 0, VERSION)
    assert p.tokens == [11, 12, 13]


def test_packed_list_with_media_is_refused(tmp_path):
    packed = [-1, 1, 1, 11, 1, 0, 0]
    with pytest.raises(sf.SlotFileError, match="media"):
        sf.read_file(
            write_raw(tmp_path / "f", header(len(packed), packed) + b"s" * 40),
            100,
            1000,
            0,
            VERSION,
        )


def sckp(count: int, body: bytes, version: int = 1) -> bytearray:
    return bytearray(struct.pack("<III", sf.SCKP_MAGIC, version, count) + body)


def test_appendix_bad_magic_means_none():
    app = sf.parse_appendices(bytearray(b"ZZZZ" + b"\0" * 20), 0, 10)
    assert app.checkpoints == [] and app.warnings == []


def test_appendix_bad_version_is_ignored_with_warning():
    app = sf.parse_appendices(sckp(0, b"", version=7), 0, 10)
    assert app.checkpoints == [] and "version 7" in app.warnings[0]


def test_appendix_claiming_2_to_60_bytes_is_dropped_without_allocating():
    body = struct.pack("<qii", 5, 0, 4) + struct.pack("<Q", 2**60) + b"tiny" + bytes(16)
    app = sf.parse_appendices(sckp(1, body), 0, 10)
    assert app.checkpoints == [] and "exceeds" in app.warnings[0]


def test_truncated_appendix_is_dropped():
    body = struct.pack("<qii", 5, 0, 4)[:6]
    app = sf.parse_appendices(sckp(1, body), 0, 10)
    assert app.checkpoints == [] and app.warnings


def test_checkpoint_beyond_tokens_is_dropped():
    good = sf.encode_checkpoints(
        [Checkpoint(4, 0, 3, bytearray(b"a")), Checkpoint(50, 0, 49, bytearray(b"b"))]
    )
    app = sf.parse_appendices(bytearray(good), 0, 10)
    assert [c.n_tokens for c in app.checkpoints] == [4] and app.warnings


def test_failed_write_leaves_no_file_and_no_temp(tmp_path, monkeypatch):
    path = tmp_path / "s.bin"

    def disk_full(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(sf.os, "fdatasync", disk_full)
    with pytest.raises(OSError):
        sf.write_file(path, [1, 2], state_buf(), VERSION, [])
    assert os.listdir(tmp_path) == []


def test_failed_save_keeps_the_previous_file(tmp_path, monkeypatch):
    path = tmp_path / "s.bin"
    sf.write_file(path, [1, 2], state_buf(), VERSION, [])
    before = path.read_bytes()
    # the swap fails (as where renameat2 is refused), then the plain rename
    monkeypatch.setattr(durable, "_RENAMEAT2", lambda *a: -1)
    monkeypatch.setattr(sf.os, "replace", lambda *a: (_ for _ in ()).throw(OSError("crash")))
    with pytest.raises(OSError):
        sf.write_file(path, [9, 9, 9], state_buf(), VERSION, [])
    assert path.read_bytes() == before and os.listdir(tmp_path) == ["s.bin"]


def test_a_crafted_checkpoint_count_is_refused_before_reading_and_warned_once():
    # 200,000 declared checkpoints in a few bytes: refused at once, one warning
    app = sf.parse_appendices(sckp(200_000, b"\0" * 64), 0, 10)
    assert app.checkpoints == [] and len(app.warnings) == 1
    assert "200000 checkpoints" in app.warnings[0]
    # many that do not match the slot: one summary warning, not one each
    rec = struct.pack("<qii", 50, 0, 4) + struct.pack("<Q", 1) + b"x" + struct.pack("<QQ", 0, 0)
    app = sf.parse_appendices(sckp(300, rec * 300), 0, 10)
    assert app.checkpoints == [] and app.warnings == [
        "300 of 300 checkpoints do not match the slot; dropped"
    ]


def test_a_file_truncated_while_read_is_an_error_not_a_sigbus(tmp_path, monkeypatch):
    """Slot files are read into a buffer of ours, never mapped: another process truncating
    one mid-restore (issue 25: a mapped disk entry died of SIGBUS) is a short read, a 400."""
    path = tmp_path / "s.bin"
    sf.write_file(path, [5, 6, 7], state_buf(), VERSION, [])
    real = file_io.pread_into

    def truncating(fd: int, buf: bytearray) -> int:
        os.truncate(path, 20)  # another writer, between the size check and the read
        return real(fd, buf)

    monkeypatch.setattr(file_io, "pread_into", truncating)
    with pytest.raises(sf.SlotFileError, match="changed while read") as e:
        sf.read_file(path, n_ctx=100, n_vocab=1000, seq=2, version=VERSION)
    assert e.value.status == 400


def test_pread_into_fills_the_buffer_and_reports_short_files(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(bytes(range(256)) * 3)
    buf = bytearray(768)
    with open(path, "rb") as f:
        assert file_io.pread_into(f.fileno(), buf) == 768
    assert bytes(buf) == bytes(range(256)) * 3
    with open(path, "rb") as f:
        assert file_io.pread_into(f.fileno(), bytearray(1000)) == 768


def test_a_large_file_is_read_into_private_huge_page_memory(tmp_path):
    """From HUGE_BUFFER_MIN bytes a file is read into anonymous memory (not a zero-filled
    bytearray, never the file mapped): the same bytes, the same parse, and writable, so
    the state header is rebuilt in place; the file changing afterwards changes nothing."""
    big = state_buf(0) + bytearray(bytes(range(251)) * (sf.HUGE_BUFFER_MIN // 251 + 1))
    cks = [Checkpoint(n, 0, n - 1, bytearray(b"c%d" % n), b"") for n in (2, 3)]
    path = tmp_path / "big.bin"
    n = sf.write_file(path, [5, 6, 7, 8], big, VERSION, cks, tenant="t")
    p = sf.read_file(path, n_ctx=100, n_vocab=1000, seq=1, version=VERSION)
    assert not isinstance(p.buf, bytearray) and len(p.buf) == n == p.n_read
    assert struct.unpack_from("<Ii", p.buf, p.state_off) == (sf.STATE_HEADER_MAGIC, 1)
    state_end = p.state_off + len(big)
    assert bytes(p.buf[p.state_off + 8 : state_end]) == bytes(big[8:])
    # a file with several checkpoints (as saved before one per file) still reads them all
    app = sf.parse_appendices(memoryview(p.buf)[: p.end], state_end, 4)
    assert [bytes(c.data) for c in app.checkpoints] == [b"c2", b"c3"] and p.tenant == "t"
    path.write_bytes(b"\0" * n)  # overwritten: our copy is private
    assert bytes(p.buf[p.state_off + 8 : p.state_off + 16]) == bytes(big[8:16])


def test_write_file_reports_the_time_of_each_part_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "s.bin"
    parts: dict[str, float] = {}
    n = sf.write_file(path, [1, 2], state_buf(), VERSION, [], tenant="t", parts=parts)
    assert set(parts) == {"prepare", "write", "sync", "rename"} and min(parts.values()) >= 0
    assert path.stat().st_size == n and [p.name for p in tmp_path.iterdir()] == ["s.bin"]


def random_state(n: int) -> bytearray:
    return bytearray(struct.pack("<Ii", sf.STATE_HEADER_MAGIC, 0)) + os.urandom(n)


def test_state_buffers_reuse_the_largest_idle_buffer_up_to_the_limit():
    pool = file_io.StateBuffers(keep_max=8 << 20)
    big = pool.take(3 << 20)
    assert len(big) == 4 << 20  # whole huge pages: a slightly larger state fits later
    pool.give(big)
    assert pool.take(4 << 20) is big and pool.take(10) is not big  # taken: not shared
    pool.give(bytearray(10))
    pool.give(big)
    assert pool.take(100) is big  # the largest is the one kept
    huge = pool.take(9 << 20)
    pool.give(huge)
    assert pool.take(9 << 20) is not huge  # over keep_max: dropped, never held


def test_a_file_read_into_a_larger_reused_buffer_sees_only_its_own_bytes(tmp_path):
    big, small = tmp_path / "big.bin", tmp_path / "small.bin"
    small_state = random_state(1 << 20)
    sf.write_file(big, [5, 6, 7], random_state(3 << 20), VERSION, [], tenant="t")
    sf.write_file(small, [5, 6], small_state, VERSION, [])
    p = sf.read_file(big, 100, 1000, 0, VERSION)
    pooled = p.pooled
    assert p.tenant == "t" and pooled is not None
    sf.release(p)
    assert p.pooled is None  # given back once
    q = sf.read_file(small, 100, 1000, 1, VERSION)  # the same buffer, the big file's tail in it
    assert q.pooled is pooled and len(q.buf) == small.stat().st_size
    assert (q.tokens, q.tenant, q.end) == ([5, 6], None, len(q.buf))
    state_end = q.state_off + len(small_state)
    assert bytes(q.buf[q.state_off + 8 : state_end]) == bytes(small_state[8:])
    assert bytes(q.buf[state_end:]) == sf.encode_checkpoints([])  # then its own appendix
    sf.release(q)


def test_a_failed_write_leaves_neither_file_nor_temporary(tmp_path, monkeypatch):
    path = tmp_path / "s.bin"
    state = random_state(9 << 20)
    sf.write_file(path, [1], state, VERSION, [])  # several 4 MiB chunks
    assert path.read_bytes()[16:] == state[8:] + sf.encode_checkpoints([])
    durable.SPARES.wait()  # a spare was written for the next save: that one takes it

    def full(fd, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "write", full)
    monkeypatch.setattr(os, "writev", full)
    with pytest.raises(OSError):
        sf.write_file(tmp_path / "t.bin", [1], random_state(2 << 20), VERSION, [])
    assert [p.name for p in tmp_path.iterdir()] == ["s.bin"]  # the spare went with it
