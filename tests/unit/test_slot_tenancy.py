"""Tenant names across processes, slot files' STNT footer, and slot-file appendices parsed
off the engine thread (issue 25, sections 4 and 6). Fake backend; exact values."""

from __future__ import annotations

import struct
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from server.kv.file_plan import parse_after_state
from server.protocols import slots as slots_route
from server.service.state import tenant_of
from server.settings.config import Settings
from server.tiers import slot_file as sf
from server.tiers import tenancy
from server.tiers.disk import DiskTier
from server.types import Checkpoint
from tests.fake_backend import FakeBackend
from tests.unit.helpers import route_client, task

from .test_disk_cache import CHECK, entry


def _state(mode: str) -> SimpleNamespace:
    return SimpleNamespace(settings=SimpleNamespace(cache_isolation=mode))


def _request(key: str = "") -> SimpleNamespace:
    return SimpleNamespace(state=SimpleNamespace(api_key_id=key))


def test_a_saltless_tenant_is_fresh_random_and_never_persisted():
    st = _state("salt")
    names = {tenant_of(st, _request()) for _ in range(100)}
    assert len(names) == 100  # never the same twice (a counter restarted at 1 per process)
    for n in names:
        assert n.startswith("private:") and len(n) == len("private:") + 32
        assert tenancy.is_private(n) and not tenancy.persistable(n)


def test_salt_and_key_tenants_are_stable_digests():
    # the same in every process: derived from the salt and key alone, never holding them
    salted = tenant_of(_state("salt"), _request(), "my-secret-salt")
    assert (
        salted
        == tenancy.salt_tenant("my-secret-salt")
        == tenant_of(_state("none"), _request(), "my-secret-salt")
    )
    assert "my-secret-salt" not in salted and len(salted) == len("salt:") + 32
    assert tenant_of(_state("key"), _request("d1"), "my-secret-salt") == f"key:d1/{salted}"
    assert tenant_of(_state("none"), _request()) == "" and tenancy.persistable(salted)


def test_the_disk_tier_never_queues_a_private_tenants_entry(tmp_path):
    t = DiskTier(tmp_path, 1 << 30, CHECK)  # not started: the queue is visible
    assert not t.put(entry([1, 2, 3], tenant=tenancy.private_tenant()), spill=True)
    assert t.put(entry([1, 2, 3], tenant=tenancy.salt_tenant("s")), spill=True)
    assert [e.tenant for e in t._q.items] == [tenancy.salt_tenant("s")]


def _write(path: Path, tenant: str | None, ckpts: list[Checkpoint] | None = None) -> int:
    state = bytearray(struct.pack("<Ii", sf.STATE_HEADER_MAGIC, 0) + bytes(range(64)))
    return sf.write_file(path, [5, 6, 7, 8], state, 1, ckpts or [], tenant=tenant)


def test_a_slot_file_records_its_tenant_after_its_appendices(tmp_path):
    ck = Checkpoint(3, 0, 2, bytearray(b"partial"), b"")
    size = _write(tmp_path / "s.bin", "key:abc/salt:00ff", [ck])
    p = sf.read_file(tmp_path / "s.bin", 100, 1000, 0, 1)
    assert p.tenant == "key:abc/salt:00ff" and p.end == size - 12 - len("key:abc/salt:00ff")
    app = parse_after_state(p, p.state_off + 8 + 64, None)
    assert [c.n_tokens for c in app.checkpoints] == [3] and app.warnings == []
    _write(tmp_path / "e.bin", "")
    assert sf.read_file(tmp_path / "e.bin", 100, 1000, 0, 1).tenant == ""


@pytest.mark.parametrize(
    "tail",
    [
        b"",
        struct.pack("<III", 10**6, 1, sf.STNT_MAGIC),
        b"\xff\xfe" + struct.pack("<III", 2, 1, sf.STNT_MAGIC),
    ],
    ids=["none", "longer-than-the-file", "not-utf8"],
)
def test_a_file_without_a_readable_footer_has_no_tenant(tmp_path, tail):
    _write(tmp_path / "s.bin", None)  # llama-server's files end after the state too
    (tmp_path / "s.bin").write_bytes((tmp_path / "s.bin").read_bytes() + tail)
    p = sf.read_file(tmp_path / "s.bin", 100, 1000, 0, 1)
    assert (p.tenant, p.end) == (None, len(p.buf))


