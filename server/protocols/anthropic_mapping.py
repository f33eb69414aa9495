"""Anthropic's Messages API mapped onto chat: a Messages body becomes a chat body
(``to_chat_body``), so the chat path's rendering, caches, tools and constraints serve it
unchanged; a parsed chat answer becomes Anthropic content blocks (``content_blocks``), its
stop reason and usage.

Token accounting (``usage``): ``input_tokens`` are the prompt tokens computed for this
request, ``cache_read_input_tokens`` those served from the KV cache, the RAM cache or the
disk tier; their sum is the whole prompt (what ``count_tokens`` reports). Every prompt is
cached without being asked, so nothing is ever reported as ``cache_creation_input_tokens``."""

from __future__ import annotations

import json
import re
import uuid

from ..cancel import checkpoint
from ..json_value import JsonObject
from ..schemas.anthropic_bodies import (
    AnthropicMessage,
    CountTokensRequest,
    DocumentBlock,
    ImageBlock,
    TextBlock,
    ThinkingBlock,
    ToolChoice,
    ToolResultBlock,
    ToolUseBlock,
)
from ..schemas.bodies import SamplingFields
from ..schemas.json_body import loads_bounded
from ..task import FinishReason, TaskResult
from ..templates.output_parse import Message

# Claude Code stamps its system prompt with a per-request hash ("cch=ab12f;"), which would
# end every cached prefix there; llama-server blanks it the same way (its PR 21793).
_BILLING = re.compile(r"^(x-anthropic-billing-header:[^\n]*?cch=)[^;\n]{5};")


class AnthropicInputError(ValueError):
    """The body cannot be mapped onto chat: a 400 with this message."""


def new_id(prefix: str) -> str:
    """``msg_``/``toolu_`` ids with 24 random hex digits."""
    return prefix + uuid.uuid4().hex[:24]


def _system(system: str | list[TextBlock] | None) -> list[dict[str, object]]:
    """The system prompt as a chat message (none when absent)."""
    if system is None:
        return []
    texts = [system] if isinstance(system, str) else [b.text for b in system]
    if texts:
        texts[0] = _BILLING.sub(r"\1fffff;", texts[0], count=1)
    parts = [{"type": "text", "text": t} for t in texts]
    return [{"role": "system", "content": parts}] if parts else []


def _document(b: DocumentBlock, where: str) -> str:
    """A plain-text document's text (its title and context first)."""
    src = b.source
    data = src.get("data")
    if src.get("type") != "text" or not isinstance(data, str):
        raise AnthropicInputError(
            f"{where}: only documents with a plain-text source "
            '({"type": "text", "media_type": "text/plain", "data": ...}) are supported'
        )
    return "\n\n".join(t for t in (b.title, b.context, data) if t)


def _result_content(b: ToolResultBlock, where: str) -> str | list[dict[str, object]]:
    """A tool result's content: text (an error marked as one), or with images the chat's
    content parts (text parts and ``image_url`` parts, bounded there as a user's images)."""
    if b.content is None:
        pieces: list[str | ImageBlock] = [""]
    elif isinstance(b.content, str):
        pieces = [b.content]
    else:
        pieces = [
            c if isinstance(c, ImageBlock) else c.text if isinstance(c, TextBlock)
            else _document(c, where)
            for c in b.content
        ]  # fmt: skip
    if not any(isinstance(p, ImageBlock) for p in pieces):
        text = "\n".join(p for p in pieces if isinstance(p, str))
        return f"Error: {text}" if b.is_error else text
    parts: list[dict[str, object]] = [{"type": "text", "text": "Error:"}] if b.is_error else []
    for j, p in enumerate(pieces):
        parts.append(
            _image(p, f"{where}.content.{j}")
            if isinstance(p, ImageBlock)
            else {"type": "text", "text": p}
        )
    return parts


def _image(b: ImageBlock, where: str) -> dict[str, object]:
    """An image block as the chat's ``image_url`` part: a base64 source as a data URL (the
    chat path bounds and decodes it, or refuses it without --mmproj), a ``url`` source as
    its URL (remote ones refused there)."""
    src = b.source
    kind, data = src.get("type"), src.get("data")
    if kind == "base64" and isinstance(data, str):
        media = src.get("media_type") if isinstance(src.get("media_type"), str) else "image/png"
        return {"type": "image_url", "image_url": {"url": f"data:{media};base64,{data}"}}
    if kind == "url" and isinstance(src.get("url"), str):
        return {"type": "image_url", "image_url": {"url": src["url"]}}
    raise AnthropicInputError(
        f"{where}.source: an image source must be "
        '{"type": "base64", "media_type": ..., "data": ...} or {"type": "url", "url": ...}'
    )


