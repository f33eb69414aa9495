"""/v1/chat/completions and /apply-template over the engine on the fake backend: a final
message continued (llama-server's assistant prefill, vLLM's continue_final_message), the
``__verbose`` debug object, and the stream's opening and usage chunks."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from starlette.testclient import TestClient

from server.protocols import apply_template, openai
from server.settings.config import Settings
from server.templates.chat_template import (
    BUILTIN_TEMPLATES,
    ChatTemplate,
    Continuation,
    TemplateError,
)
from tests.fake_backend import FakeBackend
from tests.unit.helpers import route_client

GEMMA_TURN = "<start_of_turn>model\n"


class TextBackend(FakeBackend):
    """The fake model with a one-token-per-character tokenizer that reads back."""

    bos_text = "<bos>"

    def tokenize(
        self, text: str, add_special: bool = False, parse_special: bool = False
    ) -> list[int]:
        return [ord(c) % 900 for c in text]

    def token_to_piece(self, token: int, special: bool = False) -> bytes:
        return chr(token).encode()

    def detokenize(self, tokens: list[int]) -> str:
        return "".join(chr(t) for t in tokens)


def _app(settings: Settings) -> Iterator[TestClient]:
    template_ = ChatTemplate(BUILTIN_TEMPLATES["gemma"], "<bos>", name="gemma")
    routers = [openai.router, apply_template.router]
    with route_client(TextBackend(n_ctx=2048), settings, routers, template=template_) as c:
        yield c


@pytest.fixture
def client() -> Iterator[TestClient]:
    yield from _app(Settings())


@pytest.fixture
def no_prefill() -> Iterator[TestClient]:
    yield from _app(Settings(prefill_assistant=False))


ASK = [{"role": "system", "content": "Book"}, {"role": "user", "content": "Best book?"}]


def _prompt(c: TestClient, messages: list[dict[str, Any]], **body: Any) -> str:
    r = c.post("/apply-template", json={"messages": messages, **body})
    assert r.status_code == 200, r.text
    return r.json()["prompt"]


def test_final_assistant_message_is_continued(client: TestClient) -> None:
    opened = _prompt(client, ASK)
    assert opened.endswith(GEMMA_TURN)
    prefilled = _prompt(client, [*ASK, {"role": "assistant", "content": "Whill"}])
    assert prefilled == opened + "Whill"  # the turn stays open: no <end_of_turn>
    parts = [{"type": "text", "text": "Wh"}, {"type": "text", "text": "ill"}]
    assert _prompt(client, [*ASK, {"role": "assistant", "content": parts}]) == opened + "Wh\n\nill"
    # vLLM's explicit form gives the same prompt
    explicit = {"continue_final_message": True, "add_generation_prompt": False}
    assert _prompt(client, [*ASK, {"role": "assistant", "content": "Whill"}], **explicit) == (
        prefilled
    )


def test_continuation_refusals(client: TestClient) -> None:
    def error(messages: list[dict[str, Any]], **body: Any) -> str:
        r = client.post("/v1/chat/completions", json={"messages": messages, **body})
        assert r.status_code == 400, r.text
        return r.json()["error"]["message"]

    both = {"continue_final_message": True, "add_generation_prompt": True}
    assert "Cannot set both" in error([*ASK, {"role": "assistant", "content": "Hi"}], **both)
    two = [*ASK, {"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}]
    assert "2 or more assistant messages" in error(two)
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    calling = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]}]
    assert "tool calls" in error(calling)


def test_prefill_off_answers_after_the_assistant_message(no_prefill: TestClient) -> None:
    two = [*ASK, {"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}]
    prompt = _prompt(no_prefill, two)
    assert prompt.endswith("b<end_of_turn>\n" + GEMMA_TURN)


def test_no_generation_prompt(client: TestClient) -> None:
    assert _prompt(client, ASK, add_generation_prompt=False).endswith("Best book?<end_of_turn>\n")


def test_continuation_inside_an_open_thinking_block() -> None:
    tpl = ChatTemplate(
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}"
        "{% if add_generation_prompt %}<assistant><think>\n{% endif %}"
    )
    msgs = [{"role": "user", "content": "Q"}]
    head = "<user>Q</user><assistant><think>\n"
    r = tpl.render_chat(msgs, False, Continuation("So", "Hmm", in_reasoning=True))
    assert (r.prompt, r.in_reasoning) == (head + "Hmm", True)
    r = tpl.render_chat(msgs, False, Continuation("So", "Hmm"))
    assert (r.prompt, r.in_reasoning) == (head + "Hmm\n</think>\n\nSo", False)
    plain = ChatTemplate(BUILTIN_TEMPLATES["chatml"])
    with pytest.raises(TemplateError) as e:
        plain.render_chat(msgs, False, Continuation("", "Hmm", in_reasoning=True))
    assert e.value.client


def test_command_r_builtin() -> None:
    # llama.cpp's test_apply_chat_template expects exactly this
    msgs = [
        {"role": "system", "content": "You are a test."},
        {"role": "user", "content": "Hi there"},
    ]
    assert ChatTemplate(BUILTIN_TEMPLATES["command-r"]).render(msgs) == (
        "<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>You are a test.<|END_OF_TURN_TOKEN|>"
        "<|START_OF_TURN_TOKEN|><|USER_TOKEN|>Hi there<|END_OF_TURN_TOKEN|>"
        "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>"
    )


def test_verbose_shows_the_prompt_the_model_read(client: TestClient) -> None:
    messages = [*ASK, {"role": "assistant", "content": "Whill"}]
    body = {"messages": messages, "max_tokens": 3}
    r = client.post("/v1/chat/completions", json={**body, "verbose": True}).json()
    verbose = r["__verbose"]
    assert verbose["prompt"].endswith(GEMMA_TURN + "Whill")
    assert verbose["content"] == r["choices"][0]["message"]["content"]
    assert verbose["tokens_predicted"] == r["usage"]["completion_tokens"] == 3
    assert "__verbose" not in client.post("/v1/chat/completions", json=body).json()


def test_verbose_defaults_to_the_verbose_flag() -> None:
    for c in _app(Settings(verbose=True)):
        body = {"messages": ASK, "max_tokens": 2}
        assert "__verbose" in c.post("/v1/chat/completions", json=body).json()
        off = c.post("/v1/chat/completions", json={**body, "verbose": False}).json()
        assert "__verbose" not in off


def _events(c: TestClient, body: dict[str, Any]) -> list[dict[str, Any]]:
    with c.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        lines = [x[6:] for x in r.iter_lines() if x.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


def test_stream_opening_usage_timings_and_verbose(client: TestClient) -> None:
    body = {
        "messages": ASK,
        "max_tokens": 4,
        "stream_options": {"include_usage": True},
        "timings_per_token": True,
        "verbose": True,
    }
    events = _events(client, body)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}
    assert "timings" not in events[0]
    usage = events[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 4
    assert usage["timings"]["predicted_n"] == 4
    final = events[-2]
    assert final["choices"][0]["finish_reason"] == "length"
    assert final["__verbose"]["prompt"].endswith(GEMMA_TURN)
    assert not any("__verbose" in e for e in events[:-2])


def test_context_exceeded_error_shape(client: TestClient) -> None:
    long = [{"role": "user", "content": "x" * 3000}]
    for stream in (False, True):
        r = client.post("/v1/chat/completions", json={"messages": long, "stream": stream})
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["type"] == "exceed_context_size_error"
        assert err["n_ctx"] == 2048 and err["n_prompt_tokens"] > 3000


def test_system_fingerprint_is_a_build_tag_and_model_the_name(client: TestClient) -> None:
    r = client.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 1}).json()
    # llama-server's tests check the "b" of its build tag (b<number>-<commit>)
    assert r["system_fingerprint"].startswith("b") and r["system_fingerprint"] != r["model"]
