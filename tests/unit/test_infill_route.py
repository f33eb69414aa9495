"""/infill over the engine on the fake backend, given FIM tokens: the prompt the engine
runs is llama-server's, and malformed bodies are 400s (the default model has no FIM tokens,
so the e2e tests only see the 501)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from starlette.testclient import TestClient

from server.engine.engine import Engine
from server.prompts.infill_prompt import FimTokens
from server.protocols import infill
from server.settings.config import Settings
from tests.fake_backend import FakeBackend
from tests.unit.helpers import route_client

BOS, PRE, SUF, MID = 900, 901, 902, 903


class FimBackend(FakeBackend):
    """The fake model with FIM tokens and a one-token-per-character tokenizer."""

    fim = FimTokens(pre=PRE, suf=SUF, mid=MID)
    add_bos = True
    bos_id = BOS

    def tokenize(
        self, text: str, add_special: bool = False, parse_special: bool = False
    ) -> list[int]:
        return [BOS] * add_special + [ord(c) % 800 + 1 for c in text]

    def detokenize(self, tokens: list[int]) -> str:
        return "".join(self.token_to_piece(t).decode() for t in tokens)


def _client(backend: FakeBackend) -> Iterator[tuple[TestClient, Engine]]:
    with route_client(backend, Settings(), [infill.router]) as c:
        yield c, c.app.state.server.engine


@pytest.fixture
def fim() -> Iterator[tuple[TestClient, Engine]]:
    yield from _client(FimBackend())


def test_the_engine_runs_llama_servers_prompt(fim: tuple[TestClient, Engine]) -> None:
    client, engine = fim
    body = {"input_prefix": "ab", "input_suffix": "yz", "prompt": "P", "n_predict": 2}
    r = client.post("/infill", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    tok = FimBackend().tokenize
    expected = [BOS, PRE, *tok("ab"), *tok("P"), SUF, *tok("yz"), MID]
    assert out["tokens_evaluated"] == len(expected) and out["tokens_predicted"] == 2
    assert engine.slots[out["id_slot"]].tokens[: len(expected)] == expected
    assert len(out["content"]) == 2 and out["stop"] is True


def test_infill_streams_like_completion(fim: tuple[TestClient, Engine]) -> None:
    client, _ = fim
    body = {"input_prefix": "ab", "input_suffix": "yz", "n_predict": 3, "stream": True}
    with client.stream("POST", "/infill", json=body) as r:
        lines = [x for x in r.iter_lines() if x.startswith("data: ")]
    assert len(lines) == 4 and '"stop": true' in lines[-1]


@pytest.mark.parametrize(
    "input_extra",
    [
        {},
        {"filename": "ok"},
        {"filename": 123},
        {"filename": 123, "text": "abc"},
        {"filename": 123, "text": 456},
    ],
)
def test_invalid_input_extra(fim: tuple[TestClient, Engine], input_extra: dict) -> None:
    client, _ = fim
    body = {"input_extra": [input_extra], "input_prefix": "a", "input_suffix": "b"}
    r = client.post("/infill", json=body)
    assert r.status_code == 400 and "error" in r.json()


def test_without_fim_tokens_llama_servers_501() -> None:
    backend = FimBackend()
    backend.fim = FimTokens(pre=PRE)
    for client, _ in _client(backend):
        r = client.post("/infill", json={"input_prefix": "a", "input_suffix": "b"})
        assert r.status_code == 501
        assert r.json()["error"]["message"] == (
            "Infill is not supported by this model: suffix token is missing. "
            "middle token is missing. "
        )