def _user(m: AnthropicMessage, where: str, calls: set[str]) -> list[dict[str, object]]:
    """A user message: its tool results as ``tool`` messages (each answering a call of the
    assistant message before it), then its text as one user message."""
    if isinstance(m.content, str):
        return [{"role": "user", "content": m.content}]
    tools: list[dict[str, object]] = []
    parts: list[dict[str, object]] = []
    for j, b in enumerate(m.content):
        at = f"{where}.content.{j}"
        if isinstance(b, TextBlock):
            parts.append({"type": "text", "text": b.text})
        elif isinstance(b, DocumentBlock):
            parts.append({"type": "text", "text": _document(b, at)})
        elif isinstance(b, ImageBlock):
            parts.append(_image(b, at))
        elif isinstance(b, ToolResultBlock):
            if b.tool_use_id not in calls:
                raise AnthropicInputError(
                    f"{at}: tool_result for tool_use_id {b.tool_use_id!r}, which no tool_use "
                    "block of the previous assistant message has"
                )
            content = _result_content(b, at)
            tools.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": content})
        else:
            raise AnthropicInputError(f"{at}: {b.type} blocks belong in assistant messages")
    user: list[dict[str, object]] = [{"role": "user", "content": parts}]
    return tools + (user if parts or not tools else [])


