"""The Responses API mapped onto chat (llama-server's conversion) and its output items."""

from __future__ import annotations

import asyncio
import json

import pytest

from server.protocols.responses import _ResponseStream
from server.protocols.responses_mapping import ResponsesInputError, output_items, to_chat_body
from server.schemas.bodies import ChatRequest
from server.task import FinishReason, PromptProgress, TaskResult, TextChunk, Timings
from server.templates.chat_plan import plan_chat
from server.templates.chat_template import BUILTIN_TEMPLATES, ChatTemplate
from server.templates.output_parse import Message, ToolCall


def test_text_input_with_instructions() -> None:
    chat = to_chat_body(
        {"input": "hi", "instructions": "be brief", "max_output_tokens": 8, "temperature": 0.5}
    )
    assert chat["messages"] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
    ]
    assert chat["max_tokens"] == 8 and "max_output_tokens" not in chat
    assert chat["temperature"] == 0.5
    ChatRequest.model_validate(chat)  # what the route does next


def test_message_items_and_assistant_merging() -> None:
    chat = to_chat_body(
        {
            "input": [
                {"role": "system", "content": "Book"},
                {"role": "user", "content": [{"type": "input_text", "text": "best book?"}]},
                {
                    "type": "message",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": "Dune"}],
                },
                {
                    "type": "function_call",
                    "call_id": "call_1",
                    "name": "lookup",
                    "arguments": '{"q": "Dune"}',
                },
                {"type": "function_call_output", "call_id": "call_1", "output": "a novel"},
            ]
        }
    )
    system, user, assistant, tool = chat["messages"]
    assert system == {"role": "system", "content": [{"type": "text", "text": "Book"}]}
    assert user["content"] == [{"type": "text", "text": "best book?"}]
    # the call merges into the assistant message before it
    assert assistant["content"] == [{"type": "text", "text": "Dune"}]
    assert assistant["tool_calls"] == [
        {
            "id": "call_1",
            "type": "function",
            "function": {"name": "lookup", "arguments": '{"q": "Dune"}'},
        }
    ]
    assert tool == {"role": "tool", "content": "a novel", "tool_call_id": "call_1"}
    ChatRequest.model_validate(chat)


def test_function_tools_map_and_others_are_skipped() -> None:
    chat = to_chat_body(
        {
            "input": "x",
            "tools": [
                {"type": "function", "name": "f", "parameters": {"type": "object"}},
                {"type": "web_search"},
            ],
            "tool_choice": {"type": "function", "name": "f"},
        }
    )
    assert chat["tools"] == [
        {
            "type": "function",
            "function": {"name": "f", "parameters": {"type": "object"}, "strict": True},
        }
    ]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "f"}}


def test_reasoning_effort() -> None:
    assert to_chat_body({"input": "x", "reasoning": {"effort": "low"}})["reasoning_effort"] == "low"


@pytest.mark.parametrize(
    "body,message",
    [
        ({}, "'input' is required"),
        ({"input": 3}, "'input' must be a string or array of objects"),
        ({"input": [{"foo": 1}]}, "Cannot determine type of 'item'"),
        ({"input": [{"role": "user", "content": [{"type": "input_file"}]}]}, "input_file"),
        ({"input": "x", "tools": {}}, "'tools' must be an array of objects"),
        (
            {
                "input": [
                    {"role": "assistant", "content": "a", "tool_calls": "x"},
                    {"type": "function_call", "arguments": "{}", "call_id": "c", "name": "f"},
                ]
            },
            "'tool_calls' must be a list",
        ),
    ],
)
def test_llama_server_errors(body: dict, message: str) -> None:
    with pytest.raises(ResponsesInputError, match=message):
        to_chat_body(body)


