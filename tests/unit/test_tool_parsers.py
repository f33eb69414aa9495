"""Tool-call and reasoning parsers on recorded model outputs (shapes as the models write
them, the cases of llama.cpp's tests/test-chat.cpp), fed whole and in fragments split at
every point: every split must give exactly the whole-text message."""

from __future__ import annotations

import itertools
import json
import random

import pytest

from server.templates.output_parse import Message, OutputParser, ToolCall, ToolFormat, parse_message

H, L3, MI, G = ToolFormat.HERMES, ToolFormat.LLAMA3, ToolFormat.MISTRAL, ToolFormat.GENERIC


def _ids():
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def _parser(fmt, reasoning=False, forced_open=False) -> OutputParser:
    return OutputParser(fmt, reasoning=reasoning, forced_open=forced_open, new_id=_ids())


def _streamed(text: str, pieces: list[int], **kw) -> Message:
    p = _parser(**kw)
    m = Message()
    prev = 0
    for cut in [*pieces, len(text)]:
        m.add(p.feed(text[prev:cut]))
        prev = cut
    m.add(p.finish())
    return m


def _check_splits(text: str, expected: Message, **kw) -> None:
    """Whole, every 2-split, one character at a time, and random 3- to 6-splits agree."""
    whole = parse_message(text, _parser(**kw))
    assert whole == expected
    for i in range(len(text) + 1):
        assert _streamed(text, [i], **kw) == expected, f"split at {i}: {text[:i]!r}|{text[i:]!r}"
    assert _streamed(text, list(range(1, len(text))), **kw) == expected
    rng = random.Random(0)
    for _ in range(50):
        k = rng.randint(2, 5)
        cuts = sorted(rng.sample(range(len(text) + 1), min(k, len(text) + 1)))
        assert _streamed(text, cuts, **kw) == expected, cuts


def call(i: int, name: str, args: str) -> ToolCall:
    return ToolCall(f"call_{i}", name, args)


CASES = [
    # --- Hermes / Qwen 2.5 ------------------------------------------------------------
    (
        H,
        '<tool_call>\n{"name": "get_weather", "arguments": {"location": "Paris"}}\n</tool_call>',
        Message(tool_calls=[call(0, "get_weather", '{"location": "Paris"}')]),
    ),
    (
        H,
        "Let me check.\n<tool_call>\n"
        '{"name": "python", "arguments": {"code": "print(\\"}</tool_call>\\")"}}\n</tool_call>',
        Message(
            content="Let me check.",
            tool_calls=[call(0, "python", '{"code": "print(\\"}</tool_call>\\")"}')],
        ),
    ),
    (
        H,
        '<tool_call>\n{"name": "special_function", "arguments": {"arg1": 1}}\n</tool_call>\n'
        '<tool_call>\n{"arguments": {"arg1": 1, "arg2": 2}, "name": "special_function_with_opt"}'
        "\n</tool_call>",
        Message(
            tool_calls=[
                call(0, "special_function", '{"arg1": 1}'),
                call(1, "special_function_with_opt", '{"arg1": 1, "arg2": 2}'),
            ]
        ),
    ),
    (
        H,
        '<tool_call>\n{"name": "f", "arguments": "{\\"a\\": [1, 2]}"}\n</tool_call>',
        Message(tool_calls=[call(0, "f", '{"a": [1, 2]}')]),
    ),
    (H, "Hello, world!\nWhat's up?", Message(content="Hello, world!\nWhat's up?")),
    # the closing tag cut off by the end of the output
    (
        H,
        '<tool_call>\n{"name": "f", "arguments": {"a": [1, "x"]}}\n</tool_',
        Message(tool_calls=[call(0, "f", '{"a": [1, "x"]}')]),
    ),
    # text after the call is content; whitespace around the call is not
    (
        H,
        'Checking.\n<tool_call>{"name": "f", "arguments": {}}</tool_call>\n\nDone. ',
        Message(content="Checking.Done. ", tool_calls=[call(0, "f", "{}")]),
    ),
    (H, "a < b and <tool> x", Message(content="a < b and <tool> x")),
    # not a call object: the block stays content
    (H, "<tool_call>oops</tool_call>", Message(content="<tool_call>oops</tool_call>")),
    # cut off by max_tokens inside the arguments: the call as far as it went
    (
        H,
        '<tool_call>\n{"name": "f", "arguments": {"x": "abc',
        Message(tool_calls=[call(0, "f", '{"x": "abc')]),
    ),
    # --- Llama 3.x --------------------------------------------------------------------
    (
        L3,
        '{"name": "special_function", "parameters": {"arg1": 1}}',
        Message(tool_calls=[call(0, "special_function", '{"arg1": 1}')]),
    ),
    (
        L3,
        '<|python_tag|>{"type": "function", "name": "python", "parameters": {"code": "1+1"}}',
        Message(tool_calls=[call(0, "python", '{"code": "1+1"}')]),
    ),
    (
        L3,
        '{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"k": [1, {"z": null}]}}',
        Message(tool_calls=[call(0, "a", "{}"), call(1, "b", '{"k": [1, {"z": null}]}')]),
    ),
    (L3, "The sum of 102 and 7 is 109.", Message(content="The sum of 102 and 7 is 109.")),
    (L3, '{"answer": 42} is JSON', Message(content='{"answer": 42} is JSON')),
    # --- Mistral ------------------------------------------------------------------------
    (
        MI,
        '[TOOL_CALLS][{"name": "special_function", "arguments": {"arg1": 1}, "id": "123456789"}]',
        Message(tool_calls=[call(0, "special_function", '{"arg1": 1}')]),
    ),
    (
        MI,  # the control token is not rendered in the text
        '[{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {"y": "]"}}]',
        Message(tool_calls=[call(0, "a", '{"x": 1}'), call(1, "b", '{"y": "]"}')]),
    ),
    (
        MI,
        'Sure.[TOOL_CALLS]get_weather[ARGS]{"location": "Paris"}',
        Message(content="Sure.", tool_calls=[call(0, "get_weather", '{"location": "Paris"}')]),
    ),
    (
        MI,
        '[TOOL_CALLS]a[ARGS]{"x": 1}[TOOL_CALLS]b[ARGS]{"y": 2}',
        Message(tool_calls=[call(0, "a", '{"x": 1}'), call(1, "b", '{"y": 2}')]),
    ),
    (MI, "[1] see the footnote", Message(content="[1] see the footnote")),
    # --- generic ----------------------------------------------------------------------
    (
        G,
        '{"tool_calls": [{"name": "get_weather", "arguments": {"location": "Istanbul"}}]}',
        Message(tool_calls=[call(0, "get_weather", '{"location": "Istanbul"}')]),
    ),
    (
        G,
        ' {"tool_calls":[{"name":"a","arguments":{"q":"x, y"}},{"name":"b","arguments":{}}]} ',
        Message(tool_calls=[call(0, "a", '{"q":"x, y"}'), call(1, "b", "{}")]),
    ),
    (G, '{"answer": "no tools"}', Message(content='{"answer": "no tools"}')),
    (G, "Hi! How can I help?", Message(content="Hi! How can I help?")),
]


