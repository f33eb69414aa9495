"""Backend sampling (-bs) end to end on the real model, on the CPU backend: greedy chains in
the decode graph pick what CPU sampling picks, seeded chains are reproducible, and the
requests the backend chain cannot serve (grammar, penalties, logit_bias, logprobs) sample on
the CPU transparently and are counted in /metrics.

Greedy outputs are compared within the batch-layout drift tolerance (conftest.LOGPROB_TOL):
token by token in the same layout up to the first near tie, first tokens only across layouts.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from .conftest import LOGPROB_TOL, ServerProc, top_logprobs

PROMPTS = [
    "The capital of France is",
    "Water boils at a temperature of",
    "def fibonacci(n):\n   ",
    "Once upon a time, in a small village by the sea,",
]


@pytest.fixture(scope="module")
def bs() -> Iterator[ServerProc]:
    s = ServerProc("-bs", "--metrics", "-c", "4096", "-np", "4")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(bs: ServerProc) -> openai.OpenAI:
    return openai.OpenAI(base_url=bs.url + "/v1", api_key="none", max_retries=0)


def counters(s: ServerProc) -> dict[str, float]:
    """The -bs counters: "backend" and one entry per fallback reason."""
    out: dict[str, float] = {}
    for line in s.client.get("/metrics").text.splitlines():
        if line.startswith("llamaslot_backend_sampled_requests_total "):
            out["backend"] = float(line.split()[-1])
        m = re.match(r'llamaslot_backend_sampling_fallbacks_total\{reason="(\w+)"\} (\S+)', line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}


def stream_tokens(s: ServerProc, prompt: str, **kw) -> list[int]:
    """The token ids a streamed /completion generates."""
    body = {"prompt": prompt, "stream": True, "cache_prompt": False, **kw}
    toks: list[int] = []
    with s.client.stream("POST", "/completion", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: "):
                toks += json.loads(line[6:]).get("tokens", [])
    return toks


def test_greedy_matches_cpu_sampling(bs: ServerProc) -> None:
    """Same prompt, same (cold, single-request) batch layout: the backend's greedy tokens
    are the CPU's (a request with n_probs samples on the CPU), up to the first near tie."""
    before = counters(bs)
    for prompt in PROMPTS[:3]:
        # ignore_eos (a bias, in the graph too): both run 10 tokens, whether or not greedy
        # would end early on this CPU, or on one side of a near tie only
        got = stream_tokens(bs, prompt, n_predict=10, temperature=0, ignore_eos=True)
        body = {"prompt": prompt, "n_predict": 10, "n_probs": 5, "temperature": 0}
        body["ignore_eos"] = True
        cpu = bs.client.post("/completion", json={**body, "cache_prompt": False}).json()
        probs = cpu["completion_probabilities"]
        assert len(got) == len(probs) == 10
        for tok, p in zip(got, probs, strict=False):
            if tok == p["id"]:
                continue
            # a near tie resolved the other way: the backend's pick is a top choice within
            # the tolerance; after it the two continuations differ, so stop comparing
            alts = {t["id"]: t["logprob"] for t in p["top_logprobs"]}
            assert tok in alts and alts[tok] >= p["logprob"] - LOGPROB_TOL, (prompt, tok, p)
            break
    assert delta(before, counters(bs)) == {"backend": 3, "logprobs": 3}


def test_concurrent_greedy_first_tokens(bs: ServerProc, client: openai.OpenAI) -> None:
    """Four backend-sampled streams in one batch pick the first token that each prompt,
    alone and sampled on the CPU, ranks first (within the batch-layout drift)."""
    with ThreadPoolExecutor(4) as ex:
        firsts = list(
            ex.map(
                lambda p: (
                    client.completions.create(model="m", prompt=p, max_tokens=1, temperature=0)
                    .choices[0]
                    .text
                ),
                PROMPTS,
            )
        )
    for prompt, text in zip(PROMPTS, firsts, strict=True):
        body = {"prompt": prompt, "n_predict": 1, "n_probs": 5, "temperature": 0}
        cold = bs.client.post("/completion", json={**body, "cache_prompt": False}).json()
        top = top_logprobs(cold)
        best = max(top.values())
        assert text in top and top[text] >= best - LOGPROB_TOL, (prompt, text, top)
    bs.assert_integrity()


