"""The engine issue, end to end: real model, real HTTP, real clients."""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest

from .conftest import EOG, assert_agrees_with_cold, first_token, long_text


@pytest.fixture
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=120)


def test_openai_sdk_completion_and_stream_agree(server, oai):
    prompt = "The capital of France is"
    # cache_prompt off: both runs compute the prompt in the same batch layout, so their
    # greedy texts are comparable (llama.cpp is not batch-invariant). ignore_eos: 12 tokens
    # whether or not greedy would end early (which differs between CPUs)
    off = {"cache_prompt": False, "ignore_eos": True}
    r = oai.completions.create(
        model="x", prompt=prompt, max_tokens=12, temperature=0, extra_body=off
    )
    text = r.choices[0].text
    assert text.strip() and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 12
    assert r.usage.prompt_tokens == len(server.tokenize(prompt))
    chunks = list(
        oai.completions.create(
            model="x",
            prompt=prompt,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=off,
        )
    )
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert streamed == text
    assert chunks[-1].usage.completion_tokens == 12


def test_openai_sdk_chat_and_stream(server, oai):
    msgs = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a color."},
    ]
    off = {"cache_prompt": False}  # same batch layout for both runs
    r = oai.chat.completions.create(
        model="x", messages=msgs, max_tokens=8, temperature=0, extra_body=off
    )
    assert r.choices[0].message.role == "assistant"
    content = r.choices[0].message.content
    chunks = list(
        oai.chat.completions.create(
            model="x", messages=msgs, max_tokens=8, temperature=0, stream=True, extra_body=off
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == content
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("n_words", [200, 1400])  # inside one window; ~3 windows
def test_shared_prefix_reports_cache_n(server, n_words):
    base = long_text(n_words, seed=1)
    p1 = base + " First question: what changed?"
    p2 = base + " Second question: who printed?"
    c = server.client
    r1 = c.post("/v1/completions", json={"prompt": p1, "max_tokens": 4, "temperature": 0}).json()
    r2 = c.post("/v1/completions", json={"prompt": p2, "max_tokens": 4, "temperature": 0}).json()
    t1, t2 = server.tokenize(p1), server.tokenize(p2)
    common = next(i for i, (a, b) in enumerate(zip(t1, t2, strict=False)) if a != b)
    assert r2["timings"]["cache_n"] == common
    assert r2["timings"]["prompt_n"] == len(t2) - common
    assert r2["usage"]["prompt_tokens_details"]["cached_tokens"] == common
    assert r1["timings"]["cache_n"] + r1["timings"]["prompt_n"] == len(t1)


@pytest.mark.parametrize("n_words", [120, 1400])
def test_cached_and_cold_predictions_agree(server, n_words):
    prompt = long_text(n_words, seed=2) + " In summary,"
    first_token(server, prompt)
    warm = first_token(server, prompt)
    assert warm["tokens_cached"] == len(server.tokenize(prompt)) - 1
    assert_agrees_with_cold(server, prompt, warm)


def test_concurrent_requests_are_decoded_together(server):
    seen_busy = []
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            seen_busy.append(sum(s["is_processing"] for s in server.slots()))
            time.sleep(0.02)

    def run(i):
        httpx.post(
            server.url + "/v1/completions",
            # ignore_eos: all four run their 48 tokens, whatever their seeds sample on this CPU
            json={
                "prompt": f"Story number {i}:",
                "max_tokens": 48,
                "temperature": 0.7,
                "seed": i,
                "ignore_eos": True,
            },
            timeout=120,
        ).raise_for_status()

    w = threading.Thread(target=watch)
    w.start()
    ts = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    stop.set()
    w.join()
    assert max(seen_busy) == 4


def test_disconnected_stream_frees_its_slot(server):
    with (
        httpx.Client(base_url=server.url, timeout=60) as c,
        c.stream(
            "POST",
            "/v1/completions",
            json={
                "prompt": "Count forever:",
                "max_tokens": 5000,
                "stream": True,
                "ignore_eos": True,
            },
        ) as r,
    ):
        n = 0
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                n += 1
            if n >= 3:
                break
    slots = server.wait_idle(timeout=10)
    assert all(s["n_decoded"] < 5000 for s in slots)


# Compared greedy texts come from runs with the same batch layout: no prompt cache between them.
OFF = {"cache_prompt": False}
# Whether greedy ends early differs between CPUs: tests that count tokens ban the end tokens.
NO_EOS = {"ignore_eos": True}


def test_stop_strings_and_native_stream(server):
    c = server.client
    body = {"prompt": "1, 2, 3, 4,", "n_predict": 20, "temperature": 0, **OFF, **NO_EOS}
    full = c.post("/completion", json=body).json()["content"]
    assert len(full) > 4
    stop = full[2:4]
    r = c.post("/completion", json={**body, "stop": [stop]}).json()
    assert r["stop_type"] == "word" and r["stopping_word"] == stop
    assert r["content"] == full[: full.index(stop)]
    with c.stream("POST", "/completion", json={**body, "stop": [stop], "stream": True}) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: ")]
    assert "".join(e["content"] for e in events) == r["content"]
    assert (
        events[-1]["stop"] is True and events[-1]["timings"]["predicted_n"] == r["tokens_predicted"]
    )


def test_n_choices_and_logprobs(server):
    r = server.client.post(
        "/v1/completions",
        json={
            "prompt": "Once upon a time",
            "max_tokens": 5,
            "n": 2,
            "temperature": 0,
            "logprobs": 3,
            **NO_EOS,  # 5 tokens each, whether or not greedy would end early on this CPU
        },
    ).json()
    assert [c["index"] for c in r["choices"]] == [0, 1]
    # (the two choices run in one batch; float differences may let greedy outputs diverge)
    assert all(c["text"] and c["logprobs"] for c in r["choices"])
    assert r["usage"]["completion_tokens"] == 10
    lp = r["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == 5 and len(lp["top_logprobs"][0]) == 3
    assert all(v <= 0 for v in lp["token_logprobs"])
    # greedy: the sampled token is the most likely one that ignore_eos leaves (the end
    # tokens it bans have no text)
    top = {k: v for k, v in lp["top_logprobs"][0].items() if k}
    assert lp["token_logprobs"][0] == pytest.approx(max(top.values()))


def test_tokenize_detokenize_roundtrip(server):
    c = server.client
    toks = c.post("/tokenize", json={"content": "Hello world", "with_pieces": True}).json()[
        "tokens"
    ]
    assert [t["piece"] for t in toks] == ["Hello", " world"]
    text = c.post("/detokenize", json={"tokens": [t["id"] for t in toks]}).json()["content"]
    assert text == "Hello world"


def test_models_props_health(server):
    c = server.client
    assert c.get("/health").json() == {"status": "ok"}
    m = c.get("/v1/models").json()
    assert m["data"][0]["id"] == "gemma-3-270m-q4_k_m.gguf"
    p = c.get("/props").json()
    assert p["total_slots"] == 4 and p["n_ctx"] == 8192 and p["chat_template_name"] == "gemma"


def test_prompt_too_long_is_400(make_server):
    s = make_server("-c", "256", "-np", "1")
    r = s.client.post("/v1/completions", json={"prompt": long_text(400), "max_tokens": 2})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["type"] == "exceed_context_size_error" and err["n_ctx"] == 256
    assert (
        s.client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
    )


def test_native_completion_probabilities(server):
    body = {"prompt": "The sky is", "n_predict": 3, "temperature": 0, "n_probs": 3, **NO_EOS}
    r = server.client.post("/completion", json=body).json()
    probs = r["completion_probabilities"]
    assert len(probs) == 3 and all(len(p["top_logprobs"]) == 3 for p in probs)
    # greedy: the chosen token is the most likely one (that ignore_eos leaves)
    assert probs[0]["id"] == next(t["id"] for t in probs[0]["top_logprobs"] if t["id"] not in EOG)
    assert "".join(p["token"] for p in probs) == r["content"]


def test_completions_echo(server, oai):
    prompt = "Once upon a time"
    plain = (
        oai.completions.create(
            model="x", prompt=prompt, max_tokens=4, temperature=0, extra_body=OFF
        )
        .choices[0]
        .text
    )
    r = oai.completions.create(
        model="x", prompt=prompt, max_tokens=4, temperature=0, echo=True, extra_body=OFF
    )
    assert r.choices[0].text == prompt + plain
    chunks = list(
        oai.completions.create(
            model="x",
            prompt=prompt,
            max_tokens=4,
            temperature=0,
            echo=True,
            stream=True,
            extra_body=OFF,
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == prompt + plain
    bad = server.client.post(
        "/v1/completions", json={"prompt": prompt, "echo": True, "logprobs": 1}
    )
    assert bad.status_code == 400


def test_non_unified_kv_splits_the_context_and_still_reuses_prefixes(make_server):
    s = make_server("--no-kv-unified", "-np", "2", "-c", "2048")
    props = s.client.get("/props").json()
    assert (props["kv_unified"], props["n_ctx_slot"]) == (False, 1024)
    prompt = long_text(150, seed=7)
    c = s.client
    c.post("/completion", json={"prompt": prompt, "n_predict": 2}).raise_for_status()
    r = c.post("/completion", json={"prompt": prompt + " More.", "n_predict": 2}).json()
    assert r["tokens_cached"] >= len(s.tokenize(prompt)) - 1
    too_long = c.post("/completion", json={"prompt": long_text(1200), "n_predict": 1})
    assert too_long.status_code == 400 and too_long.json()["error"]["n_ctx"] == 1024
