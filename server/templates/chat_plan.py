"""One chat request's handling of tools and reasoning (``ChatPlan``), and the OpenAI shapes
of its parsed output: ``message`` for a whole answer, ``delta`` chunks for a stream."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from ..constrained import Constraint, ConstraintError, json_schema_constraint, lark_constraint
from ..json_value import JsonObject, JsonValue
from .chat_template import ChatTemplate
from .control_tokens import NO_CONTROL, ControlTokens
from .families import BY_NAME, reasoning_tags
from .frames import Frame, derive, grammar
from .harmony import HarmonyParser
from .output_parse import (
    CallParser,
    Delta,
    Message,
    OutputParser,
    ToolFormat,
    new_call_id,
    new_mistral_id,
)
from .regions import RegionParser
from .tool_fields import ToolSpec, ToolSpecError, forced_call, tool_spec
from .tools_prompt import RESERVED, template_tools

REASONING_FORMATS = ("none", "auto", "deepseek")


@dataclass
class ChatPlan:
    """``spec``: the checked tools; ``fmt``: the template's call format; ``reasoning``:
    split ``<think>`` off (reasoning_format deepseek or auto); ``kwargs``: extra template
    variables; ``forced_open`` is set once the prompt is rendered."""

    spec: ToolSpec
    fmt: ToolFormat
    reasoning: bool
    kwargs: dict[str, object] = field(default_factory=dict)
    forced_open: bool = False
    family: str = ""  # families.Family.name (``fmt`` FAMILY: its parser reads the calls)
    tags: tuple[str, str] = ("<think>", "</think>")  # the family's reasoning tags
    frame: Frame | None = None  # a forced call's frame in the family's syntax
    control: ControlTokens = NO_CONTROL  # the model's control tokens (control.py)
    # the control tokens the answer renders as text: the template's markers, which the
    # parser reads (empty for a plain answer: llama.cpp's default, no special pieces)
    preserved: frozenset[int] = frozenset()

    def parser(self) -> OutputParser:
        """A fresh parser for one choice."""
        calls: CallParser | None = None
        reasoning = self.reasoning
        if self.family == "gpt-oss":  # Harmony: channels carry the reasoning
            calls, reasoning = HarmonyParser(self.reasoning), False
        elif self.fmt is ToolFormat.FAMILY and self.spec.parse_calls:
            calls = RegionParser(BY_NAME[self.family])
        return OutputParser(
            self.fmt if self.spec.parse_calls and calls is None else None,
            reasoning=reasoning,
            forced_open=self._forced_open(),
            new_id=new_mistral_id if self.fmt is ToolFormat.MISTRAL else new_call_id,
            calls=calls,
            tags=self.tags,
        )

    def _forced_open(self) -> bool:
        """The output starts in the reasoning: the prompt opened it, and a forced call's
        frame (the grammar) closes it first or there is none."""
        if self.frame is None or not self.spec.forced:
            return self.forced_open
        return self.forced_open and self.tags[1] in self.frame.head[0]

    @property
    def plain(self) -> bool:
        """Nothing to parse: the output is all content."""
        return not self.spec.parse_calls and not self.reasoning

    def constraint(self) -> Constraint | None:
        """With ``required`` or a named function, the call format with the tools' parameter
        schemas; ToolSpecError when a parameters schema cannot be compiled."""
        if not self.spec.forced:
            return None
        if self.fmt is ToolFormat.FAMILY or self.frame is not None:
            return self._family_constraint()
        c = forced_call(self.spec, self.fmt)
        try:
            return json_schema_constraint(c.schema, prefix=c.prefix, suffix=c.suffix)
        except ConstraintError as e:
            raise ToolSpecError(f"cannot force a tool call: the tools' parameters: {e}") from None

    def _family_constraint(self) -> Constraint:
        if self.frame is None:
            raise ToolSpecError(
                f"cannot force a tool call: the template's {self.family} call syntax could "
                "not be learnt from its rendering"
            )
        tools = [
            t
            for t in self.spec.tools
            if self.spec.choice != "function" or t.name == self.spec.forced_name
        ]
        try:
            return lark_constraint(grammar(self.frame, tools, self.control))
        except ConstraintError as e:
            raise ToolSpecError(f"cannot force a tool call: the tools' parameters: {e}") from None


def _kwargs(
    chat_template_kwargs: dict[str, object] | None, effort: str | None
) -> dict[str, object]:
    """llama-server's rules: ``enable_thinking`` must be a boolean; ``reasoning_effort``
    "none" turns thinking off, any other value is handed to the template."""
    kw = dict(chat_template_kwargs or {})
    if "enable_thinking" in kw and not isinstance(kw["enable_thinking"], bool):
        raise ToolSpecError('invalid type for "enable_thinking" (expected boolean)')
    if effort == "none":
        kw["enable_thinking"] = False
        kw.pop("reasoning_effort", None)
    elif effort:
        kw["reasoning_effort"] = effort
    return kw


def plan_chat(
    template: ChatTemplate,
    *,
    tools: JsonValue = None,
    tool_choice: JsonValue = None,
    parallel_tool_calls: bool | None = None,
    reasoning_format: str | None = None,
    default_reasoning_format: str = "auto",
    chat_template_kwargs: dict[str, object] | None = None,
    reasoning_effort: str | None = None,
    control: ControlTokens = NO_CONTROL,
) -> ChatPlan:
    """The plan of a chat request; ToolSpecError (a 400) for malformed fields. ``control``:
    the model's control tokens (markers named by id in grammars, rendered in answers)."""
    spec = tool_spec(tools, tool_choice, parallel_tool_calls)
    fmt = template_tools(template).fmt if spec.tools else ToolFormat.GENERIC
    rf = reasoning_format or default_reasoning_format
    if rf not in REASONING_FORMATS:
        raise ToolSpecError(f"reasoning_format must be one of {', '.join(REASONING_FORMATS)}")
    kw = _kwargs(chat_template_kwargs, reasoning_effort)
    plan = ChatPlan(spec, fmt, rf != "none", kw, tags=reasoning_tags(template.source))
    plan.control = control
    tt = template_tools(template)
    if spec.tools and fmt is ToolFormat.FAMILY:
        plan.family = tt.family
        if spec.forced:
            plan.frame = _frame(template, kw)
            if plan.frame is None:
                # no frame could be learnt from the template (it does not render calls, or
                # renders arguments in a shape a grammar cannot follow): the forced call
                # takes the generic JSON form, constrained and parsed as such
                plan.fmt = ToolFormat.GENERIC
    elif tt.family == "gpt-oss":
        plan.family = "gpt-oss"
    elif spec.forced and tt.native and fmt in _FRAMED and not spec.parallel:
        # the template's own bytes (a frame) where it renders one call; else the JSON shape
        plan.frame = _frame(template, kw)
    if not plan.plain or plan.family == "gpt-oss":
        plan.preserved = _preserved(control, template.source)
    return plan


