"""Issue 40: the work of rendering and counting a chat grows linearly with its messages.

Through the real routes (count_tokens, /v1/chat/completions/render, /apply-template,
Responses' input_tokens) on the fake engine, with a tokenizer that knows the template's
special tokens: per request the template renders a constant number of times, every
character is tokenized about once, and no tokenizer call holds more than a constant number
of special tokens (llama.cpp's cost per call is quadratic in them). Counted, not timed."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from starlette.testclient import TestClient

from server.protocols import anthropic, apply_template, render, responses
from server.service.tokenizer import Special
from server.settings.config import Settings
from server.templates.chat_template import BUILTIN_TEMPLATES, ChatTemplate
from tests.unit.helpers import route_client
from tests.unit.test_chat_route import TextBackend

MARKERS = ("<start_of_turn>", "<end_of_turn>", "<bos>")


class CountingBackend(TextBackend):
    """Counts what the tokenizer is asked: calls, characters, special tokens per call."""

    def __init__(self) -> None:
        super().__init__(n_ctx=2048)
        self.calls = 0
        self.chars = 0
        self.most_specials = 0

    def special_tokens(self) -> list[Special]:
        return [Special(m) for m in MARKERS]

    def tokenize(
        self, text: str, add_special: bool = False, parse_special: bool = False
    ) -> list[int]:
        self.calls += 1
        self.chars += len(text)
        self.most_specials = max(self.most_specials, sum(text.count(m) for m in MARKERS))
        return super().tokenize(text, add_special, parse_special)


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[TestClient, Any, list[int]]]:
    renders = [0]
    real_render = ChatTemplate.render

    def render_counted(self: ChatTemplate, *a: Any, **k: Any) -> str:
        renders[0] += 1
        return real_render(self, *a, **k)

    monkeypatch.setattr(ChatTemplate, "render", render_counted)
    tpl = ChatTemplate(BUILTIN_TEMPLATES["gemma"], "<bos>", name="gemma")
    backend = CountingBackend()
    routers = [anthropic.router, render.router, apply_template.router, responses.router]
    with route_client(backend, Settings(), routers, template=tpl) as c:
        yield c, backend, renders


def turns(n: int) -> list[dict[str, str]]:
    return [
        {"role": "user" if i % 2 == 0 else "assistant", "content": f"m{i} " * 8}
        for i in range(n + 1 - n % 2)
    ]


CASES = [
    ("/v1/messages/count_tokens", lambda m: {"model": "x", "messages": m}),
    ("/v1/chat/completions/render", lambda m: {"messages": m}),
    ("/v1/responses/input_tokens", lambda m: {"input": m}),
]


@pytest.mark.parametrize(("path", "body"), CASES)
def test_work_per_request_is_linear_in_messages(
    counted: tuple[TestClient, Any, list[int]], path: str, body: Any
) -> None:
    c, backend, renders = counted
    seen = []
    for n in (2_000, 8_000):
        backend.calls = backend.chars = backend.most_specials = renders[0] = 0
        m = turns(n)
        text = c.post("/apply-template", json={"messages": m}).json()["prompt"]
        r = c.post(path, json=body(m))
        assert r.status_code == 200, r.text
        # the apply-template call's one render and one (short: unused) tokenizer check
        seen.append((renders[0] - 1, backend.chars, backend.most_specials, len(text)))
    (r1, chars1, most1, len1), (r2, chars2, most2, len2) = seen
    assert r1 == r2 <= 3  # the prompt and the head before the last user turn: not per message
    assert chars2 <= 1.1 * len2 and chars1 <= 1.1 * len1  # each character about once
    assert most2 <= most1 * 1.2 < 2_000  # the pieces stay small however long the chat
