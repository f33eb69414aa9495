"""The disk tier under the RAM cache (--cache-disk), end to end on the default model.

Conversations are ~1,500 tokens, three sliding windows of the default model (512): a state
restored from disk holds only its last window plus the checkpoints in its file. Follow-ups
are sent with the real ``openai`` SDK and judged by ``usage.prompt_tokens_details``.
"""

from __future__ import annotations

import os
import signal
import struct
import time
from pathlib import Path

import llama_cpp
import pytest
from openai import OpenAI

from .conftest import ServerProc, assert_agrees_with_cold, first_token, long_text

N_WORDS = 1300  # ~1,500 tokens


def conv(i: int, n_words: int = N_WORDS) -> str:
    return f"Conversation {i}. " + long_text(n_words, seed=i) + f" Question {i}: what next?"


def complete(s: ServerProc, prompt: str, n: int = 8) -> dict:
    r = s.client.post("/completion", json={"prompt": prompt, "n_predict": n, "temperature": 0})
    r.raise_for_status()
    return r.json()


def follow_up(s: ServerProc, prompt: str) -> tuple[int, int]:
    """(prompt tokens, cached tokens) of a one-token follow-up through the openai SDK."""
    client = OpenAI(base_url=s.url + "/v1", api_key="none")
    r = client.completions.create(model="x", prompt=prompt, max_tokens=1, temperature=0)
    return r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens


def disk_info(s: ServerProc) -> dict:
    return s.client.get("/cache").json()["disk"]


def wait_for(pred, what: str, timeout: float = 60) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if pred():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def entries(d: Path) -> list[str]:
    return sorted(n for n in os.listdir(d) if n.endswith(".lsc") and not n.startswith("."))


def test_entry_evicted_from_ram_is_served_from_disk(make_server, tmp_path):
    # 21 MiB of RAM holds the long conversation (19.4 MiB: its state and the one checkpoint
    # an entry carries) but not it and a short one (3.3 MiB): saving the first short one
    # evicts it to disk.
    s = make_server("-np", "1", "--cache-ram", "21", "--cache-disk", str(tmp_path), "--metrics")
    first = complete(s, conv(0))
    complete(s, conv(1, 150))
    complete(s, conv(2, 150))
    wait_for(lambda: disk_info(s)["counters"]["writes"] >= 1, "the evicted entry's file")
    info = s.client.get("/cache").json()
    assert info["counters"]["evictions"] >= 1
    prefix = conv(0) + first["content"]
    follow = prefix + " And then?"
    n_prefix = len(s.tokenize(prefix))
    warm = first_token(s, follow, n_probs=5)
    d = disk_info(s)
    assert d["counters"]["hits"] == 1 and d["counters"]["load_failures"] == 0, d
    assert warm["tokens_cached"] >= 0.95 * n_prefix, (warm["tokens_cached"], n_prefix)
    assert d["counters"]["load_ms_last"] > 0
    s.assert_integrity()
    assert_agrees_with_cold(s, follow, warm)  # the state from disk predicts like a cold run
    info = s.client.get("/cache").json()["disk"]
    assert info["n_bytes"] == sum(e["n_bytes"] for e in info["entries"]) > 0
    metrics = s.client.get("/metrics").text
    assert "llamaslot_disk_cache_hits_total 1.0" in metrics
    assert "llamaslot_disk_cache_writes_total" in metrics and "load_seconds_total" in metrics


def test_warm_restart_and_a_replica_sharing_the_directory(make_server, tmp_path):
    a = make_server("-np", "1", "--cache-disk", str(tmp_path))
    b = make_server("--cache-disk", str(tmp_path))  # a replica (4 slots), started empty
    first = complete(a, conv(3))
    follow = conv(3) + first["content"] + " And then?"
    n_prefix = len(a.tokenize(conv(3) + first["content"]))
    assert entries(tmp_path) == []  # still in A's slot
    a.proc.send_signal(signal.SIGTERM)  # the idle slot is written on the way out
    assert a.proc.wait(30) == 0
    assert len(entries(tmp_path)) == 1
    # the replica notices the file another server wrote, and continues the conversation
    n_prompt, cached = follow_up(b, follow)
    assert cached >= 0.9 * n_prompt and cached >= 0.95 * n_prefix, (cached, n_prompt)
    # warm restart: a new server on the same directory rebuilds its index from the headers
    c = make_server("-np", "1", "--cache-disk", str(tmp_path))
    assert disk_info(c)["n_entries"] == 1
    n_prompt, cached = follow_up(c, follow)
    assert cached >= 0.95 * n_prefix, (cached, n_prefix)
    assert disk_info(c)["counters"]["hits"] == 1
    b.assert_integrity()
    c.assert_integrity()


def _trailer(tenant: bytes, model: bytes, body_len: int) -> bytes:
    return tenant + model + struct.pack("<IIQII", len(tenant), len(model), body_len, 1, 0x4B534453)


def _name(i: int) -> str:
    return f"{i:016x}-evil-{i}-{i:012x}.lsc"


