"""Context checkpoints on the real SWA model (Gemma 3, window 512)."""

from __future__ import annotations

from .conftest import assert_same_next_token_distribution, long_text


def chat(s, last: str, **kw) -> dict:
    msgs = [
        {"role": "system", "content": "You summarise documents in one sentence."},
        {"role": "user", "content": "I will paste a document next."},
        {"role": "assistant", "content": "Please paste it."},
        {"role": "user", "content": last},
    ]
    r = s.client.post(
        "/v1/chat/completions", json={"messages": msgs, "max_tokens": 12, "temperature": 0, **kw}
    )
    r.raise_for_status()
    return r.json()


def test_replaced_long_last_message_reuses_the_checkpoint(make_server):
    s = make_server("-np", "1", "-c", "4096", "--metrics")
    doc_a = long_text(1400, seed=1) + " Summarise this."
    doc_b = long_text(1300, seed=2) + " Summarise that."
    first = chat(s, doc_a)
    # long enough that the sliding-window cells of the cut position are gone from the KV cache
    assert first["usage"]["prompt_tokens"] > 1500
    ck = s.slots()[0]["checkpoints"]
    assert ck["count"] >= 2 and ck["bytes"] > 0
    second = chat(s, doc_b, logprobs=True, top_logprobs=5)
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    # the cut is at the start of the last user message: ~40 tokens of head, far behind the window
    assert 20 < cached < 100
    assert second["timings"]["cache_n"] == cached
    metrics = s.client.get("/metrics").text
    assert "llamaslot_checkpoints_restored_total 1.0" in metrics
    assert second["timings"]["prompt_n"] == second["usage"]["prompt_tokens"] - cached
    s.assert_integrity()
    cold = chat(s, doc_b, cache_prompt=False, logprobs=True, top_logprobs=5)
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert_same_next_token_distribution(second, cold)


def test_without_checkpoints_the_cut_is_recomputed(make_server):
    s = make_server("-np", "1", "-c", "4096", "--ctx-checkpoints", "0")
    chat(s, long_text(1400, seed=1) + " Summarise this.")
    assert s.slots()[0]["checkpoints"]["count"] == 0
    second = chat(s, long_text(1300, seed=2) + " Summarise that.")
    # a cut far behind the window is never reported as cached without a checkpoint
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
