"""vLLM's render endpoints on the default model: the token ids are the ones generation uses
(same count in usage, and a generation from the rendered ids reuses the KV of the chat
request that rendered them)."""

from __future__ import annotations

from .conftest import long_text

KEYS = {
    "request_id",
    "token_ids",
    "features",
    "sampling_params",
    "model",
    "stream",
    "stream_options",
    "cache_salt",
    "priority",
    "kv_transfer_params",
}


def test_completions_render_matches_generation(server):
    c = server.client
    prompt = long_text(80, seed=2)
    r = c.post("/v1/completions/render", json={"model": "m", "prompt": prompt, "max_tokens": 7})
    assert r.status_code == 200
    (obj,) = r.json()
    assert set(obj) == KEYS and obj["features"] is None and obj["model"] == "m"
    assert obj["sampling_params"]["max_tokens"] == 7
    assert obj["token_ids"] == server.tokenize(prompt)
    u = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1}).json()["usage"]
    assert u["prompt_tokens"] == len(obj["token_ids"])
    # several prompts, text and tokens: one object each, token lists as they are
    r = c.post("/v1/completions/render", json={"prompt": ["Hello there", "Bye"]}).json()
    assert [o["token_ids"] for o in r] == [server.tokenize("Hello there"), server.tokenize("Bye")]
    assert r[0]["sampling_params"]["max_tokens"] is None
    r = c.post("/v1/completions/render", json={"prompt": [[5, 6, 7], [8]]}).json()
    assert [o["token_ids"] for o in r] == [[5, 6, 7], [8]]
    assert c.post("/v1/completions/render", json={"prompt": []}).status_code == 400


def test_chat_render_is_the_prompt_generation_uses(server):
    c = server.client
    messages = [
        {"role": "system", "content": "You answer briefly. " + long_text(120, seed=4)},
        {"role": "user", "content": "What changed with movable type?"},
    ]
    body = {"model": "m", "messages": messages, "max_tokens": 1, "temperature": 0}
    r = c.post("/v1/chat/completions/render", json=body)
    assert r.status_code == 200
    obj = r.json()
    assert set(obj) == KEYS and obj["sampling_params"]["temperature"] == 0
    ids = obj["token_ids"]
    assert len(ids) > 150
    out = c.post("/v1/chat/completions", json=body).json()
    assert out["usage"]["prompt_tokens"] == len(ids)
    # the rendered ids, sent as a prompt, find every one of them but the last in the KV
    # that the chat request left (the last prompt token is always evaluated again)
    again = c.post("/completion", json={"prompt": ids, "n_predict": 1, "temperature": 0}).json()
    assert again["tokens_cached"] == len(ids) - 1
    bad = {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "nope"}]}
    assert c.post("/v1/chat/completions/render", json=bad).status_code == 400