def _assistant(m: AnthropicMessage, where: str) -> tuple[dict[str, object], set[str]]:
    """An assistant message: text, reasoning (thinking blocks) and tool calls; with the ids
    of its calls, which the next user message's tool results must answer."""
    if isinstance(m.content, str):
        return {"role": "assistant", "content": m.content}, set()
    parts: list[dict[str, str]] = []
    reasoning: list[str] = []
    calls: list[dict[str, object]] = []
    ids: set[str] = set()
    for j, b in enumerate(m.content):
        if isinstance(b, TextBlock):
            parts.append({"type": "text", "text": b.text})
        elif isinstance(b, ThinkingBlock):
            reasoning.append(b.thinking)
        elif isinstance(b, ToolUseBlock):
            fn = {"name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)}
            calls.append({"id": b.id, "type": "function", "function": fn})
            ids.add(b.id)
        elif b.type != "redacted_thinking":  # opaque: another model's encrypted reasoning
            raise AnthropicInputError(
                f"{where}.content.{j}: {b.type} blocks belong in user messages"
            )
    msg: dict[str, object] = {"role": "assistant", "content": parts or ""}
    if calls:
        msg["tool_calls"] = calls
    if reasoning:
        msg["reasoning_content"] = "".join(reasoning)
    return msg, ids


def anthropic_chat_messages(req: CountTokensRequest) -> list[dict[str, object]]:
    """The chat messages of a Messages body: the system prompt, then each message (a user
    message's tool results become ``tool`` messages). No messages at all is one empty user
    turn, as llama-server is lenient there."""
    out = _system(req.system)
    calls: set[str] = set()
    for i, m in enumerate(req.messages):
        checkpoint()  # the client may have left: stop between messages
        where = f"messages.{i}"
        if m.role == "user":
            out += _user(m, where, calls)
            calls = set()
        else:
            msg, calls = _assistant(m, where)
            out.append(msg)
    if not req.messages:
        out.append({"role": "user", "content": ""})
    return out


def _tools(tools: list[JsonObject] | None) -> list[JsonObject] | None:
    """Custom tools as chat functions; Anthropic's own and server tools are refused."""
    if tools is None:
        return None
    out: list[JsonObject] = []
    for i, t in enumerate(tools):
        kind = t.get("type")
        if kind not in (None, "custom"):
            raise AnthropicInputError(
                f"tools.{i}: tool type {kind!r} (an Anthropic-defined or server tool) is not "
                "supported; only custom tools with an input_schema are"
            )
        if not isinstance(t.get("name"), str) or not t["name"]:
            raise AnthropicInputError(f"tools.{i}.name: a non-empty string is required")
        if not isinstance(t.get("input_schema"), dict):
            raise AnthropicInputError(f"tools.{i}.input_schema: a JSON schema object is required")
        if t.get("strict"):
            raise AnthropicInputError(
                f"tools.{i}.strict: strict tool use is not supported (force the call with "
                'tool_choice {"type": "tool"} to constrain its input)'
            )
        fn: JsonObject = {"name": t["name"], "parameters": t["input_schema"]}
        if t.get("description") is not None:
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(tc: ToolChoice | None) -> tuple[object, bool]:
    """The chat ``tool_choice`` and ``parallel_tool_calls`` (Anthropic allows several calls
    unless ``disable_parallel_tool_use``)."""
    if tc is None:
        return None, True
    if tc.type == "tool":
        if not tc.name:
            raise AnthropicInputError('tool_choice.name: required with type "tool"')
        return {"type": "function", "function": {"name": tc.name}}, not tc.disable_parallel_tool_use
    choice = {"auto": "auto", "any": "required", "none": "none"}[tc.type]
    return choice, not tc.disable_parallel_tool_use


def _thinking(req: CountTokensRequest) -> dict[str, object]:
    """The chat fields of ``thinking`` and ``output_config``."""
    out: dict[str, object] = {}
    t = req.thinking
    if t is not None and t.type == "enabled":
        if t.budget_tokens is None:
            raise AnthropicInputError("thinking.budget_tokens: required with type enabled")
        if req.max_tokens is not None and t.budget_tokens >= req.max_tokens:
            raise AnthropicInputError("thinking.budget_tokens must be less than max_tokens")
    if t is not None:
        on = t.type != "disabled"
        out["chat_template_kwargs"] = {**(req.chat_template_kwargs or {}), "enable_thinking": on}
        if on:
            out["reasoning_format"] = "deepseek"
        if t.type == "enabled":  # enforced (server.service.budget), as llama-server does
            out["thinking_budget_tokens"] = t.budget_tokens
    oc = req.output_config
    if oc is not None and oc.effort is not None:
        out["reasoning_effort"] = oc.effort
    if oc is not None and oc.format is not None:
        schema = {"name": "output", "schema": oc.format.schema_}
        out["response_format"] = {"type": "json_schema", "json_schema": schema}
    return out


def _stops(req: CountTokensRequest) -> list[str] | None:
    """``stop_sequences`` and llama-server's ``stop``, together."""
    stops = list(req.stop_sequences or [])
    stops += [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    return stops or None


def to_chat_body(req: CountTokensRequest) -> dict[str, object]:
    """The chat body (ChatRequest's fields) of a Messages body; AnthropicInputError names
    what cannot be mapped."""
    body = req.model_dump(
        include=set(SamplingFields.model_fields), exclude_unset=True, by_alias=True
    )
    choice, parallel = _tool_choice(req.tool_choice)
    body.update(
        model=req.model,
        messages=anthropic_chat_messages(req),
        max_tokens=req.max_tokens,
        stop=_stops(req),
        stream=req.stream,
        tools=_tools(req.tools),
        tool_choice=choice,
        parallel_tool_calls=parallel if req.tools else None,
        chat_template_kwargs=req.chat_template_kwargs,
    )
    body.update(_thinking(req))
    return body


# ---- the answer ----------------------------------------------------------------------


def tool_input(arguments: str) -> JsonObject:
    """A call's arguments as the ``input`` object; a call cut short by ``max_tokens`` (not
    valid JSON) has ``{}``, as llama-server's, and so has one nesting deeper than any body
    this server reads (the model's text, never a RecursionError)."""
    try:
        value = loads_bounded(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def content_blocks(m: Message, omit_thinking: bool = False) -> list[dict[str, object]]:
    """The answer's blocks: thinking first, then text, then one tool_use per call. Local
    models sign nothing: ``signature`` is empty."""
    blocks: list[dict[str, object]] = []
    if m.reasoning:
        text = "" if omit_thinking else m.reasoning
        blocks.append({"type": "thinking", "thinking": text, "signature": ""})
    if m.content:
        blocks.append({"type": "text", "text": m.content})
    for c in m.tool_calls:
        blocks.append(
            {"type": "tool_use", "id": c.id, "name": c.name, "input": tool_input(c.arguments)}
        )
    return blocks


def stop_reason(r: TaskResult, has_calls: bool) -> tuple[str, str | None]:
    """Anthropic's ``stop_reason`` and ``stop_sequence``: a token limit or a full context
    is ``max_tokens``; an answer with calls ``tool_use``; a stop string ``stop_sequence``."""
    if r.finish is FinishReason.LENGTH:
        return "max_tokens", None
    if has_calls:
        return "tool_use", None
    if r.stop_word:
        return "stop_sequence", r.stop_word
    return "end_turn", None


def usage(r: TaskResult) -> dict[str, int]:
    """The ``usage`` object of a finished answer (module docstring)."""
    return {
        "input_tokens": r.n_prompt - r.timings.cache_n,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": r.timings.cache_n,
        "output_tokens": r.timings.predicted_n,
    }


def message_object(
    msg_id: str, model: str, blocks: list[dict[str, object]], r: TaskResult, has_calls: bool
) -> dict[str, object]:
    """The whole ``message`` of a non-streamed answer."""
    reason, sequence = stop_reason(r, has_calls)
    return {
        "id": msg_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": blocks,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": usage(r),
    }