_preserved_of: dict[tuple[int, str], tuple[ControlTokens, frozenset[int]]] = {}


def _preserved(control: ControlTokens, source: str) -> frozenset[int]:
    """``control.preserved(source)``, cached per vocabulary and template (one scan; the
    entry holds its ControlTokens, so an id is never reused while it is cached)."""
    key = (id(control), source)
    got = _preserved_of.get(key)
    if got is None or got[0] is not control:
        if len(_preserved_of) > 16:
            _preserved_of.clear()
        got = _preserved_of[key] = (control, control.preserved(source))
    return got[1]


# JSON formats whose one forced call follows the template's frame (Mistral's [TOOL_CALLS]
# is a control token, which literal text in a grammar does not produce: its shape stays)
_FRAMED = (ToolFormat.HERMES, ToolFormat.LLAMA3)


_frames: dict[tuple[str, str], Frame | None] = {}


def _frame(template: ChatTemplate, kw: dict[str, object]) -> Frame | None:
    """The template's call frame under the request's template variables (cached)."""
    extra = {k: v for k, v in kw.items() if k not in RESERVED}
    if "enable_thinking" in template.variables:
        extra.setdefault("enable_thinking", True)
    key = (template.source, json.dumps(extra, sort_keys=True, default=str))
    if key not in _frames:
        if len(_frames) > 64:
            _frames.clear()
        _frames[key] = derive(template, extra)
    return _frames[key]


# ---- response shapes --------------------------------------------------------------------


def message_of(m: Message) -> JsonObject:
    """The OpenAI ``message``: content null when the answer is only tool calls."""
    out: JsonObject = {"role": "assistant", "content": m.content}
    if m.tool_calls and not m.content:
        out["content"] = None
    if m.reasoning:
        out["reasoning_content"] = m.reasoning
    if m.tool_calls:
        out["tool_calls"] = [c.as_openai() for c in m.tool_calls]
    return out


def deltas_of(d: Delta) -> list[JsonObject]:
    """A parser delta as OpenAI ``delta`` objects: reasoning and content first, then one per
    call piece (index, id, type and name first; argument fragments after)."""
    out: list[JsonObject] = []
    text: JsonObject = {}
    if d.reasoning:
        text["reasoning_content"] = d.reasoning
    if d.content:
        text["content"] = d.content
    if text:
        out.append(text)
    for c in d.calls:
        piece: JsonObject = {"index": c.index}
        if c.id is not None:
            piece.update(id=c.id, type="function")
            piece["function"] = {"name": c.name, "arguments": c.arguments}
        else:
            piece["function"] = {"arguments": c.arguments}
        out.append({"tool_calls": [piece]})
    return out
