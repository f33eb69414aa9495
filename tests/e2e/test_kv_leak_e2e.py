"""No KV cell outlives what the slots account for: crafted slot files are refused before
llama.cpp loads them, and after any mix of restores, cancels, erases and generations,
erasing every slot gives back the whole context (issue: a KV capacity leak)."""

from __future__ import annotations

import os
import random
import struct
from pathlib import Path

import httpx
import pytest

from .conftest import long_text

N_CTX = 4096


def action(s, slot: int, act: str, filename: str | None = None) -> httpx.Response:
    body = {"filename": filename} if filename is not None else None
    return s.client.post(f"/slots/{slot}", params={"action": act}, json=body)


def fill(s, slot: int, prompt: str | list[int], n_predict: int = 4) -> httpx.Response:
    # ignore_eos: n_predict tokens whether or not greedy would end early (which differs
    # between CPUs): a full context's last request counts them
    body = {"prompt": prompt, "n_predict": n_predict, "temperature": 0, "id_slot": slot}
    return s.client.post("/completion", json={**body, "ignore_eos": True})


def _walk_cells(data: bytearray, pos: int) -> tuple[list[int], int]:
    """Offsets of every cell's position field in one cache of a slot file's state (the
    layout of llama_kv_cache::state_write), and where the cache ends."""
    offsets = []
    (n_stream,) = struct.unpack_from("<I", data, pos)
    pos += 4
    for _ in range(n_stream):
        (count,) = struct.unpack_from("<I", data, pos)
        pos += 4
        if not count:
            continue
        for _ in range(count):
            offsets.append(pos)
            (n_seq,) = struct.unpack_from("<I", data, pos + 4)
            pos += 8 + 4 * n_seq
        v_trans, n_layer = struct.unpack_from("<II", data, pos)
        assert v_trans == 0
        pos += 8
        for _ in range(2 * n_layer):  # K rows, then V rows
            (row,) = struct.unpack_from("<Q", data, pos + 4)
            pos += 12 + count * row
    return offsets, pos


def craft_repeated_positions(good: bytes) -> bytes:
    """The leak's door: a real state of n tokens relabelled as m = n/2 tokens, its full
    cache's n cells folded onto positions 0..m-1 and its window shifted to end at m-1. Its
    positions agree with m tokens (pos_min 0, pos_max m-1); its cells do not."""
    n = struct.unpack_from("<I", good, 8)[0]
    m = n // 2
    state = bytearray(good[12 + 4 * n :])
    full, end = _walk_cells(state, 0)
    window, _ = _walk_cells(state, end)
    assert len(full) == n and 0 < len(window) < n
    for i, off in enumerate(full):
        struct.pack_into("<i", state, off, i % m)
    for off in window:
        (p,) = struct.unpack_from("<i", state, off)
        struct.pack_into("<i", state, off, p - (n - m))
    return good[:8] + struct.pack("<I", m) + good[12 : 12 + 4 * m] + bytes(state)


def crafted_files(good: bytes) -> dict[str, bytes]:
    n = struct.unpack_from("<I", good, 8)[0]
    state = good[12 + 4 * n :]
    _, full_end = _walk_cells(bytearray(state), 0)
    _, state_end = _walk_cells(bytearray(state), full_end)
    return {
        "zero-tokens.bin": good[:8] + struct.pack("<I", 0) + state,
        "repeated.bin": craft_repeated_positions(good),
        "short-list.bin": good[:8] + struct.pack("<I", n - 7) + good[12 : 12 + 4 * (n - 7)] + state,
        "cut-state.bin": good[: 12 + 4 * n + (full_end + state_end) // 2],
    }


@pytest.fixture
def leak_server(make_server, tmp_path):
    d = tmp_path / "slots"
    d.mkdir()
    s = make_server("-np", "2", "-c", str(N_CTX), "--slot-save-path", str(d))
    s.save_dir = d
    return s


def _save_good(s, d: Path) -> bytes:
    fill(s, 0, long_text(1400, seed=21)).raise_for_status()  # ~1,650 tokens: 3 windows
    action(s, 0, "save", "good.bin").raise_for_status()
    return (d / "good.bin").read_bytes()


def assert_whole_context_free(s) -> None:
    """Erase every slot; then a prompt of n_ctx - 8 tokens is processed whole."""
    for slot in (0, 1):
        action(s, slot, "erase").raise_for_status()
    s.assert_integrity()
    words = s.tokenize(long_text(4000, seed=5), add_special=False)
    prompt = (words * 2)[: N_CTX - 8]
    r = fill(s, 0, prompt, n_predict=4)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["timings"]["prompt_n"] + out["tokens_cached"] == N_CTX - 8
    assert out["tokens_predicted"] == 4 and out["stop_type"] == "limit"
    s.assert_integrity()


def test_crafted_states_are_refused_before_loading(leak_server):
    s, d = leak_server, leak_server.save_dir
    good = _save_good(s, d)
    for name, data in crafted_files(good).items():
        (d / name).write_bytes(data)
        r = action(s, 1, "restore", name)
        assert r.status_code == 400, (name, r.text)
        assert next(x["n_tokens"] for x in s.slots() if x["id"] == 1) == 0
        s.assert_integrity()
    assert "cells" in action(s, 1, "restore", "repeated.bin").json()["error"]["message"]
    assert_whole_context_free(s)


def _stream_and_drop(s, slot: int, prompt: str, n_chunks: int) -> None:
    body = {"prompt": prompt, "n_predict": 64, "stream": True, "id_slot": slot}
    with s.client.stream("POST", "/completion", json=body) as r:
        seen = 0
        for line in r.iter_lines():
            seen += line.startswith("data: ")
            if seen >= n_chunks:
                break  # closing the connection cancels the task


def test_random_interleaving_leaves_no_cell_behind(leak_server):
    s, d = leak_server, leak_server.save_dir
    seed = int(os.environ.get("KV_LEAK_SEED", random.randrange(1 << 30)))
    rng = random.Random(seed)
    good = _save_good(s, d)
    files = {"good.bin": good, **crafted_files(good)}
    for name, data in files.items():
        (d / name).write_bytes(data)
    log = []
    for step in range(24):
        op, slot = (
            rng.choice(["restore", "restore", "gen", "gen", "cancel", "erase", "save"]),
            rng.randrange(2),
        )
        log.append((op, slot))
        if op == "restore":
            name = rng.choice(list(files))
            r = action(s, slot, "restore", name)
            assert r.status_code == (200 if name == "good.bin" else 400), (seed, log, r.text)
        elif op == "gen":
            words = rng.choice([40, 300, 900])
            r = fill(s, slot, long_text(words, seed=rng.randrange(4)), n_predict=rng.choice([1, 8]))
            assert r.status_code == 200, (seed, log, r.text)
        elif op == "cancel":
            _stream_and_drop(s, slot, long_text(rng.choice([30, 600]), seed=9), rng.choice([1, 3]))
        elif op == "erase":
            action(s, slot, "erase").raise_for_status()
        else:
            action(s, slot, "save", f"step{step}.bin").raise_for_status()
        s.wait_idle()
        r = s.client.get("/debug/integrity").json()
        assert r["ok"], (seed, log, r)
    assert_whole_context_free(s)
