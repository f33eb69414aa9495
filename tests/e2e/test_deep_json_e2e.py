"""A history tool call whose ``arguments`` string nests 1,000 and 5,000 levels deep (issue 56,
item 7): every endpoint that renders a conversation answers a 400 naming the depth, never a
500 (Python's JSON decoder raised RecursionError at about 1,000 levels). The model's side (calls
it writes that nest too deep are kept as text) is tested in tests/unit/test_deep_json.py."""

from __future__ import annotations

import pytest

from .conftest import ServerProc

TOOL = {
    "type": "function",
    "function": {
        "name": "f",
        "description": "A tool.",
        "parameters": {"type": "object", "properties": {"a": {"type": "array"}}},
    },
}


def deep(depth: int) -> str:
    """A JSON object whose one value is a list ``depth - 1`` levels deep (``depth`` in all)."""
    return '{"a":' + "[" * (depth - 1) + "]" * (depth - 1) + "}"


def chat_body(arguments: str, tools: bool) -> dict:
    """A chat whose assistant turn called ``f`` with ``arguments``, then its result."""
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    body: dict = {
        "messages": [
            {"role": "user", "content": "Call f."},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "done"},
            {"role": "user", "content": "And now?"},
        ],
        "max_tokens": 2,
    }
    if tools:
        body["tools"] = [TOOL]
    return body


def responses_body(arguments: str) -> dict:
    return {
        "input": [
            {"type": "message", "role": "user", "content": "Call f."},
            {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": arguments},
            {"type": "function_call_output", "call_id": "call_1", "output": "done"},
        ],
        "tools": [{"type": "function", **TOOL["function"]}],
        "max_output_tokens": 16,
    }


ENDPOINTS = [
    ("/v1/chat/completions", lambda a: chat_body(a, tools=False)),
    ("/v1/chat/completions", lambda a: chat_body(a, tools=True)),
    ("/v1/chat/completions/input_tokens", lambda a: chat_body(a, tools=True)),
    ("/v1/chat/completions/render", lambda a: chat_body(a, tools=True)),
    ("/apply-template", lambda a: chat_body(a, tools=False)),
    ("/v1/responses", responses_body),
    ("/v1/responses/input_tokens", responses_body),
]
IDS = [
    "chat",
    "chat-tools",
    "chat-input-tokens",
    "chat-render",
    "apply-template",
    "responses",
    "responses-input-tokens",
]


@pytest.mark.parametrize("depth", [1000, 5000])
@pytest.mark.parametrize("path,body", ENDPOINTS, ids=IDS)
def test_a_history_call_nesting_too_deep_is_a_400(server: ServerProc, path, body, depth):
    r = server.client.post(path, json=body(deep(depth)))
    assert r.status_code == 400, (r.status_code, r.text[:500])
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    assert "nests deeper than 512 levels" in err["message"], err
