"""Prefix sharing across concurrent requests, end to end."""

from __future__ import annotations

import threading

import httpx

from .conftest import assert_agrees_with_cold, long_text

QUESTIONS = [
    "What changed first?",
    "Who paid for it?",
    "Where did it spread?",
    "Why did it matter?",
]


def metric(s, name: str) -> float:
    for line in s.client.get("/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise KeyError(name)


def test_concurrent_requests_compute_the_shared_prompt_once(make_server):
    s = make_server("-np", "4", "-c", "8192", "--metrics")
    system = "Answer briefly. " + long_text(1250, seed=3)
    prompts = [f"{system}\nQuestion: {q}\nAnswer:" for q in QUESTIONS]
    n_system = len(s.tokenize(system))
    assert n_system > 1400
    before = metric(s, "llamacpp:prompt_tokens_total")
    out: dict[int, dict] = {}

    def run(i: int) -> None:
        r = httpx.post(
            s.url + "/completion",
            json={"prompt": prompts[i], "n_predict": 12, "temperature": 0, "n_probs": 5},
            timeout=300,
        )
        r.raise_for_status()
        out[i] = r.json()

    ts = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    processed = metric(s, "llamacpp:prompt_tokens_total") - before
    assert processed == sum(r["timings"]["prompt_n"] for r in out.values())
    # about one prompt plus four questions, not four prompts
    assert processed < n_system + 4 * 40
    assert metric(s, "llamaslot_prefix_shared_tokens_total") >= 3 * (n_system - 5)
    assert sum(1 for r in out.values() if r["tokens_cached"] >= n_system - 5) >= 3
    s.assert_integrity()
    for i, p in enumerate(prompts):
        assert_agrees_with_cold(s, p, out[i])


def test_agents_sharing_a_long_system_prompt_over_few_slots(make_server):
    """Workload 16 in small: conversations sharing a system prompt several windows long take
    turns over fewer slots, each turn adding a tool result. Every turn answers (no "no room
    left": prefix sharing must not pile up sliding-window cells that several sequences own,
    which llama.cpp never reuses), and the KV cache stays consistent."""
    s = make_server("-np", "4", "-c", "16384", "--cache-ram", "64", "--metrics")
    system = "System: you are an agent. " + long_text(1900, seed=11)
    assert len(s.tokenize(system)) > 4 * 512
    convs = [f"{system}\nUser: task {i}: {long_text(30, seed=100 + i)}\nCall:" for i in range(8)]
    errors: list[str] = []

    def turn(i: int, t: int) -> None:
        r = httpx.post(
            s.url + "/completion",
            json={"prompt": convs[i], "n_predict": 8, "temperature": 0, "ignore_eos": True},
            timeout=600,
        )
        if r.status_code != 200:
            errors.append(f"conversation {i} turn {t}: {r.status_code} {r.text[:200]}")
            return
        convs[i] += r.json()["content"] + f"\nResult: {long_text(220, seed=1000 * t + i)}\nCall:"

    for t in range(2):  # the old code's "no room left" came in the second turn
        for group in (range(0, 4), range(4, 8)):
            ts = [threading.Thread(target=turn, args=(i, t)) for i in group]
            for th in ts:
                th.start()
            for th in ts:
                th.join()
        assert not errors, errors
        s.wait_idle()
        s.assert_integrity()
    assert metric(s, "llamaslot_prefix_shared_tokens_total") > 0