def test_output_items_order_and_ids() -> None:
    m = Message(content="hello", reasoning="think", tool_calls=[ToolCall("call_abc", "f", "{}")])
    rs, msg, fc = output_items(m, "msg_1", "rs_1")
    assert rs["type"] == "reasoning" and rs["content"][0]["text"] == "think"
    assert msg["id"] == "msg_1" and msg["content"][0] == {
        "type": "output_text",
        "annotations": [],
        "logprobs": [],
        "text": "hello",
    }
    assert fc == {
        "id": "fc_abc",
        "type": "function_call",
        "status": "completed",
        "arguments": "{}",
        "call_id": "call_abc",
        "name": "f",
    }
    assert output_items(Message(), "m", "r") == []


# ---- the streamed events -----------------------------------------------------------------


class _Group:
    """Stands in for a TaskGroup: the events of one task, each delivered alone."""

    def __init__(self, events: list) -> None:
        self._events = events

    async def batches(self, coalesce: bool = False):  # noqa: ANN201
        for ev in self._events:
            yield [(0, ev)]


def _stream_events(plan, events: list) -> list[dict]:  # noqa: ANN001
    async def collect() -> str:
        return "".join([s async for s in _ResponseStream(plan, "m").run(_Group(events))])

    out = []
    for block in asyncio.run(collect()).split("\n\n"):
        if block:
            name, data = block.split("\n")
            out.append(json.loads(data.removeprefix("data: ")))
            assert name == "event: " + out[-1]["type"]
    return out


def _result(n_out: int):  # noqa: ANN202
    return TaskResult(0, FinishReason.STOP, "", [], 5, Timings(predicted_n=n_out, prompt_n=5))


def test_stream_of_reasoning_and_text_with_progress() -> None:
    plan = plan_chat(ChatTemplate(BUILTIN_TEMPLATES["chatml"]), reasoning_format="deepseek")
    chunks = ["<think>", "hmm", "</think>", "Hel", "lo"]
    events = _stream_events(
        plan,
        [
            PromptProgress(5, 0, 0, 0),
            PromptProgress(5, 0, 5, 3),
            *(TextChunk(c, [], []) for c in chunks),
            _result(5),
        ],
    )
    kinds = [e["type"] for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.in_progress"]
    assert [e["prompt_progress"]["processed"] for e in events[1:3]] == [0, 5]
    assert "prompt_progress" not in events[0]
    reasoning = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert (reasoning, text) == ("hmm", "Hello")
    added = [e["item"]["type"] for e in events if e["type"] == "response.output_item.added"]
    assert added == ["reasoning", "message"]
    assert kinds.count("response.content_part.added") == 1
    done = events[-1]
    assert done["type"] == "response.completed" and done["timings"]["predicted_n"] == 5
    output = done["response"]["output"]
    assert [o["type"] for o in output] == ["reasoning", "message"]
    assert output[1]["content"][0]["text"] == "Hello"
    assert done["response"]["usage"]["total_tokens"] == 10


def test_stream_of_a_tool_call() -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    plan = plan_chat(ChatTemplate(BUILTIN_TEMPLATES["chatml"]), tools=[tool])
    text = '{"tool_calls": [{"name": "f", "arguments": {"a": 1}}]}'
    pieces = [TextChunk(text[i : i + 7], [], []) for i in range(0, len(text), 7)]
    events = _stream_events(plan, [*pieces, _result(9)])
    assert _stream_events(plan, []) == []  # nothing before the engine's first event
    assert events[0]["type"] == "response.created"
    added = next(e for e in events if e["type"] == "response.output_item.added")
    assert added["item"]["type"] == "function_call" and added["item"]["name"] == "f"
    args = "".join(
        e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"
    )
    assert json.loads(args) == {"a": 1}
    assert all(
        e["item_id"] == added["item"]["id"]
        for e in events
        if e["type"] == "response.function_call_arguments.delta"
    )
    (call,) = events[-1]["response"]["output"]
    assert call["call_id"].startswith("call_") and call["id"] == added["item"]["id"]
    assert json.loads(call["arguments"]) == {"a": 1}