def test_seeded_sampling_is_reproducible(bs: ServerProc, client: openai.OpenAI) -> None:
    """A seeded top-k/top-p/min-p/temperature chain runs on the backend; the same seed in
    the same batch layout gives the same text."""
    before = counters(bs)

    def run() -> str:
        return (
            client.completions.create(
                model="m",
                prompt=PROMPTS[3],
                max_tokens=16,
                temperature=0.9,
                top_p=0.9,
                seed=1234,
                # ignore_eos (a bias: still the backend chain): 16 tokens of text whatever
                # the seed samples on this CPU, never an empty answer that ended at once
                extra_body={
                    "top_k": 40,
                    "min_p": 0.05,
                    "cache_prompt": False,
                    "ignore_eos": True,
                },
            )
            .choices[0]
            .text
        )

    a, b = run(), run()
    assert a and a == b
    assert delta(before, counters(bs)) == {"backend": 2}


def test_fallbacks_work_and_are_counted(bs: ServerProc, client: openai.OpenAI) -> None:
    before = counters(bs)
    # grammar (json_schema): the token mask needs the CPU path
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
        "additionalProperties": False,
    }
    r = client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "Name a city as JSON."}],
        max_tokens=60,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}},
    )
    assert set(json.loads(r.choices[0].message.content)) == {"city"}
    # penalties
    r2 = client.completions.create(
        model="m", prompt=PROMPTS[0], max_tokens=8, temperature=0, frequency_penalty=1.0
    )
    assert r2.usage.completion_tokens > 0
    # logit_bias: banning the greedy first token changes the first token (ignore_eos: a
    # token comes out whether or not greedy would end at once on this CPU)
    greedy = {"n_predict": 1, "temperature": 0, "ignore_eos": True}
    first = stream_tokens(bs, PROMPTS[0], **greedy)[0]
    banned = stream_tokens(bs, PROMPTS[0], **greedy, logit_bias=[[first, False]])
    assert banned and banned[0] != first
    # logprobs
    r3 = client.completions.create(
        model="m", prompt=PROMPTS[1], max_tokens=2, temperature=0, logprobs=3
    )
    assert len(r3.choices[0].logprobs.top_logprobs[0]) == 3
    assert delta(before, counters(bs)) == {
        "constraint": 1,
        "penalties": 1,
        "logprobs": 1,
        "backend": 2,  # the greedy requests, the biased one too (the bias runs in the graph)
    }
    # /props reports the same counters as /metrics
    engine = bs.client.get("/props").json()["engine"]
    shown = {"backend": engine["backend_sampled"], **engine["backend_sampling_fallbacks"]}
    assert shown == counters(bs)


def test_mixed_batch(bs: ServerProc, client: openai.OpenAI) -> None:
    """Backend- and CPU-sampled slots decode in the same batches."""
    kinds = [
        {},
        {"logprobs": 2},
        {"frequency_penalty": 0.5},
        {"logit_bias": {"1": -100}},
    ]

    def run(kw: dict) -> int:
        r = client.completions.create(
            model="m", prompt=PROMPTS[0], max_tokens=16, temperature=0.7, seed=5, **kw
        )
        return r.usage.completion_tokens

    before = counters(bs)
    with ThreadPoolExecutor(4) as ex:
        assert all(n > 0 for n in ex.map(run, kinds))
    assert delta(before, counters(bs)) == {
        "backend": 2,  # the plain and the biased request (the bias runs in the graph)
        "logprobs": 1,
        "penalties": 1,
    }
    bs.assert_integrity()
