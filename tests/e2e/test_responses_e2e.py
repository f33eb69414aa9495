"""/v1/responses through the real openai SDK, /apply-template and /infill on the default
model (Gemma 3 270M: a chat template without tool support, no FIM tokens)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import jsonschema
import openai
import pytest

from tests.tool_cases import PYTHON_RESPONSES

from .conftest import ServerProc

INPUT = [
    {"role": "system", "content": "Book"},
    {"role": "user", "content": "What is the best book"},
]
PYTHON = PYTHON_RESPONSES


@pytest.fixture(scope="module")
def client(server: ServerProc) -> Iterator[openai.OpenAI]:
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    yield c
    c.close()


# An answer of 8 tokens whatever the random seed samples (an end of turn first included):
# the tests read its text.
NO_EOS = {"ignore_eos": True}


def test_responses_with_openai_library(client: openai.OpenAI) -> None:
    res = client.responses.create(
        model="gpt-4.1", input=INPUT, max_output_tokens=8, temperature=0.8, extra_body=NO_EOS
    )
    assert res.id.startswith("resp_") and res.status == "completed"
    assert res.output[0].id.startswith("msg_") and res.output[0].type == "message"
    assert res.output_text and res.output_text == res.output[0].content[0].text
    assert res.usage.output_tokens == 8 and res.usage.input_tokens > 5
    assert res.model == "gpt-4.1"


def test_responses_stream_with_openai_library(client: openai.OpenAI) -> None:
    """llama-server's own streaming test: the ids tie the events together and the deltas
    add up to the completed response's text."""
    stream = client.responses.create(
        model="gpt-4.1",
        input=INPUT,
        max_output_tokens=8,
        temperature=0.8,
        stream=True,
        extra_body=NO_EOS,
    )
    kinds, gathered, resp_id, msg_id, completed = [], "", "", "", None
    for r in stream:
        kinds.append(r.type)
        if r.type == "response.created":
            resp_id = r.response.id
            assert resp_id.startswith("resp_")
        if r.type == "response.in_progress":
            assert r.response.id == resp_id
        if r.type == "response.output_item.added":
            msg_id = r.item.id
            assert msg_id.startswith("msg_")
        if r.type in (
            "response.content_part.added",
            "response.output_text.delta",
            "response.output_text.done",
            "response.content_part.done",
        ):
            assert r.item_id == msg_id
        if r.type == "response.output_item.done":
            assert r.item.id == msg_id
        if r.type == "response.output_text.delta":
            gathered += r.delta
        if r.type == "response.completed":
            completed = r.response
    assert completed is not None and completed.id == resp_id
    assert gathered and completed.output_text == gathered
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]


def test_instructions_and_text_input_render_like_chat(server: ServerProc) -> None:
    """``instructions`` + string input is the system + user chat prompt: the usage counts
    the tokens of exactly what /apply-template renders for those messages."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    prompt = server.client.post("/apply-template", json={"messages": messages}).json()["prompt"]
    n_prompt = len(server.tokenize(prompt, add_special=False))
    r = server.client.post(
        "/v1/responses", json={"instructions": "Be brief.", "input": "Hi", "max_output_tokens": 2}
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["input_tokens"] == n_prompt


def test_input_tokens_count_what_the_model_reads(server: ServerProc) -> None:
    body = {"instructions": "Be brief.", "input": "Hello there"}
    count = server.client.post("/v1/responses/input_tokens", json=body).json()
    r = server.client.post("/v1/responses", json={**body, "max_output_tokens": 1}).json()
    assert count == {"input_tokens": r["usage"]["input_tokens"], "object": "response.input_tokens"}
    messages = [{"role": "user", "content": "Hello there"}]
    count = server.client.post("/v1/chat/completions/input_tokens", json={"messages": messages})
    chat = server.client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1})
    assert count.json()["input_tokens"] == chat.json()["usage"]["prompt_tokens"]


def test_forced_function_call(client: openai.OpenAI) -> None:
    res = client.responses.create(
        model="m",
        input="Run print(1)",
        tools=[PYTHON],
        tool_choice="required",
        max_output_tokens=400,
    )
    calls = [o for o in res.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "python"
    assert calls[0].call_id.startswith("call_") and calls[0].id.startswith("fc_")
    jsonschema.validate(json.loads(calls[0].arguments), PYTHON["parameters"])


def test_forced_function_call_streamed(client: openai.OpenAI) -> None:
    stream = client.responses.create(
        model="m",
        input="Run print(1)",
        tools=[{**PYTHON}],
        tool_choice={"type": "function", "name": "python"},
        max_output_tokens=400,
        stream=True,
    )
    args, added, done = "", None, None
    for r in stream:
        if r.type == "response.output_item.added" and r.item.type == "function_call":
            added = r.item
        if r.type == "response.function_call_arguments.delta":
            assert added is not None and r.item_id == added.id
            args += r.delta
        if r.type == "response.output_item.done" and r.item.type == "function_call":
            done = r.item
    assert added is not None and done is not None and done.id == added.id
    assert done.name == "python" and done.arguments == args
    jsonschema.validate(json.loads(args), PYTHON["parameters"])


@pytest.mark.parametrize(
    "extra,field",
    [
        ({"previous_response_id": "resp_123"}, "previous_response_id"),
        ({"store": True}, "store"),
        ({"background": True}, "background"),
        ({"conversation": "conv_1"}, "conversation"),
    ],
)
def test_stateful_fields_are_refused(server: ServerProc, extra: dict, field: str) -> None:
    r = server.client.post("/v1/responses", json={"input": "hi", **extra})
    assert r.status_code == 400 and field in r.text, r.text


def test_malformed_input_is_a_400(server: ServerProc) -> None:
    r = server.client.post("/v1/responses", json={"input": [{"foo": 1}]})
    assert r.status_code == 400 and "Cannot determine type of 'item'" in r.text
    assert server.client.post("/v1/responses", json={}).status_code == 400


def test_responses_return_progress(server: ServerProc) -> None:
    """llama-server's telemetry test: progress rides on response.in_progress events."""
    body = {"input": "This is a test" * 10, "max_output_tokens": 4, "stream": True, **NO_EOS}
    events = _events(server, "/responses", {**body, "return_progress": True})
    deltas = [d for d in events if d["type"] == "response.output_text.delta"]
    assert not any("timings" in d for d in deltas)
    events = _events(
        server, "/responses", {**body, "return_progress": True, "timings_per_token": True}
    )
    deltas = [d for d in events if d["type"] == "response.output_text.delta"]
    assert deltas and all("prompt_per_second" in d["timings"] for d in deltas)
    progress = [d for d in events if "prompt_progress" in d]
    assert progress and all(d["type"] == "response.in_progress" for d in progress)
    p = [d["prompt_progress"] for d in progress]
    assert p[-1]["processed"] == p[-1]["total"] and all(x["processed"] >= x["cache"] for x in p)
    completed = events[-1]
    assert completed["type"] == "response.completed" and "usage" in completed["response"]
    assert "timings" in completed
    assert not any("prompt_progress" in d for d in _events(server, "/responses", body))