def _hostile(d: Path, model: str, tokens: list[int], outside: Path) -> int:
    """Plant hostile files named like entries; returns how many should count as bad."""
    version = llama_cpp.LLAMA_STATE_SEQ_VERSION
    m = model.encode()
    head = struct.pack("<III", 0x67677371, version, len(tokens)) + struct.pack(
        f"<{len(tokens)}i", *tokens
    )
    garbage = head + struct.pack("<Ii", 0xAF143CD8, 0) + os.urandom(4096)
    files = {
        _name(1): b"NOPE" + garbage[4:] + _trailer(b"", m, len(garbage)),  # wrong magic
        _name(2): garbage[:200],  # truncated: no trailer
        _name(3): struct.pack("<III", 0x67677371, version, 2**31) + b"\0" * 64,  # huge count
        _name(4): garbage + b"\xff" * 8 + struct.pack("<IIQII", 2**31, 2**31, 2**60, 1, 0x4B534453),
    }
    junk = {"not-an-entry.lsc": garbage}  # not our name: ignored unread, not counted
    # written beside the directory and renamed in: a rescan never sees half a file
    for name, data in {**files, **junk}.items():
        (outside / name).write_bytes(data)
        os.rename(outside / name, d / name)
    secret = outside / "secret.lsc"
    secret.write_bytes(garbage + _trailer(b"", m, len(garbage)))
    os.symlink(secret, d / _name(5))  # a symlink out of the directory
    os.mkdir(d / _name(6))  # a directory
    # a whole entry whose tokens are the next prompt's and whose state is garbage: it is
    # indexed (headers only) and chosen, then refused before llama.cpp loads it
    (outside / "whole").write_bytes(garbage + _trailer(b"", m, len(garbage)))
    os.rename(outside / "whole", d / _name(7))
    return len(files) + 2


def test_hostile_files_are_skipped_counted_and_never_loaded(make_server, tmp_path):
    d, outside = tmp_path / "cache", tmp_path / "outside"
    d.mkdir()
    outside.mkdir()
    s = make_server("-np", "1", "--cache-disk", str(d))
    prompt = conv(4, 40)
    tokens = s.tokenize(prompt)
    n_bad = _hostile(d, disk_info(s)["model"], tokens, outside)
    time.sleep(1.1)  # past the rescan interval: the next miss rescans
    r = complete(s, prompt + " More", n=4)
    assert r["tokens_cached"] == 0
    info = disk_info(s)
    c = info["counters"]
    assert c["bad_files"] == n_bad + 1, info  # the garbage state counts once refused
    assert c["load_failures"] == 1 and c["hits"] == 0, info
    assert info["n_entries"] == 0, info
    s.assert_integrity()
    assert (outside / "secret.lsc").exists() and complete(s, prompt, n=2)["content"] is not None
    # rescans count nothing twice
    time.sleep(1.1)
    complete(s, conv(5, 40), n=1)
    assert disk_info(s)["counters"]["bad_files"] == n_bad + 1


@pytest.mark.serial  # races a kill against a slowed write: runs alone
def test_sigkill_during_a_write_leaves_no_entry(make_server, tmp_path):
    slow = {"LLAMA_SLOT_TEST_DISK_WRITE_DELAY_S": "0.5"}
    # 1 MiB of RAM holds nothing: every saved state goes straight to the disk writer
    s = make_server("-np", "1", "--cache-ram", "1", "--cache-disk", str(tmp_path), env=slow)
    complete(s, conv(6, 300), n=2)
    complete(s, conv(7, 40), n=1)  # saves conv 6's slot: the slow writer starts
    wait_for(lambda: any(n.startswith(".tmp-") for n in os.listdir(tmp_path)), "a temp file")
    time.sleep(0.6)  # some of it written
    s.proc.send_signal(signal.SIGKILL)
    s.proc.wait(10)
    assert entries(tmp_path) == []
    tmp = [n for n in os.listdir(tmp_path) if n.startswith(".tmp-")]
    assert len(tmp) == 1 and (tmp_path / tmp[0]).stat().st_size > 0
    # a live writer on another host: its temporary file is left alone and never indexed
    other = tmp_path / ".tmp-otherhost-1-0123456789ab.lsc"
    other.write_bytes(b"ggsq half")
    t = make_server("-np", "1", "--cache-disk", str(tmp_path))
    info = disk_info(t)
    assert info["n_entries"] == 0 and info["counters"]["bad_files"] == 0, info
    assert info["counters"]["temp_files_removed"] == 1
    assert sorted(os.listdir(tmp_path)) == [other.name]
    r = complete(t, conv(6, 300), n=1)
    assert r["tokens_cached"] == 0


def test_disk_entries_serve_only_their_tenant(make_server, tmp_path):
    # 1 MiB of RAM holds nothing: each displaced slot state goes straight to disk
    s = make_server(
        "-np", "1", "--cache-ram", "1", "--cache-disk", str(tmp_path), "--cache-isolation", "salt"
    )
    client = OpenAI(base_url=s.url + "/v1", api_key="none")

    def cached(prompt: str, salt: str) -> int:
        r = client.completions.create(
            model="x", prompt=prompt, max_tokens=1, temperature=0, extra_body={"cache_salt": salt}
        )
        return r.usage.prompt_tokens_details.cached_tokens

    memo = conv(8, 120)
    cached(memo, "a")
    cached(conv(9, 30), "a")  # displaces the memo: written to disk as salt a's
    wait_for(lambda: disk_info(s)["counters"]["writes"] >= 1, "the memo's file")
    assert cached(memo + " Go on.", "b") == 0  # another tenant: the disk entry is not used
    assert disk_info(s)["counters"]["hits"] == 0
    assert cached(memo + " Go on.", "a") >= len(s.tokenize(memo)) - 1  # its own tenant: a hit
    assert disk_info(s)["counters"]["hits"] == 1
    s.assert_integrity()
