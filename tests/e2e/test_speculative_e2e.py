"""Speculative decoding on the real model: drafts verified in the batch give the output of
plain decoding, within the batch-layout drift (a verification batch holds many rows of one
sequence, a plain step one), on contexts several sliding windows long."""

from __future__ import annotations

import re
import threading

from tests.e2e.conftest import long_text

# How far the real model's log-probabilities may drift between batch layouts (nats); a KV
# cache that kept a rejected draft, or lost part of its window, is off by far more.
TOL = 0.5


def copy_prompt(seed: int) -> str:
    """A ~1,200-token text, then the start of it again: the model goes on copying it."""
    text = long_text(1000, seed)
    return f"{text}\n\nThe same text, copied word for word:\n\n{text[:200]}"


def complete(s, prompt: str, n: int, **kw) -> dict:
    # ignore_eos: n tokens whether or not greedy would end early (which differs between
    # CPUs), so both runs compared are n tokens long and a follow-up has drafts to make. The
    # top 4: the banned end tokens may take places among the model's top ones.
    body = {"prompt": prompt, "n_predict": n, "temperature": 0, "n_probs": 4, **kw}
    body["ignore_eos"] = True
    # generous: two slots of long prompts on a busy 2-core machine
    r = s.client.post("/completion", json=body, timeout=600)
    r.raise_for_status()
    return r.json()


def assert_agrees(spec: dict, plain: dict) -> None:
    """Token by token the same until the first difference, with log-probabilities within
    TOL; a difference must be a near tie under the plain run (both among its top 4, within TOL)."""
    a, b = spec["completion_probabilities"], plain["completion_probabilities"]
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x["id"] != y["id"]:
            top = {t["id"]: t["logprob"] for t in y["top_logprobs"]}
            assert x["id"] in top, f"token {i}: {x['token']!r} not in the plain top 4 {top}"
            assert top[y["id"]] - top[x["id"]] <= TOL, f"token {i}: not a near tie {top}"
            return
        assert abs(x["logprob"] - y["logprob"]) <= TOL, (i, x, y)
    assert len(a) == len(b)


def metric(s, name: str) -> float:
    text = s.client.get("/metrics").text
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    assert m, name
    return float(m.group(1))


def test_ngram_simple_agrees_with_plain_decoding(make_server):
    s = make_server("--spec-type", "ngram-simple", "-np", "2", "--metrics")
    prompt = copy_prompt(0)
    n_prompt = len(s.tokenize(prompt))
    assert n_prompt + 400 > 3 * 512  # the context spans several sliding windows
    spec = complete(s, prompt, 400, cache_prompt=False)
    plain = complete(s, prompt, 400, cache_prompt=False, **{"speculative.n_max": 0})
    t = spec["timings"]
    assert "draft_n" not in plain["timings"]
    assert t["draft_n"] > 0 and t["draft_n_accepted"] > 0.3 * t["draft_n"], t
    assert spec["tokens_predicted"] == 400 == t["predicted_n"]
    assert_agrees(spec, plain)
    s.assert_integrity()
    assert metric(s, "llamacpp:spec_decode_num_draft_tokens_total") == t["draft_n"]
    assert metric(s, "llamacpp:spec_decode_num_accepted_tokens_total") == t["draft_n_accepted"]
    assert metric(s, "llamacpp:spec_decode_num_drafts_total") > 0


def test_two_slots_speculate_at_once(make_server):
    s = make_server("--spec-type", "ngram-simple", "-np", "2")
    prompts = [copy_prompt(1), copy_prompt(3)]
    out: dict[int, dict] = {}

    def go(i: int) -> None:
        out[i] = complete(s, prompts[i], 300, cache_prompt=False)

    threads = [threading.Thread(target=go, args=(i,)) for i in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    s.assert_integrity()
    for i, p in enumerate(prompts):
        plain = complete(s, p, 300, cache_prompt=False, **{"speculative.n_max": 0})
        assert out[i]["timings"]["draft_n_accepted"] > 0
        assert_agrees(out[i], plain)
    s.assert_integrity()
