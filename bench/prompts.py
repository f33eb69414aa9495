"""Deterministic prompt text, cut to a token count with the server's own tokenizer.

Every text is seeded by a key (e.g. "w1-r0"), so all servers get byte-identical prompts and
each repeat gets a fresh prompt that no prefix cache already holds.
"""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable

import httpx

_WORD_TEXT = (
    "the a an of to in for on with at by from about over under between after before during "
    "river mountain city village market garden library engine window bridge harbor forest "
    "teacher farmer sailor doctor writer painter builder student traveler merchant neighbor "
    "morning evening winter summer season history weather journey letter story question answer "
    "quickly slowly carefully quietly often rarely always never together alone again already "
    "build carry watch follow explain remember describe discover measure gather repair travel "
    "bright heavy narrow ancient gentle sudden hidden famous simple careful distant crowded "
    "stone water light paper iron glass wood salt bread music silver copper wool grain "
    "because although while until unless since whenever wherever however therefore meanwhile "
    "small large old new early late long short warm cold green blue quiet busy open closed "
    "road field tower school station island valley shore lake hill cloud rain snow wind fire "
    "people families children workers visitors friends leaders soldiers pilots engineers"
)
WORDS = tuple(_WORD_TEXT.split())


def sentence(rng: random.Random, n_words: int) -> str:
    words = [rng.choice(WORDS) for _ in range(n_words)]
    return words[0].capitalize() + " " + " ".join(words[1:]) + "."


def paragraph(rng: random.Random, n_words: int) -> str:
    out: list[str] = []
    left = n_words
    while left > 0:
        n = min(left, rng.randint(8, 18))
        out.append(sentence(rng, max(n, 2)))
        left -= n
    return " ".join(out)


def short_text(key: str, n_words: int) -> str:
    """A short seeded sentence (no tokenizer needed), e.g. a question or a user turn."""
    return paragraph(random.Random(key), n_words)


Tokenizer = Callable[[str], Awaitable[list[str]]]  # text -> token pieces


def http_tokenizer(client: httpx.AsyncClient, base_url: Callable[[], str]) -> Tokenizer:
    """`POST /tokenize` with pieces (llama-server and ours both implement it). The URL is
    asked for at each call: a workload may restart the server on another port."""

    async def tokenize(text: str) -> list[str]:
        resp = await client.post(
            f"{base_url()}/tokenize", json={"content": text, "with_pieces": True}
        )
        resp.raise_for_status()
        pieces = []
        for tok in resp.json()["tokens"]:
            piece = tok["piece"]
            pieces.append(piece if isinstance(piece, str) else bytes(piece).decode("latin-1"))
        return pieces

    return tokenize


class PromptBook:
    """Long texts of an exact token length (without BOS), cached so every server gets the same."""

    def __init__(self, tokenize: Tokenizer) -> None:
        self._tokenize = tokenize
        self._texts: dict[tuple[str, int], str] = {}

    async def text(self, key: str, n_tokens: int) -> str:
        k = (key, n_tokens)
        if k not in self._texts:
            self._texts[k] = await self._fit(key, n_tokens)
        return self._texts[k]

    async def _fit(self, key: str, n_tokens: int) -> str:
        n_words = n_tokens + 32
        while True:
            pieces = await self._tokenize(paragraph(random.Random(key), n_words))
            if len(pieces) >= n_tokens:
                return "".join(pieces[:n_tokens])
            n_words *= 2
