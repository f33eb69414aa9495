"""RAM prompt cache, end to end: more conversations than slots."""

from __future__ import annotations

from .conftest import long_text

TOPICS = ["astronomy", "cooking", "sailing", "chess"]


def conv_prompt(i: int) -> str:
    return f"Notes on {TOPICS[i]}. " + long_text(220, seed=i + 3) + f" More about {TOPICS[i]}:"


def complete(server, prompt: str, **kw) -> dict:
    body = {"prompt": prompt, "n_predict": 16, "temperature": 0, **kw}
    r = server.client.post("/completion", json=body)
    r.raise_for_status()
    return r.json()


def run_conversations(server) -> tuple[str, dict]:
    """Four conversations through two slots; returns conversation 0's follow-up and response."""
    first = {}
    for i in range(4):
        first[i] = complete(server, conv_prompt(i))
    follow = conv_prompt(0) + first[0]["content"] + " And then?"
    return follow, complete(server, follow)


def test_follow_up_restores_from_ram(make_server):
    s = make_server("-np", "2", "-c", "4096")
    follow, r = run_conversations(s)
    n_prev = len(s.tokenize(conv_prompt(0))) + 15  # prompt + decoded generated tokens
    assert r["tokens_cached"] >= n_prev - 1
    assert r["tokens_cached"] + r["timings"]["prompt_n"] == len(s.tokenize(follow))
    info = s.client.get("/cache").json()
    assert info["enabled"] and info["counters"]["loads"] >= 1
    assert info["n_bytes"] == sum(e["n_bytes"] for e in info["entries"])
    s.assert_integrity()
    cold = complete(s, follow, cache_prompt=False)
    assert cold["tokens_cached"] == 0
    assert r["content"] == cold["content"]


def test_follow_up_without_cache_is_recomputed(make_server):
    s = make_server("-np", "2", "-c", "4096", "--cache-ram", "0")
    follow, r = run_conversations(s)
    assert r["tokens_cached"] <= 8
    assert s.client.get("/cache").json() == {"enabled": False}