@pytest.mark.parametrize("path", ["/completion", "/v1/completions", "/v1/chat/completions"])
def test_timings_per_token(server: ServerProc, path: str) -> None:
    body = {"prompt": "Once upon a time", "n_predict": 4, "max_tokens": 4, "stream": True}
    if "chat" in path:
        body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "stream": True}
    body |= NO_EOS  # text to carry timings, whatever the random seed samples
    plain = _events(server, path, body)
    assert sum("timings" in e for e in plain) == 1  # the final chunk's only
    events = _events(server, path, {**body, "timings_per_token": True})
    text = [e for e in events if e.get("content") or (e.get("choices") or [{}])[0].get("text")]
    text += [e for e in events if (e.get("choices") or [{}])[0].get("delta", {}).get("content")]
    assert text and all(e["timings"]["predicted_n"] >= 1 for e in text)
    n = [e["timings"]["predicted_n"] for e in text]
    assert n == sorted(n)


def _events(server: ServerProc, path: str, body: dict) -> list[dict]:
    """The data of each SSE event of a streamed request."""
    out = []
    with server.client.stream("POST", path, json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                out.append(json.loads(line[6:]))
    return out


# ---- /apply-template ---------------------------------------------------------------------


def test_apply_template_is_the_chat_prompt(server: ServerProc) -> None:
    """The rendered prompt is what chat feeds the model: same token count as its usage."""
    messages = [{"role": "user", "content": "What is today?"}]
    r = server.client.post("/apply-template", json={"messages": messages})
    assert r.status_code == 200
    prompt = r.json()["prompt"]
    assert prompt.endswith("<start_of_turn>model\n") and "What is today?" in prompt
    chat = server.client.post(
        "/v1/chat/completions", json={"messages": messages, "max_tokens": 1}
    ).json()
    assert chat["usage"]["prompt_tokens"] == len(server.tokenize(prompt, add_special=False))


def test_apply_template_add_generation_prompt(server: ServerProc) -> None:
    messages = [{"role": "user", "content": "What is today?"}]
    body = {"messages": messages, "add_generation_prompt": False}
    prompt = server.client.post("/apply-template", json=body).json()["prompt"]
    assert "<start_of_turn>model" not in prompt and prompt.endswith("<end_of_turn>\n")


@pytest.mark.parametrize("tools", [None, [], "tool"])
def test_apply_template_with_tools(server: ServerProc, tools) -> None:  # noqa: ANN001
    """Tools go in as chat puts them (the generic system text for this template)."""
    tool = {"type": "function", "function": {k: v for k, v in PYTHON.items() if k != "type"}}
    body = {
        "messages": [{"role": "user", "content": "What is today?"}],
        "tools": [tool] if tools == "tool" else tools,
    }
    r = server.client.post("/apply-template", json=body)
    assert r.status_code == 200, r.text
    assert ("python" in r.json()["prompt"]) == (tools == "tool")


def test_apply_template_refuses_what_chat_refuses(server: ServerProc) -> None:
    r = server.client.post("/apply-template", json={"messages": [{"role": "wizard"}]})
    assert r.status_code == 400


# ---- /infill -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "body",
    [
        {"input_prefix": "int main() {\n", "prompt": "    int n = ", "input_suffix": "}\n"},
        {"input_extra": [{"filename": 1}], "input_prefix": "a", "input_suffix": "b"},
    ],
)
def test_infill_without_fim_tokens_is_llama_servers_error(server: ServerProc, body) -> None:  # noqa: ANN001
    r = server.client.post("/infill", json=body)
    assert r.status_code == 501
    assert r.json()["error"] == {
        "code": 501,
        "message": "Infill is not supported by this model: prefix token is missing. "
        "suffix token is missing. middle token is missing. ",
        "type": "not_supported_error",
    }
