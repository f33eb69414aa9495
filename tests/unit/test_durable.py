"""Durable slot-file writes into recycled spares, the readers' locks, parallel reads
(server/tiers/durable.py, file_io.pread_into). Real files in a temporary directory."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from server.tiers import durable, file_io
from server.tiers import slot_file as sf

MIB = 1 << 20


@pytest.fixture(autouse=True)
def no_pause(monkeypatch):
    monkeypatch.setattr(durable, "QUIET_S", 0.0)  # spares written at once: tests wait for them


def save(path: Path, data: bytes) -> int:
    """write_durable as a slot save calls it: pieces that do not end on page boundaries."""
    n = durable.write_durable(sf.temp_for(path), path, [data[:3], memoryview(data)[3:]])
    durable.SPARES.wait()  # a save without a file to replace writes a spare meanwhile
    return n


def payload(n: int, seed: int) -> bytes:
    return (bytes([seed]) * 4093 + b"xyz")[: n % 4096] + bytes([seed]) * (n - n % 4096)


def names(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir())


def test_a_save_replacing_a_file_writes_into_the_spare_and_keeps_the_old_one_as_spare(
    tmp_path: Path,
):
    a, spare = tmp_path / "a.bin", tmp_path / durable.SPARE_NAME
    assert save(a, payload(MIB + 5, 1)) == MIB + 5
    # no file was replaced: a spare of zeros, as large, was written for the next save
    assert names(tmp_path) == sorted([durable.SPARE_NAME, "a.bin"])
    assert spare.read_bytes() == bytes(MIB + 5)
    first, blank = os.stat(a).st_ino, os.stat(spare).st_ino
    save(a, payload(MIB + 7, 2))
    assert a.read_bytes() == payload(MIB + 7, 2)  # a smaller spare grows
    assert os.stat(a).st_ino == blank  # written into the spare's blocks
    assert os.stat(spare).st_ino == first  # the replaced file is the next spare
    assert names(tmp_path) == sorted([durable.SPARE_NAME, "a.bin"])  # no temporary left


def test_a_spare_smaller_than_the_file_grows(tmp_path: Path):
    a, b = tmp_path / "a.bin", tmp_path / "b.bin"
    save(a, payload(MIB, 3))
    save(a, payload(MIB, 4))  # the first version is the spare: 1 MiB
    save(b, payload(3 * MIB + 1, 5))
    assert b.read_bytes() == payload(3 * MIB + 1, 5)
    assert a.read_bytes() == payload(MIB, 4)


def test_a_file_being_read_is_never_recycled_under_its_reader(tmp_path: Path):
    a, b = tmp_path / "a.bin", tmp_path / "b.bin"
    save(a, payload(MIB, 6))
    fd = durable.open_locked(a)
    try:
        save(a, payload(MIB, 7))  # the read file is swapped out: now the spare
        assert os.stat(tmp_path / durable.SPARE_NAME).st_ino == os.fstat(fd).st_ino
        save(b, payload(MIB, 8))  # finds the spare locked: writes a new file instead
        assert os.pread(fd, MIB, 0) == payload(MIB, 6)
        assert b.read_bytes() == payload(MIB, 8) and a.read_bytes() == payload(MIB, 7)
    finally:
        os.close(fd)


def test_open_locked_follows_a_swap_between_open_and_lock(tmp_path: Path, monkeypatch):
    a = tmp_path / "a.bin"
    save(a, payload(MIB, 1))
    real, swaps = durable.fcntl.flock, []

    def swap_then_lock(fd: int, op: int) -> None:
        if op & durable.fcntl.LOCK_SH and not swaps:
            swaps.append(1)  # a save swaps a new file in after this reader opened the old one
            save(a, payload(MIB, 2))
        real(fd, op)

    monkeypatch.setattr(durable.fcntl, "flock", swap_then_lock)
    fd = durable.open_locked(a)
    try:
        assert swaps and os.pread(fd, 4, 0) == payload(MIB, 2)[:4]
    finally:
        os.close(fd)


def test_a_failed_write_leaves_the_file_and_no_temporary(tmp_path: Path):
    a = tmp_path / "a.bin"
    save(a, payload(MIB, 1))
    with pytest.raises(TypeError):
        durable.write_durable(sf.temp_for(a), a, [b"abc", 42])  # type: ignore[list-item]
    assert a.read_bytes() == payload(MIB, 1)
    assert not [n for n in names(tmp_path) if n.startswith(".tmp-")]


def test_small_files_get_no_spare(tmp_path: Path):
    save(tmp_path / "a.bin", b"x" * 5000)
    assert names(tmp_path) == ["a.bin"]


@pytest.mark.parametrize("size", [MIB, MIB + 1, 3 * MIB - 4095, 1100 * MIB // 1024])
def test_write_zeros_writes_exactly_size(tmp_path: Path, size: int):
    z = tmp_path / "z"
    z.write_bytes(b"x" * 7)
    durable.write_zeros(z, size)
    assert z.read_bytes() == bytes(size)


def test_a_larger_spare_is_cut_to_the_file(tmp_path: Path):
    a, b = tmp_path / "a.bin", tmp_path / "b.bin"
    save(a, payload(3 * MIB, 1))
    save(a, payload(3 * MIB, 2))  # the first version is the spare: 3 MiB
    save(b, payload(MIB + 9, 3))
    assert b.read_bytes() == payload(MIB + 9, 3) and a.read_bytes() == payload(3 * MIB, 2)


@pytest.mark.parametrize("readers", [1, 3])
def test_pread_into_reads_in_parts_and_counts_a_short_file(tmp_path: Path, monkeypatch, readers):
    monkeypatch.setattr(file_io, "_READERS", readers)
    data = os.urandom(9 * MIB + 123)
    f = tmp_path / "f"
    f.write_bytes(data)
    with open(f, "rb") as fh:
        buf = bytearray(len(data))
        assert file_io.pread_into(fh.fileno(), buf) == len(data) and bytes(buf) == data
        longer = bytearray(12 * MIB)  # the file ends inside the last part
        assert file_io.pread_into(fh.fileno(), longer) == len(data)
        assert longer[: len(data)] == data


def test_a_reader_waits_a_bounded_time_for_a_file_locked_by_another_writer(
    tmp_path: Path, monkeypatch
):
    a = tmp_path / "a.bin"
    save(a, payload(MIB, 1))
    monkeypatch.setattr(durable, "LOCK_WAIT_S", 0.05)
    with open(a, "rb") as other:
        durable.fcntl.flock(other.fileno(), durable.fcntl.LOCK_EX)  # another program's lock
        with pytest.raises(OSError) as e:
            durable.open_locked(a)
        assert e.value.errno == durable.errno.EAGAIN
    fd = durable.open_locked(a)  # released: the reader gets it
    os.close(fd)
