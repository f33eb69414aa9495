"""/completion's llama-server request forms on the real model: prompt forms and lists of
prompts, logit_bias by text, and post_sampling_probs (the sampler chain's distribution)."""

from __future__ import annotations

import math

import pytest

PROMPT = "The capital of France is"


def _complete(server, **body) -> dict | list:
    r = server.client.post("/completion", json={"prompt": PROMPT, "n_predict": 1, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_prompt_forms_and_lists_of_prompts(server):
    tokens = server.tokenize(PROMPT)
    out = _complete(server, prompt=[tokens, PROMPT, {"prompt_string": PROMPT}])
    assert isinstance(out, list) and [o["index"] for o in out] == [0, 1, 2]
    assert all(o["tokens_evaluated"] == len(tokens) for o in out)
    # BOS id, then text: the text gets no second BOS
    mixed = _complete(server, prompt=[tokens[0], PROMPT])
    assert isinstance(mixed, dict) and mixed["tokens_evaluated"] == len(tokens)
    r = server.client.post(
        "/completion", json={"prompt": {"prompt_string": PROMPT, "multimodal_data": ["AAAA"]}}
    )
    assert r.status_code == 400


@pytest.mark.parametrize("form", ["list", "object"])
def test_logit_bias_by_text_bans_its_token(server, form):
    first = _complete(server, temperature=0, n_probs=1)["completion_probabilities"][0]
    # banning the greedy pick's text bans every token that text tokenizes to. Which token
    # greedy picks (and so whether its piece tokenizes back to it alone) differs between
    # CPUs on a near tie, so the rule is checked on the pick, whatever it is: the new pick is
    # none of the named tokens (for a word, the pick itself: the pick changes).
    named = server.tokenize(first["token"], add_special=False)
    assert named
    bias = [[first["token"], False]] if form == "list" else {first["token"]: False}
    banned = _complete(server, temperature=0, n_probs=1, logit_bias=bias)
    assert banned["completion_probabilities"][0]["id"] not in named, (first, named)


def test_post_sampling_probs_are_the_chains_distribution(server):
    # the model's top 3 log-probabilities (cold, so both requests compute the same prompt)
    pre = _complete(server, temperature=0, n_probs=3, cache_prompt=False)
    top = pre["completion_probabilities"][0]["top_logprobs"]
    # top-k 3 at temperature 1: the chain leaves the softmax of those three
    chain = {"temperature": 1.0, "top_k": 3, "top_p": 1.0, "min_p": 0.0, "seed": 7}
    post = _complete(server, n_probs=5, post_sampling_probs=True, cache_prompt=False, **chain)[
        "completion_probabilities"
    ][0]
    z = sum(math.exp(t["logprob"]) for t in top)
    want = {t["id"]: math.exp(t["logprob"]) / z for t in top}
    got = {t["id"]: t["prob"] for t in post["top_probs"]}
    assert got.keys() == want.keys()
    assert all(abs(got[i] - want[i]) < 1e-3 for i in want), (got, want)
    assert sum(got.values()) == pytest.approx(1.0, abs=1e-5)
    probs = [t["prob"] for t in post["top_probs"]]
    assert probs == sorted(probs, reverse=True)
    assert post["prob"] == pytest.approx(got[post["id"]])
    # greedy: the pick had probability 1, and it is the only candidate left
    greedy = _complete(server, temperature=0, n_probs=5, post_sampling_probs=True)
    g = greedy["completion_probabilities"][0]
    assert g["prob"] == 1.0 and [(t["id"], t["prob"]) for t in g["top_probs"]] == [(g["id"], 1.0)]
