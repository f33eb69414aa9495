"""/completion's request forms over the engine on the fake backend: llama-server's prompt forms
(server.prompts.completion_forms), several prompts in one request, logit_bias forms, post_sampling_probs and
--n-predict as the default limit."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator

import pytest
from starlette.testclient import TestClient

from server.prompts.completion_forms import prompt_echo, prompt_tokens, split_prompts
from server.protocols import native
from server.schemas.errors import APIError
from server.service.sampling import _logit_bias
from server.settings.config import Settings
from tests.fake_backend import EOG, FakeBackend
from tests.unit.helpers import route_client

BOS = 900


def _tok(text: str, add_special: bool = False, parse_special: bool = False) -> list[int]:
    """One token per character (a space is its own token), BOS first when asked."""
    return [BOS] * add_special + [ord(c) % 800 + 1 for c in text]


class TextBackend(FakeBackend):
    """The fake model with a one-token-per-character tokenizer."""

    def tokenize(
        self, text: str, add_special: bool = False, parse_special: bool = False
    ) -> list[int]:
        return _tok(text, add_special)

    def detokenize(self, tokens: list[int]) -> str:
        return "".join(self.token_to_piece(t).decode() for t in tokens)


def _client(settings: Settings) -> Iterator[TestClient]:
    with route_client(TextBackend(), settings, [native.router]) as c:
        yield c


@pytest.fixture
def client() -> Iterator[TestClient]:
    yield from _client(Settings())


# ---- prompt forms (pure) ----


def test_each_prompt_form_tokenizes_as_llama_server() -> None:
    assert prompt_tokens("ab", _tok) == _tok("ab", True)
    assert prompt_tokens([1, 2], _tok) == [1, 2]
    # mixed: BOS only where text opens the prompt
    assert prompt_tokens([1, "ab", 3], _tok) == [1, *_tok("ab"), 3]
    assert prompt_tokens(["ab", 3, "c"], _tok) == [*_tok("ab", True), 3, *_tok("c")]
    assert prompt_tokens({"prompt_string": "ab"}, _tok) == _tok("ab", True)
    assert prompt_tokens({"prompt_string": [5, "a"]}, _tok) == [5, *_tok("a")]


def test_a_list_without_token_ids_is_a_list_of_prompts() -> None:
    raw = [[1, 2], "ab", {"prompt_string": "c"}]
    assert split_prompts(raw) == raw
    assert split_prompts([1, "ab"]) == [[1, "ab"]]  # a token id at the top: one prompt
    assert split_prompts("ab") == ["ab"]
    assert [prompt_echo(p) for p in raw] == ["", "ab", "c"]
    with pytest.raises(APIError, match="must not be empty"):
        split_prompts([])


@pytest.mark.parametrize(
    "bad",
    [
        {"prompt_string": "a", "multimodal_data": ["iVBORw0KGgo="]},
        {"text": "a"},
        [1, 2.5],
        True,
        {"prompt_string": 3},
    ],
)
def test_forms_llama_server_refuses_are_400(bad) -> None:
    with pytest.raises(APIError) as e:
        prompt_tokens(bad, _tok)
    assert e.value.status == 400


# ---- logit_bias forms ----


def test_logit_bias_takes_ids_texts_and_false() -> None:
    b = TextBackend()
    assert _logit_bias([[5, -2], [" a", False]], b) == {
        5: -2.0,
        **dict.fromkeys(_tok(" a"), -math.inf),
    }
    # the object form: a whole decimal key is an id, anything else a text
    assert _logit_bias({"7": 1, "ab": -100}, b) == {7: 1.0, **dict.fromkeys(_tok("ab"), -100.0)}


# llama-server skips what is not a pair or has neither a number nor false as its bias; a
# client's malformed field is a 400 here (issue 25: {"5": "x"} answered 200)
@pytest.mark.parametrize(
    "bad",
    [
        [[5000, 1]],
        {"-1": 1},
        [[5, 101]],
        {"ab": -1000},
        [[5]],
        [[6, True]],
        [[7, "x"]],
        [[8, 1.5, 2]],
        {"5": "x"},
        {"5": None},
    ],
)
def test_logit_bias_out_of_range_is_400(bad) -> None:
    with pytest.raises(APIError) as e:
        _logit_bias(bad, TextBackend())
    assert e.value.status == 400


def test_logit_bias_forms_reach_the_request(client: TestClient) -> None:
    body = {"prompt": "ab", "n_predict": 1, "logit_bias": {"xy": False, "12": 3}}
    r = client.post("/completion", json=body)
    assert r.status_code == 200, r.text
    got = {e["token"]: e["bias"] for e in r.json()["generation_settings"]["logit_bias"]}
    # a ban (-inf) is null in JSON, as llama-server writes it
    assert got == {**dict.fromkeys(_tok("xy"), None), 12: 3.0}


# ---- the route ----


def test_several_prompts_give_a_list_by_index(client: TestClient) -> None:
    prompts = [[BOS, 5, 6], "ab", {"prompt_string": "abc"}]
    r = client.post("/completion", json={"prompt": prompts, "n_predict": 2})
    assert r.status_code == 200, r.text
    out = r.json()
    assert isinstance(out, list) and [o["index"] for o in out] == [0, 1, 2]
    assert [o["tokens_evaluated"] for o in out] == [3, 3, 4]
    assert [o["prompt"] for o in out] == ["", "ab", "abc"]
    assert all(o["tokens_predicted"] == 2 for o in out)
    # one prompt (a mixed one too): one object
    one = client.post("/completion", json={"prompt": [BOS, 5, "ab"], "n_predict": 1}).json()
    assert isinstance(one, dict) and one["index"] == 0 and one["tokens_evaluated"] == 4


def test_several_prompts_stream_with_their_index(client: TestClient) -> None:
    body = {"prompt": ["ab", "cd"], "n_predict": 3, "stream": True}
    with client.stream("POST", "/completion", json=body) as r:
        events = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: ")]
    for i in (0, 1):
        mine = [e for e in events if e["index"] == i]
        assert len(mine) == 4 and mine[-1]["stop"] is True
        assert mine[-1]["tokens_predicted"] == 3


def test_multimodal_data_is_400(client: TestClient) -> None:
    body = {"prompt": {"prompt_string": "a <__media__>", "multimodal_data": ["iVBO"]}}
    r = client.post("/completion", json=body)
    assert r.status_code == 400 and "multimodal" in r.json()["error"]["message"].lower()


def test_post_sampling_probs_are_probabilities(client: TestClient) -> None:
    body = {"prompt": "ab", "n_predict": 2, "n_probs": 3, "temperature": 0}
    plain = client.post("/completion", json=body).json()["completion_probabilities"]
    assert all("logprob" in p and "top_logprobs" in p for p in plain)
    post = client.post("/completion", json={**body, "post_sampling_probs": True}).json()
    probs = post["completion_probabilities"]
    assert len(probs) == 2
    for p in probs:
        # the fake chain leaves only the sampled token: probability 1
        assert "logprob" not in p and p["prob"] == 1.0
        assert p["top_probs"] == [
            {"id": p["id"], "token": p["token"], "bytes": p["bytes"], "prob": 1.0}
        ]
    body["stream"] = True
    with client.stream("POST", "/completion", json={**body, "post_sampling_probs": True}) as r:
        chunks = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: ")]
    streamed = [c["completion_probabilities"][0] for c in chunks if not c["stop"]]
    assert [p["prob"] for p in streamed] == [1.0, 1.0]


def test_n_predict_flag_is_the_default_limit_not_a_cap() -> None:
    for c in _client(Settings(n_predict=3)):
        default = c.post("/completion", json={"prompt": "ab"}).json()
        assert default["tokens_predicted"] == 3
        assert default["generation_settings"]["n_predict"] == 3
        # a request's own limit wins, above --n-predict too (llama-server)
        own = c.post("/completion", json={"prompt": "ab", "n_predict": 5}).json()
        assert own["tokens_predicted"] == 5


def test_response_fields_pick_and_unnest(client: TestClient) -> None:
    fields = ["content", "generation_settings/n_predict", "missing", "timings/nope"]
    body = {"prompt": "ab", "n_predict": 2, "response_fields": fields}
    out = client.post("/completion", json=body).json()
    assert set(out) == {"content", "generation_settings/n_predict"}
    assert out["generation_settings/n_predict"] == 2 and len(out["content"]) == 2
    with client.stream("POST", "/completion", json={**body, "stream": True}) as r:
        events = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: ")]
    assert events[-1] == {"content": "", "generation_settings/n_predict": 2}
    assert all(e["stop"] is False for e in events[:-1])  # chunks stay whole


def test_ignore_eos_bans_every_end_of_generation_token(client: TestClient) -> None:
    body = {"prompt": "ab", "n_predict": 2, "ignore_eos": True, "logit_bias": {"12": 3}}
    r = client.post("/completion", json=body)
    assert r.status_code == 200, r.text
    got = {e["token"]: e["bias"] for e in r.json()["generation_settings"]["logit_bias"]}
    assert got == {12: 3.0, EOG: None}  # llama-server's logit_bias_eog, next to the request's
    plain = client.post("/completion", json={**body, "ignore_eos": False}).json()
    assert plain["generation_settings"]["logit_bias"] == [{"bias": 3.0, "token": 12}]


def test_return_tokens_gives_the_generated_ids(client: TestClient) -> None:
    body = {"prompt": "ab", "n_predict": 3}
    out = client.post("/completion", json={**body, "return_tokens": True}).json()
    assert len(out["tokens"]) == 3 == out["tokens_predicted"]
    assert all(isinstance(t, int) for t in out["tokens"])
    assert client.post("/completion", json=body).json()["tokens"] == []  # llama-server's
