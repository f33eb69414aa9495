"""Tools in the prompt: format detection on real model templates (from the pinned sdist's
``models/templates``), rendering of tools and tool history, request checks, the forced-call
schemas, and that each format's parser reads back what its prompt shows as a call."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from server.templates.chat_plan import ChatPlan, plan_chat
from server.templates.chat_template import BUILTIN_TEMPLATES, ChatTemplate, thinking_forced_open
from server.templates.output_parse import OutputParser, ToolCall, ToolFormat, parse_message
from server.templates.tool_fields import ToolSpecError, forced_call, tool_spec
from server.templates.tools_prompt import _call_text, prepare, template_tools
from tests.llama_sdist import vendored

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
CALC = {
    "type": "function",
    "function": {"name": "calc", "parameters": {"type": "object", "properties": {}}},
}
CALL = {
    "id": "abc123xyz",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}
TURN1 = [
    {"role": "system", "content": "You are helpful."},
    {"role": "user", "content": "Weather in Paris?"},
]
TURN2 = [
    *TURN1,
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "abc123xyz", "content": '{"temp_c": 21}'},
]


def real(name: str) -> ChatTemplate:
    src = vendored(f"models/templates/{name}.jinja").read_text()
    return ChatTemplate(src, "<s>", "</s>", name=name)


def builtin(name: str) -> ChatTemplate:
    return ChatTemplate(BUILTIN_TEMPLATES[name], "<bos>", "<eos>", name=name)


@pytest.mark.parametrize(
    "name,fmt,native",
    [
        ("Qwen-Qwen2.5-7B-Instruct", ToolFormat.HERMES, True),
        ("NousResearch-Hermes-3-Llama-3.1-8B-tool_use", ToolFormat.HERMES, True),
        ("Qwen-Qwen3-0.6B", ToolFormat.HERMES, True),
        ("Reka-Edge", ToolFormat.HERMES, True),  # uses {% break %} (jinja2 loopcontrols)
        ("meta-llama-Llama-3.2-3B-Instruct", ToolFormat.LLAMA3, True),
        ("meta-llama-Llama-3.3-70B-Instruct", ToolFormat.LLAMA3, True),
        ("mistralai-Mistral-Nemo-Instruct-2407", ToolFormat.MISTRAL, True),
        ("unsloth-mistral-Devstral-Small-2507", ToolFormat.MISTRAL, True),
        # other call syntaxes: their family (server.templates.families)
        ("Qwen3-Coder", ToolFormat.FAMILY, True),
        # no tool support: the generic form
        ("microsoft-Phi-3.5-mini-instruct", ToolFormat.GENERIC, False),
        ("google-gemma-2-2b-it", ToolFormat.GENERIC, False),
    ],
)
def test_format_of_real_templates(name: str, fmt: ToolFormat, native: bool) -> None:
    tt = template_tools(real(name))
    assert (tt.fmt, tt.native) == (fmt, native)


def test_format_of_builtins() -> None:
    got = {n: template_tools(builtin(n)) for n in BUILTIN_TEMPLATES}
    assert {n: (t.fmt, t.native) for n, t in got.items()} == {
        "chatml": (ToolFormat.HERMES, False),
        "gemma": (ToolFormat.GENERIC, False),
        "llama3": (ToolFormat.LLAMA3, False),
        "mistral": (ToolFormat.MISTRAL, False),
        "command-r": (ToolFormat.GENERIC, False),
    }


def _render(tpl: ChatTemplate, messages: list[dict], tools=(WEATHER,), **kw) -> str:  # noqa: ANN001
    spec = tool_spec(list(tools), kw.pop("tool_choice", None), None)
    p = prepare(tpl, messages, spec, kw)
    return tpl.render(p.messages, add_generation_prompt=True, **p.extra)


TEMPLATES = [
    ("Qwen-Qwen2.5-7B-Instruct", real),
    ("meta-llama-Llama-3.2-3B-Instruct", real),
    ("chatml", builtin),
    ("gemma", builtin),
    ("llama3", builtin),
    ("mistral", builtin),
]


@pytest.mark.parametrize("name,make", [*TEMPLATES, ("mistralai-Mistral-Nemo-Instruct-2407", real)])
def test_tools_and_history_rendered(name: str, make) -> None:  # noqa: ANN001
    """The tool list, the call and the tool result all reach the prompt."""
    text = _render(make(name), TURN2)
    assert "get_weather" in text and "Weather of a city" in text
    assert "Paris" in text and "temp_c" in text


@pytest.mark.parametrize("name,make", TEMPLATES)
def test_turn_one_is_a_prefix_of_turn_two(name: str, make) -> None:  # noqa: ANN001
    """The second request of an agent loop starts with the first one's prompt (system
    prompt and tools included), whatever tool_choice each turn asked for: a cache hit.
    (Mistral's own templates are the exception: they put the tools and the system prompt
    at the last user turn, so a new turn moves them.)"""
    tpl = make(name)
    one = _render(tpl, TURN1, tool_choice="required")
    two = _render(tpl, TURN2, tool_choice="auto")
    assert two.startswith(one)


def test_generic_history_alternates_on_gemma() -> None:
    text = _render(builtin("gemma"), TURN2)
    turns = text.split("<start_of_turn>")[1:]
    assert [t.split("\n", 1)[0] for t in turns] == ["user", "model", "user", "model"]
    assert turns[0].startswith("user\nYou are helpful.\n\nYou can call these tools")
    assert '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}' in turns[1]
    assert turns[2].startswith('user\nResult of tool get_weather:\n{"temp_c": 21}')


def test_native_history_gets_object_arguments() -> None:
    text = _render(real("Qwen-Qwen2.5-7B-Instruct"), TURN2)
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    )
    assert '<tool_response>\n{"temp_c": 21}\n</tool_response>' in text


# FAMILY templates render calls themselves (native): no rewritten history to read back
@pytest.mark.parametrize("fmt", [f for f in ToolFormat if f is not ToolFormat.FAMILY])
def test_parsers_read_back_the_prompt_form(fmt: ToolFormat) -> None:
    """What a rewritten history shows as a call is what the model of that format writes,
    and the parser of that format reads it back."""
    calls = [
        {**CALL, "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
        {"id": "x2", "type": "function", "function": {"name": "calc", "arguments": {}}},
    ]
    text = _call_text(fmt, calls)
    m = parse_message(text, OutputParser(fmt, new_id=lambda: "id"))
    assert m.content == ""
    assert [(c.name, json.loads(c.arguments)) for c in m.tool_calls] == [
        ("get_weather", {"city": "Paris"}),
        ("calc", {}),
    ]


def test_template_kwargs_reach_the_template() -> None:
    tpl = real("Qwen-Qwen3-0.6B")
    off = plan_chat(tpl, chat_template_kwargs={"enable_thinking": False})
    p = prepare(tpl, TURN1, off.spec, off.kwargs)
    text = tpl.render(p.messages, add_generation_prompt=True, **p.extra)
    assert text.endswith("<think>\n\n</think>\n\n") and not thinking_forced_open(text)
    # reasoning_effort "none" turns thinking off the same way
    assert plan_chat(tpl, reasoning_effort="none").kwargs == {"enable_thinking": False}
    assert plan_chat(tpl, reasoning_effort="high").kwargs == {"reasoning_effort": "high"}
    with pytest.raises(ToolSpecError, match="enable_thinking"):
        plan_chat(tpl, chat_template_kwargs={"enable_thinking": "false"})


def test_forced_open_thinking() -> None:
    """Thinking is on by default where the template has the switch (llama-server's
    --reasoning auto); this template then ends the prompt inside <think>."""
    tpl = real("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B")
    p = prepare(tpl, TURN1, tool_spec(None, None, None))
    assert p.extra == {"enable_thinking": True}
    assert thinking_forced_open(tpl.render(p.messages, add_generation_prompt=True, **p.extra))
    plan = plan_chat(tpl, reasoning_format="deepseek")
    plan.forced_open = True
    m = parse_message("Okay, so.\n</think>\n\nHi!", plan.parser())
    assert (m.reasoning, m.content) == ("Okay, so.", "Hi!")


def test_a_template_that_takes_arguments_as_text_gets_the_clients_string() -> None:
    """Functionary v3.2 writes ``'>>>' + name + '\\n' + arguments``: a history call's
    arguments stay the client's JSON string (as llama-server passes them to templates that
    do not take objects), where an object made the next turn a 500 (found by
    bench/families.py)."""
    tpl = real("meetkai-functionary-medium-v3.2")
    assert template_tools(tpl).string_arguments
    assert not template_tools(real("Qwen-Qwen3-0.6B")).string_arguments
    args = '{"city": "Paris"}'
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": args}}
    history = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "{}"},
    ]
    p = prepare(tpl, history, tool_spec(None, None, None))
    text = tpl.render(p.messages, add_generation_prompt=True, **p.extra)
    assert ">>>f\n" + args + "<|eot_id|>" in text


def test_forced_open_thinking_with_the_templates_own_tag() -> None:
    """Command R7B's MoE template opens ``<|START_THINKING|>`` at the end of the prompt:
    the output starts in the reasoning, split off at ``<|END_THINKING|>`` (found by
    bench/families.py: the reasoning came back as content)."""
    tpl = real("Cohere2MoE")
    p = prepare(tpl, TURN1, tool_spec(None, None, None), {"enable_thinking": True})
    text = tpl.render(p.messages, add_generation_prompt=True, **p.extra)
    plan = plan_chat(tpl, reasoning_format="deepseek")
    assert plan.tags == ("<|START_THINKING|>", "<|END_THINKING|>")
    assert thinking_forced_open(text, plan.tags[0]) and not thinking_forced_open(text)
    plan.forced_open = True
    m = parse_message("Seven.<|END_THINKING|>It is 7.", plan.parser())
    assert (m.reasoning, m.content) == ("Seven.", "It is 7.")


@pytest.mark.parametrize(
    "tools,choice,parallel,needle",
    [
        ("nope", None, None, "tools must be an array"),
        ([{"type": "function"}], None, None, "tools[0].function"),
        ([{"type": "code_interpreter"}], None, None, "tools[0].type"),
        ([{"type": "function", "function": {"name": "bad name"}}], None, None, "name"),
        ([WEATHER, WEATHER], None, None, "duplicate"),
        ([{"type": "function", "function": {"name": "f", "parameters": 3}}], None, None, "param"),
        ([WEATHER], "always", None, "tool_choice"),
        ([WEATHER], {"type": "function", "function": {"name": "calc"}}, None, "'calc'"),
        ([WEATHER], {"type": "function"}, None, "tool_choice"),
        ([], "required", None, "needs tools"),
        ([WEATHER], None, "yes", "parallel_tool_calls"),
    ],
)
def test_malformed_tool_fields(tools, choice, parallel, needle: str) -> None:  # noqa: ANN001
    with pytest.raises(ToolSpecError, match=None) as e:
        tool_spec(tools, choice, parallel)
    assert needle in str(e.value)


def test_choice_semantics() -> None:
    assert not tool_spec([WEATHER], "none", None).parse_calls
    assert tool_spec([WEATHER], None, None).parse_calls
    assert not tool_spec([WEATHER], "auto", None).forced
    named = tool_spec([WEATHER, CALC], {"type": "function", "function": {"name": "calc"}}, None)
    assert named.forced and named.forced_name == "calc"
    assert not tool_spec(None, None, None).parse_calls


@pytest.mark.parametrize("fmt", list(ToolFormat))
def test_forced_schemas(fmt: ToolFormat) -> None:
    """The forced shape accepts a valid call of the right tool and refuses the others."""
    named = tool_spec(
        [WEATHER, CALC], {"type": "function", "function": {"name": "get_weather"}}, None
    )
    c = forced_call(named, fmt)
    key = "parameters" if fmt is ToolFormat.LLAMA3 else "arguments"
    good = {"name": "get_weather", key: {"city": "Paris"}}
    bad = [{"name": "calc", key: {}}, {"name": "get_weather", key: {}}]
    wrap = {
        ToolFormat.GENERIC: lambda x: {"tool_calls": [x]},
        ToolFormat.MISTRAL: lambda x: [x],
    }.get(fmt, lambda x: x)
    jsonschema.validate(wrap(good), c.schema)
    for b in bad:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrap(b), c.schema)
    if fmt in (ToolFormat.GENERIC, ToolFormat.MISTRAL):  # one call unless parallel
        two = {"tool_calls": [good, good]} if fmt is ToolFormat.GENERIC else [good, good]
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(two, c.schema)
        par = forced_call(tool_spec([WEATHER], "required", True), fmt)
        jsonschema.validate(two, par.schema)
    if fmt is ToolFormat.HERMES:
        assert (c.prefix, c.suffix) == ("<tool_call>\n", "\n</tool_call>")


def test_forced_constraint_compiles() -> None:
    tpl = builtin("gemma")
    plan = plan_chat(tpl, tools=[WEATHER, CALC], tool_choice="required")
    assert isinstance(plan, ChatPlan) and plan.constraint() is not None
    assert plan_chat(tpl, tools=[WEATHER]).constraint() is None
    broken = {
        "type": "function",
        "function": {
            "name": "f",
            "parameters": {"type": "object", "properties": {"x": {"$ref": "#/nowhere"}}},
        },
    }
    with pytest.raises(ToolSpecError, match="parameters"):
        plan_chat(tpl, tools=[broken], tool_choice="required").constraint()


def test_tool_call_shape() -> None:
    assert ToolCall("call_1", "f", "{}").as_openai() == {
        "id": "call_1",
        "type": "function",
        "function": {"name": "f", "arguments": "{}"},
    }


def test_mistral_ids() -> None:
    """Mistral's templates insist on 9-alphanumeric call ids: answers get such ids, and
    other ids in the history are mapped alike for the call and its result."""
    tpl = real("mistralai-Mistral-Nemo-Instruct-2407")
    plan = plan_chat(tpl, tools=[WEATHER])
    m = parse_message('[{"name": "get_weather", "arguments": {}}]', plan.parser())
    (c,) = m.tool_calls
    assert len(c.id) == 9 and c.id.isalnum()
    long_id = {**CALL, "id": "call_0123456789abcdefghijklmn"}
    turn = [
        *TURN1,
        {"role": "assistant", "content": None, "tool_calls": [long_id]},
        {"role": "tool", "tool_call_id": long_id["id"], "content": "21"},
    ]
    text = _render(tpl, turn)  # the template raises on ids of another length
    (mapped,) = set(re.findall(r'"call_id": "(\w+)"', text))
    assert f'"id": "{mapped}"' in text and len(mapped) == 9
