"""Chat details llama-server's users rely on, on the real model: a final assistant message
is continued (prefill), and ``__verbose`` shows the prompt the model read."""

from __future__ import annotations


def test_prefill_continues_the_assistant_turn(server):
    msgs = [
        {"role": "user", "content": "Name a fruit."},
        {"role": "assistant", "content": "The fruit is"},
    ]
    c = server.client
    prompt = c.post("/apply-template", json={"messages": msgs}).json()["prompt"]
    # Gemma's turn stays open: no <end_of_turn>, no new model turn after it
    assert prompt.endswith(
        "<start_of_turn>user\nName a fruit.<end_of_turn>\n<start_of_turn>model\nThe fruit is"
    )
    body = {"messages": msgs, "max_tokens": 3, "temperature": 0, "verbose": True}
    r = c.post("/v1/chat/completions", json=body).json()
    assert r["__verbose"]["prompt"] == prompt
    assert r["usage"]["prompt_tokens"] == len(server.tokenize(prompt, add_special=False))
    assert r["__verbose"]["content"] == r["choices"][0]["message"]["content"]
    two = [*msgs, {"role": "assistant", "content": "an"}]
    r = c.post("/v1/chat/completions", json={**body, "messages": two})
    assert r.status_code == 400 and "2 or more assistant" in r.json()["error"]["message"]
