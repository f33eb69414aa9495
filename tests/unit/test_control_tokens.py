"""Control tokens as the chat families meet them (server/templates/control_tokens.py): a literal
cut at control texts (longest first), the markers a template holds, a forced call's grammar
naming them by id, and a plan rendering them only where its parser reads them."""

from __future__ import annotations

from server.templates.chat_plan import plan_chat
from server.templates.chat_template import ChatTemplate
from server.templates.control_tokens import NO_CONTROL, ControlTokens
from server.templates.frames import derive, grammar
from server.templates.tool_fields import Tool
from tests.llama_sdist import vendored

TEMPLATES = vendored("models/templates/README.md").parent
HARMONY = ControlTokens.of(
    [("<|start|>", 3), ("<|channel|>", 4), ("<|message|>", 5), ("<|end|>", 6), ("<|call|>", 7)]
)


def test_split_cuts_at_control_texts_longest_first() -> None:
    c = ControlTokens.of([("<|a|>", 1), ("<|a|><|b|>", 2), ("<|b|>", 3), ("", 9)])
    assert c.split("x<|a|><|b|>y<|b|><|a|>") == ["x", 2, "y", 3, 1]
    assert c.split("") == []
    assert c.split("plain <| text") == ["plain <| text"]
    assert NO_CONTROL.split("<|a|>") == ["<|a|>"]


def test_first_id_of_a_text_wins() -> None:
    assert ControlTokens.of([("<x>", 5), ("<x>", 6)]).ids == {"<x>": 5}


def test_preserved_are_the_markers_the_template_holds() -> None:
    src = (TEMPLATES / "openai-gpt-oss-120b.jinja").read_text()
    other = ControlTokens.of([*HARMONY.ids.items(), ("<|not_in_it|>", 99)])
    assert other.preserved(src) == {3, 4, 5, 6, 7}


def _tool() -> Tool:
    schema = {"type": "object", "properties": {"city": {"type": "string"}}}
    return Tool("get_w", "", schema)


def test_a_frames_markers_are_named_by_id_in_its_grammar() -> None:
    src = (TEMPLATES / "openai-gpt-oss-120b.jinja").read_text()
    tpl = ChatTemplate(src, "<|startoftext|>", "<|return|>", name="gpt-oss")
    frame = derive(tpl, {})
    assert frame is not None
    plain = grammar(frame, [_tool()])
    named = grammar(frame, [_tool()], HARMONY)
    assert '"<|channel|>' in plain and "<[4]>" not in plain
    assert "<[4]>" in named and "<[5]>" in named and "<[7]>" in named
    assert "<|channel|>" not in named and "<|call|>" not in named


def test_a_plan_preserves_markers_only_where_its_parser_reads_them() -> None:
    src = (TEMPLATES / "Qwen-Qwen3-0.6B.jinja").read_text()
    tpl = ChatTemplate(src, "", "<|im_end|>", name="qwen3")
    control = ControlTokens.of([("<tool_call>", 10), ("</tool_call>", 11), ("<|x|>", 12)])
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    with_tools = plan_chat(tpl, tools=tools, control=control)
    assert with_tools.preserved == {10, 11}
    plain = plan_chat(tpl, reasoning_format="none", control=control)
    assert plain.preserved == frozenset()
