"""RAM prompt cache, end to end: more conversations than slots.

Each test runs on conversations inside one sliding window (~300 tokens) and on conversations
several windows long (~1,600 tokens; the default model's window is 512): a state restored
from the cache holds only its last window, so the long ones go through checkpoints.
"""

from __future__ import annotations

import pytest

from .conftest import assert_agrees_with_cold, long_text

TOPICS = ["astronomy", "cooking", "sailing", "chess"]
LENGTHS = {"short": 220, "long": 1400}  # words: ~300 and ~1,600 tokens


def conv_prompt(i: int, n_words: int) -> str:
    return f"Notes on {TOPICS[i]}. " + long_text(n_words, seed=i + 3) + f" More about {TOPICS[i]}:"


def complete(server, prompt: str, **kw) -> dict:
    # ignore_eos: 16 tokens whether or not greedy would end early (which differs between
    # CPUs), so the slot holds the prompt and 15 decoded tokens, and an answer to cut inside
    body = {"prompt": prompt, "n_predict": 16, "temperature": 0, "ignore_eos": True, **kw}
    r = server.client.post("/completion", json=body)
    r.raise_for_status()
    return r.json()


def common_prefix(a: list[int], b: list[int]) -> int:
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def run_conversations(server, n_words: int, edit: bool = False) -> tuple[str, dict]:
    """Three conversations through two slots (the third takes conversation 0's, the least
    recently used); returns conversation 0's follow-up and response.
    With ``edit`` the follow-up keeps only the first half of the answer's text, so it leaves
    the cached tokens inside the answer instead of at their end."""
    first = {}
    for i in range(3):
        first[i] = complete(server, conv_prompt(i, n_words))
    answer = first[0]["content"]
    if edit:
        answer = answer[: len(answer) // 2]
    follow = conv_prompt(0, n_words) + answer + " And then?"
    return follow, complete(server, follow, n_probs=5)


@pytest.mark.parametrize(
    "size,edit", [("short", False), ("long", False), ("short", True), ("long", True)]
)
def test_follow_up_restores_from_ram(make_server, size, edit):
    s = make_server("-np", "2", "-c", "8192")
    n_words = LENGTHS[size]
    follow, r = run_conversations(s, n_words, edit)
    n_prompt = len(s.tokenize(conv_prompt(0, n_words)))
    n_follow = len(s.tokenize(follow))
    assert size == "short" or n_prompt > 1500
    # the slot held prompt + 15 decoded tokens; the follow-up re-tokenizes the answer, so
    # the reuse ends where the tokens first differ (the answer's first piece may merge with
    # the prompt's last token when re-tokenized: what greedy writes differs between CPUs).
    # A restored window serves a cut only at its own length or at a checkpoint, and the
    # entry carries the one 4 tokens before the prompt's end (file_checkpoints: another
    # window of state would save 4 tokens), so at most those 4 tokens before the cut or
    # the prompt's end are recomputed, never more
    alike = common_prefix(s.tokenize(conv_prompt(0, n_words)), s.tokenize(follow))
    assert r["tokens_cached"] >= min(n_prompt, alike) - 4, alike
    assert r["tokens_cached"] >= 0.9 * n_follow
    assert r["tokens_cached"] + r["timings"]["prompt_n"] == n_follow
    info = s.client.get("/cache").json()
    assert info["enabled"] and info["counters"]["loads"] >= 1
    assert info["n_bytes"] == sum(e["n_bytes"] for e in info["entries"])
    s.assert_integrity()
    assert_agrees_with_cold(s, follow, r)


@pytest.mark.parametrize("size", ["short", "long"])
def test_follow_up_without_cache_is_recomputed(make_server, size):
    s = make_server("-np", "2", "-c", "8192", "--cache-ram", "0")
    follow, r = run_conversations(s, LENGTHS[size])
    assert r["tokens_cached"] <= 8
    assert s.client.get("/cache").json() == {"enabled": False}