@pytest.mark.parametrize("fmt,text,expected", CASES)
def test_tool_formats_every_split(fmt: ToolFormat, text: str, expected: Message) -> None:
    _check_splits(text, expected, fmt=fmt)


def test_arguments_are_json_where_complete() -> None:
    for _fmt, text, expected in CASES:
        for c in expected.tool_calls:
            if text.rstrip().endswith(("}", "]", "</tool_call>")):
                json.loads(c.arguments)


REASONING = [
    (
        "<think>\nI'm\nthinking\n</think>\n\nHello, world!\nWhat's up?",
        False,
        Message(content="Hello, world!\nWhat's up?", reasoning="I'm\nthinking"),
    ),
    # the template opened <think> itself (thinking forced open)
    (
        "I'm\nthinking\n</think>\n\nHello",
        True,
        Message(content="Hello", reasoning="I'm\nthinking"),
    ),
    (
        "No thoughts, <think>inline</think>",
        False,
        Message(content="No thoughts, <think>inline</think>"),
    ),
    # cut off while thinking (also right inside the closing tag)
    ("<think>still going", False, Message(reasoning="still going")),
    ("<think>still going </thi", False, Message(reasoning="still going </thi")),
    ("<think> a <b> </think", False, Message(reasoning="a <b> </think")),
]


@pytest.mark.parametrize("text,forced,expected", REASONING)
def test_reasoning_every_split(text: str, forced: bool, expected: Message) -> None:
    _check_splits(text, expected, fmt=None, reasoning=True, forced_open=forced)


def test_reasoning_then_tool_call() -> None:
    text = (
        "<think>\nThe user wants the weather.\n</think>\n\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"location": "Paris"}}\n</tool_call>'
    )
    expected = Message(
        reasoning="The user wants the weather.",
        tool_calls=[call(0, "get_weather", '{"location": "Paris"}')],
    )
    _check_splits(text, expected, fmt=H, reasoning=True)


def test_reasoning_off_keeps_the_tags() -> None:
    text = "<think>x</think>y"
    assert parse_message(text, _parser(None)) == Message(content=text)


def test_stream_order_header_first() -> None:
    """The first delta of a call carries index, id and name; later ones only arguments."""
    p = _parser(H)
    text = '<tool_call>\n{"name": "f", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    deltas = [c for ch in text for c in p.feed(ch).calls] + p.finish().calls
    assert deltas[0].id == "call_0" and deltas[0].name == "f" and deltas[0].arguments == ""
    assert all(d.id is None and d.name is None for d in deltas[1:])
    assert "".join(d.arguments for d in deltas) == '{"a": 1, "b": 2}'
    assert len(deltas) > 3  # the arguments really streamed
