"""The Anthropic Messages body -> chat body mapping, and the answer's blocks, stop reasons and
usage (server.protocols.anthropic_mapping): exact outputs for exact inputs."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from server.protocols.anthropic_mapping import (
    AnthropicInputError,
    anthropic_chat_messages,
    content_blocks,
    stop_reason,
    to_chat_body,
    tool_input,
    usage,
)
from server.protocols.vertex import request_format
from server.schemas.anthropic_bodies import CountTokensRequest, MessagesRequest
from server.schemas.bodies import ChatRequest
from server.schemas.errors import anthropic_error_body, anthropic_path, error_body_for
from server.task import FinishReason, TaskResult, Timings
from server.templates.output_parse import Message, ToolCall


def body(**kw) -> MessagesRequest:
    return MessagesRequest.model_validate({"max_tokens": 8, "messages": [], **kw})


def test_system_and_text_blocks():
    req = body(
        system=[
            {"type": "text", "text": "A"},
            {"type": "text", "text": "B", "cache_control": {"type": "ephemeral"}},
        ],
        messages=[
            {
                "role": "user",
                "content": [{"type": "text", "text": "x"}, {"type": "text", "text": "y"}],
            },
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": "z"},
        ],
    )
    assert anthropic_chat_messages(req) == [
        {
            "role": "system",
            "content": [{"type": "text", "text": "A"}, {"type": "text", "text": "B"}],
        },
        {"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "text", "text": "y"}]},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "z"},
    ]


def test_no_messages_is_one_empty_user_turn():
    assert anthropic_chat_messages(body(system="S")) == [
        {"role": "system", "content": [{"type": "text", "text": "S"}]},
        {"role": "user", "content": ""},
    ]


def test_claude_code_billing_stamp_is_blanked():
    stamp = "x-anthropic-billing-header: cc_version=2.1.1; cc_entrypoint=cli; cch=a5145;You are Claude Code."
    (system,) = anthropic_chat_messages(body(system=stamp))[:1]
    assert system["content"][0]["text"] == stamp.replace("cch=a5145;", "cch=fffff;")
    other = "cch=a5145; is not a header"
    assert anthropic_chat_messages(body(system=other))[0]["content"][0]["text"] == other


def test_tool_use_and_results_become_calls_and_tool_messages():
    req = body(
        messages=[
            {"role": "user", "content": "weather?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "need a tool", "signature": "sig"},
                    {"type": "redacted_thinking", "data": "opaque"},
                    {"type": "text", "text": "Let me check."},
                    {"type": "tool_use", "id": "t1", "name": "get", "input": {"city": "Paris"}},
                    {"type": "tool_use", "id": "t2", "name": "get", "input": {"city": "Oslo"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Here:"},
                    {"type": "tool_result", "tool_use_id": "t1", "content": "sunny"},
                    {
                        "type": "tool_result",
                        "tool_use_id": "t2",
                        "is_error": True,
                        "content": [{"type": "text", "text": "down"}],
                    },
                ],
            },
        ]
    )
    msgs = anthropic_chat_messages(req)
    assert msgs[1] == {
        "role": "assistant",
        "content": [{"type": "text", "text": "Let me check."}],
        "tool_calls": [
            {
                "id": "t1",
                "type": "function",
                "function": {"name": "get", "arguments": '{"city": "Paris"}'},
            },
            {
                "id": "t2",
                "type": "function",
                "function": {"name": "get", "arguments": '{"city": "Oslo"}'},
            },
        ],
        "reasoning_content": "need a tool",
    }
    # results first (they answer the calls), the user's text after them
    assert msgs[2:] == [
        {"role": "tool", "tool_call_id": "t1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "t2", "content": "Error: down"},
        {"role": "user", "content": [{"type": "text", "text": "Here:"}]},
    ]
    ChatRequest.model_validate(to_chat_body(req))  # the chat path takes it


@pytest.mark.parametrize(
    "messages, named",
    [
        ([{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t9"}]}], "'t9'"),
        (
            [
                {
                    "role": "assistant",
                    "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}],
                },
                {"role": "user", "content": "no result"},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1"}]},
            ],
            "'t1'",
        ),
        ([{"role": "user", "content": [{"type": "image", "source": {}}]}], "an image source"),
        (
            [
                {
                    "role": "user",
                    "content": [{"type": "document", "source": {"type": "base64", "data": "x"}}],
                }
            ],
            "plain-text source",
        ),
        (
            [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f"}]}],
            "assistant",
        ),
        ([{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t"}]}], "user"),
    ],
)
def test_history_that_cannot_be_mapped(messages, named):
    with pytest.raises(AnthropicInputError, match=named):
        anthropic_chat_messages(body(messages=messages))


def test_text_document_is_text():
    doc = {
        "type": "document",
        "title": "T",
        "source": {"type": "text", "media_type": "text/plain", "data": "D"},
    }
    assert anthropic_chat_messages(body(messages=[{"role": "user", "content": [doc]}])) == [
        {"role": "user", "content": [{"type": "text", "text": "T\n\nD"}]}
    ]


@pytest.mark.parametrize(
    "raw, named",
    [
        ({"messages": []}, "max_tokens"),
        ({"max_tokens": 0, "messages": []}, "max_tokens"),
        (
            {"max_tokens": 1, "messages": [{"role": "user", "content": [{"type": "audio"}]}]},
            "'audio'",
        ),
        ({"max_tokens": 1, "messages": [{"role": "tool", "content": "x"}]}, "role"),
        ({"max_tokens": 1, "messages": [], "mcp_servers": []}, "MCP"),
        ({"max_tokens": 1, "messages": [], "stop_sequences": ["x"] * 17}, "stop sequences"),
        ({"max_tokens": 1, "messages": [], "thinking": {"type": "sometimes"}}, "thinking"),
    ],
)
def test_invalid_bodies(raw, named):
    with pytest.raises(ValidationError, match=named):
        MessagesRequest.model_validate(raw)


def test_count_tokens_needs_no_max_tokens():
    CountTokensRequest.model_validate({"messages": [{"role": "user", "content": "x"}]})


def test_fields_map_onto_chat():
    req = body(
        max_tokens=100,
        stop_sequences=["END"],
        stop="STOP",
        temperature=0.3,
        top_k=5,
        seed=7,
        metadata={"user_id": "u"},
        tools=[{"name": "f", "description": "d", "input_schema": {"type": "object"}}],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        thinking={"type": "enabled", "budget_tokens": 50},
        output_config={"effort": "low"},
        messages=[{"role": "user", "content": "x"}],
    )
    chat = to_chat_body(req)
    assert chat["max_tokens"] == 100 and chat["stop"] == ["END", "STOP"]
    assert (chat["temperature"], chat["top_k"], chat["seed"]) == (0.3, 5, 7)
    assert chat["tools"] == [
        {
            "type": "function",
            "function": {"name": "f", "parameters": {"type": "object"}, "description": "d"},
        }
    ]
    assert chat["tool_choice"] == "required" and chat["parallel_tool_calls"] is False
    assert chat["chat_template_kwargs"] == {"enable_thinking": True}
    assert chat["reasoning_format"] == "deepseek" and chat["reasoning_effort"] == "low"
    named = to_chat_body(
        body(tools=[{"name": "f", "input_schema": {}}], tool_choice={"type": "tool", "name": "f"})
    )
    assert named["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert named["parallel_tool_calls"] is True
    off = to_chat_body(body(thinking={"type": "disabled"}))
    assert (
        off["chat_template_kwargs"] == {"enable_thinking": False} and "reasoning_format" not in off
    )
    fmt = to_chat_body(
        body(output_config={"format": {"type": "json_schema", "schema": {"type": "object"}}})
    )
    assert fmt["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "output", "schema": {"type": "object"}},
    }


@pytest.mark.parametrize(
    "kw, named",
    [
        ({"tools": [{"type": "bash_20250124", "name": "bash"}]}, "bash_20250124"),
        ({"tools": [{"name": "f"}]}, "input_schema"),
        ({"tools": [{"name": "f", "input_schema": {}, "strict": True}]}, "strict"),
        ({"tool_choice": {"type": "tool"}}, "tool_choice.name"),
        ({"thinking": {"type": "enabled"}}, "budget_tokens: required"),
        ({"thinking": {"type": "enabled", "budget_tokens": 8}}, "less than max_tokens"),
    ],
)
def test_fields_that_cannot_be_mapped(kw, named):
    with pytest.raises(AnthropicInputError, match=named):
        to_chat_body(body(**kw))


def result(
    finish=FinishReason.STOP, stop_word="", n_prompt=100, cache_n=60, predicted_n=7
) -> TaskResult:
    t = Timings(cache_n=cache_n, prompt_n=n_prompt - cache_n, predicted_n=predicted_n)
    return TaskResult(0, finish, "", [], n_prompt, t, stop_word=stop_word)


def test_stop_reasons_and_usage():
    assert stop_reason(result(), False) == ("end_turn", None)
    assert stop_reason(result(stop_word="END"), False) == ("stop_sequence", "END")
    assert stop_reason(result(), True) == ("tool_use", None)
    assert stop_reason(result(FinishReason.LENGTH), True) == ("max_tokens", None)
    assert usage(result()) == {
        "input_tokens": 40,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 60,
        "output_tokens": 7,
    }


def test_content_blocks():
    m = Message(
        content="Hi",
        reasoning="think",
        tool_calls=[ToolCall("c1", "f", '{"a": 1}'), ToolCall("c2", "g", '{"a":')],
    )
    assert content_blocks(m) == [
        {"type": "thinking", "thinking": "think", "signature": ""},
        {"type": "text", "text": "Hi"},
        {"type": "tool_use", "id": "c1", "name": "f", "input": {"a": 1}},
        {"type": "tool_use", "id": "c2", "name": "g", "input": {}},  # cut short
    ]
    assert content_blocks(m, omit_thinking=True)[0]["thinking"] == ""
    assert tool_input("[1]") == {}


def test_error_shapes_by_path():
    assert anthropic_path("/v1/messages") and anthropic_path("/v1/messages/count_tokens")
    assert anthropic_path("/messages/batches") and not anthropic_path("/v1/messagesx")
    assert error_body_for("/v1/messages", 503, "busy") == anthropic_error_body(503, "busy")
    assert anthropic_error_body(503, "busy") == {
        "type": "error",
        "error": {"type": "overloaded_error", "message": "busy"},
    }
    assert anthropic_error_body(500, "x")["error"]["type"] == "api_error"
    assert anthropic_error_body(422, "x")["error"]["type"] == "invalid_request_error"
    assert error_body_for("/v1/chat/completions", 400, "bad")["error"]["code"] == 400


def test_request_format_aliases():
    assert request_format("/v1/chat/completions") == "chatCompletions"
    assert request_format("/apply-template") == "applyTemplate"
    assert request_format("/v1/messages/count_tokens") == "messagesCountTokens"
    assert request_format("/completion") == "completion"