def test_checkpoints_are_walked_and_only_the_last_kept_are_copied():
    ckpts = [Checkpoint(i, 0, i - 1, bytearray(b"%d" % i), b"d") for i in range(1, 41)]
    app = sf.parse_appendices(bytearray(sf.encode_checkpoints(ckpts)), 0, 100, 8)
    assert [c.n_tokens for c in app.checkpoints] == list(range(33, 41))
    assert bytes(app.checkpoints[-1].data) == b"40" and app.checkpoints[-1].data_dft == b"d"
    assert app.warnings == ["32 checkpoints past the slot's 8; dropped"]
    app = sf.parse_appendices(bytearray(sf.encode_checkpoints(ckpts * 103)), 0, 100)
    assert app.checkpoints == [] and "4120 checkpoints, more than the 4096" in app.warnings[0]


class FileBackend(FakeBackend):
    """The fake backend with llama.cpp's slot-file body (ggsq header, tokens, state) and
    the 8-byte state header; ``known``: whether its state layout can be read unloaded."""

    state_file_version = 1

    def __init__(self, known: bool, **kw) -> None:
        super().__init__(**kw)
        self.known = known

    def state_get(self, seq, partial=False, size=None):
        data = super().state_get(seq, partial, size)
        if partial:
            return data
        return bytearray(struct.pack("<Ii", sf.STATE_HEADER_MAGIC, seq)) + data

    def state_set(self, seq, data, partial=False, nbytes=None):
        n = len(data) if nbytes is None else nbytes
        if partial or struct.unpack_from("<I", bytes(data[:4]))[0] != sf.STATE_HEADER_MAGIC:
            return super().state_set(seq, data, partial, nbytes)
        used = super().state_set(seq, bytes(data[8:n]))
        return used + 8 if used else 0

    def state_cells(self, data, nbytes, start=0):
        if not self.known:
            return None
        if struct.unpack_from("<I", bytes(data[start : start + 4]))[0] != sf.STATE_HEADER_MAGIC:
            return super().state_cells(data, nbytes, start)
        return super().state_cells(data, nbytes, start + 8)


def _fill(engine, prompt: list[int], slot: int) -> None:
    t, c = task(prompt, max_tokens=1, id_slot=slot)
    engine.submit(t)
    deadline = time.time() + 10
    while not c.done and time.time() < deadline:
        time.sleep(0.005)
    assert c.result is not None


@pytest.mark.parametrize("known", [True, False], ids=["kv-layout", "unknown-layout"])
def test_restore_parses_appendices_off_the_engine_thread(tmp_path, monkeypatch, known):
    threads: list[str] = []
    real = sf.parse_appendices

    def spy(*a, **kw):
        threads.append(threading.current_thread().name)
        return real(*a, **kw)

    monkeypatch.setattr(sf, "parse_appendices", spy)
    settings = Settings(slot_save_path=str(tmp_path))
    with route_client(FileBackend(known, n_seq=2, n_swa=16), settings, [slots_route.router]) as c:
        engine = c.app.state.server.engine
        _fill(engine, list(range(10, 110)), 0)  # 100 tokens, several windows
        engine.call(lambda e: e.store.take_checkpoint(e.slots[0]), slot=0).result(10)
        _fill(engine, list(range(10, 120)), 0)  # past the checkpoint: the file carries it
        assert c.post("/slots/0?action=save", json={"filename": "f.bin"}).status_code == 200
        r = c.post("/slots/1?action=restore", json={"filename": "f.bin"})
        assert r.status_code == 200, r.text
        assert r.json()["n_restored"] == 110 and len(engine.slots[1].checkpoints) == 1
    assert threads and "engine" not in threads, threads


def test_save_and_restore_report_the_time_of_each_part(tmp_path):
    """timings.save_parts_ms / restore_parts_ms: where a save's and a restore's time went,
    every part non-negative and together within the whole."""
    settings = Settings(slot_save_path=str(tmp_path))
    with route_client(FileBackend(True, n_seq=2, n_swa=16), settings, [slots_route.router]) as c:
        _fill(c.app.state.server.engine, list(range(10, 110)), 0)
        t = c.post("/slots/0?action=save", json={"filename": "f.bin"}).json()["timings"]
        parts = t["save_parts_ms"]
        assert set(parts) == {"state", "engine_wait", "hop", "prepare", "write", "sync", "rename"}
        assert min(parts.values()) >= 0 and sum(parts.values()) <= t["save_ms"]
        t = c.post("/slots/1?action=restore", json={"filename": "f.bin"}).json()["timings"]
        parts = t["restore_parts_ms"]
        assert set(parts) == {"read", "proof", "load"}
        assert min(parts.values()) >= 0 and sum(parts.values()) <= t["restore_ms"]
