"""JSON text nesting deeper than this server reads (issue 56, item 7): ``loads_bounded``
(server.schemas.json_body) refuses it as a ValueError, never a RecursionError; a history call's
arguments that deep are a client's error (400, tests/e2e/test_deep_json_e2e.py), and calls a
model writes that deep are kept as text: the gpt-oss (Harmony) and region parsers give the
text as content, Anthropic's ``input`` is ``{}`` as for any arguments that are not JSON."""

from __future__ import annotations

import json

import pytest

from server.protocols.anthropic_mapping import content_blocks, tool_input
from server.schemas.json_body import MAX_DEPTH, TooDeep, loads_bounded
from server.templates.chat_template import BUILTIN_TEMPLATES, ChatTemplate, TemplateError
from server.templates.families import BY_NAME
from server.templates.harmony import HarmonyParser
from server.templates.output_parse import Message, OutputParser, ToolFormat, parse_message
from server.templates.regions import RegionParser
from server.templates.tool_fields import tool_spec
from server.templates.tools_prompt import prepare
from tests.llama_sdist import vendored

DEPTHS = [MAX_DEPTH + 1, 1000, 5000]


def nested(depth: int) -> str:
    """A JSON object ``depth`` levels deep: ``{"a": [[...]]}``."""
    return '{"a":' + "[" * (depth - 1) + "]" * (depth - 1) + "}"


def test_loads_bounded_reads_up_to_the_bound_and_refuses_deeper():
    assert json.loads(nested(MAX_DEPTH)) == loads_bounded(nested(MAX_DEPTH))
    for depth in DEPTHS:
        with pytest.raises(TooDeep, match=f"deeper than {MAX_DEPTH} levels"):
            loads_bounded(nested(depth))
    assert loads_bounded("[[1]]", max_depth=2) == [[1]]
    with pytest.raises(TooDeep):
        loads_bounded("[[1]]", max_depth=1)
    with pytest.raises(json.JSONDecodeError):  # not JSON: a ValueError of its own kind
        loads_bounded("{")
    assert issubclass(TooDeep, ValueError)


def _parse(p: object, text: str) -> Message:
    m = Message()
    m.add(p.feed(text))  # type: ignore[attr-defined]
    m.add(p.finish())  # type: ignore[attr-defined]
    return m


@pytest.mark.parametrize("depth", DEPTHS)
def test_gpt_oss_call_nesting_too_deep_is_content(depth: int):
    args = nested(depth)
    text = (
        "<|start|>assistant<|channel|>commentary to=functions.f <|constrain|>json<|message|>"
        + args
        + "<|call|>"
    )
    m = _parse(HarmonyParser(), text)
    assert m.tool_calls == [] and m.content == args


# deeper than the decoder's recursion (about 1,000 levels), the region parser's RecursionError
# catch made such calls content already; between the bound and that, they were calls
@pytest.mark.parametrize("depth", [MAX_DEPTH + 1, 900])
@pytest.mark.parametrize(
    "fam,text",
    [
        # arguments read with json.loads, and by raw_decode
        ("kimi-k2", "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0"
         "<|tool_call_argument_begin|>{A}<|tool_call_end|><|tool_calls_section_end|>"),
        ("nemotron-v2", '<TOOLCALL>[{"name": "f", "arguments": {A}}]</TOOLCALL>'),
    ],
)  # fmt: skip
def test_a_family_call_nesting_too_deep_is_content(fam: str, text: str, depth: int):
    text = text.replace("{A}", nested(depth))
    m = _parse(RegionParser(BY_NAME[fam]), text)
    assert m.tool_calls == [] and m.content == text


@pytest.mark.parametrize("depth", DEPTHS)
def test_a_parameter_nesting_too_deep_is_a_string(depth: int):
    """A parameter's value is JSON where it reads as JSON, else its text (Qwen3-Coder)."""
    value = nested(depth)
    text = f"<tool_call>\n<function=f>\n<parameter=x>\n{value}\n</parameter>\n</function>\n</tool_call>"
    m = _parse(RegionParser(BY_NAME["qwen3-coder"]), text)
    assert [(c.name, json.loads(c.arguments)) for c in m.tool_calls] == [("f", {"x": value})]


@pytest.mark.parametrize("depth", DEPTHS)
def test_anthropic_input_of_a_call_nesting_too_deep_is_empty(depth: int):
    """The generic JSON format streams a call's arguments as the model writes them; an
    Anthropic answer (not streamed) reads them back into ``input``."""
    args = nested(depth)
    text = json.dumps({"tool_calls": [{"name": "f", "arguments": "X"}]}).replace('"X"', args)
    m = parse_message(text, OutputParser(ToolFormat.GENERIC))
    assert [(c.name, c.arguments) for c in m.tool_calls] == [("f", args)]
    assert tool_input(args) == {}
    blocks = content_blocks(m)
    assert [(b["type"], b.get("input")) for b in blocks] == [("tool_use", {})]
    assert tool_input(nested(MAX_DEPTH)) == json.loads(nested(MAX_DEPTH))


@pytest.mark.parametrize("depth", [1000, 5000])
@pytest.mark.parametrize("native", [False, True])
def test_a_history_call_nesting_too_deep_is_a_clients_error(native: bool, depth: int):
    """The history's calls, rewritten into the messages (a template without tools) or
    handed to a template that renders them (Qwen 2.5's): a client's TemplateError (400)."""
    if native:
        src = vendored("models/templates/Qwen-Qwen2.5-7B-Instruct.jinja").read_text()
        tpl = ChatTemplate(src, "<s>", "</s>", name="qwen")
    else:
        tpl = ChatTemplate(BUILTIN_TEMPLATES["chatml"], "<s>", "</s>", name="chatml")
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": nested(depth)}}
    history = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "{}"},
    ]
    with pytest.raises(TemplateError, match=f"deeper than {MAX_DEPTH} levels") as e:
        prepare(tpl, history, tool_spec(None, None, None))  # type: ignore[arg-type]
    assert e.value.client
