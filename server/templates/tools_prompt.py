"""Tools and tool history in the prompt, and which output format a template implies.

How the format is picked (``template_tools``), once per template:

1. A template that takes a ``tools`` variable (the Hugging Face convention) renders a probe
   conversation holding one call; what it writes for the call names the format: Hermes
   (``<tool_call>{"name": ...``), Mistral (``[TOOL_CALLS]``) or Llama 3 (``{"name": ...,
   "parameters": ...}``). Such a template renders tools, calls and tool results itself.
2. The built-in templates ``chatml``, ``llama3`` and ``mistral`` use their model family's
   format (Hermes, Llama 3, Mistral); the tool list and the history are written into the
   messages here, as those families' own templates write them.
3. Anything else (the built-in ``gemma``, a model template without tool support or with a
   call syntax not listed above) uses the generic JSON form: a tool description and
   instructions in the system prompt, ``{"tool_calls": [...]}`` as the answer.

The tool text never depends on ``tool_choice``, so an agent loop that changes it between
turns keeps the system prompt and tool list as a cached prefix.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TypedDict

from ..cancel import checkpoint
from ..json_value import JsonValue
from ..schemas.json_body import TooDeep, loads_bounded
from .chat_template import ChatMessage, ChatTemplate, TemplateError
from .families import detect_family
from .output_parse import ToolFormat
from .tool_fields import ToolSpec

BUILTIN_FORMATS = {
    "chatml": ToolFormat.HERMES,
    "llama3": ToolFormat.LLAMA3,
    "mistral": ToolFormat.MISTRAL,
}
# Variables this server sets itself; chat_template_kwargs cannot override them.
RESERVED = frozenset({"messages", "add_generation_prompt", "bos_token", "eos_token", "tools"})


@dataclass(frozen=True)
class TemplateTools:
    """How a template deals with tools: the output format, and whether the template
    renders tools itself (``native``) or this module writes them into the messages."""

    fmt: ToolFormat
    native: bool
    family: str = ""  # families.Family.name, where the template's syntax is a known family
    # the template concatenates a call's arguments as text (Functionary v3.2): history
    # calls keep the client's JSON string, as llama-server does for such templates
    string_arguments: bool = False


_PROBE_ID = "pr0be0001"  # Mistral templates insist on 9 alphanumerics
_PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": "probe_fn",
        "description": "probe",
        "parameters": {"type": "object", "properties": {"probe_arg": {"type": "integer"}}},
    },
}


def _probe(arguments: JsonValue) -> list[ChatMessage]:
    """A conversation with one call (``arguments``: as the template gets them) and its
    result, rendered to learn how a template writes calls."""
    call = {"name": "probe_fn", "arguments": arguments}
    return [
        {"role": "system", "content": "probe system"},
        {"role": "user", "content": "probe user"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": _PROBE_ID, "type": "function", "function": call}],
        },
        {"role": "tool", "tool_call_id": _PROBE_ID, "name": "probe_fn", "content": "probe result"},
    ]


_PROBE = _probe({"probe_arg": 1})
_PROBE_STRING = _probe('{"probe_arg": 1}')
_HERMES = re.compile(r'<tool_call>\s*\{\s*"name"\s*:\s*"probe_fn"')
_LLAMA3 = re.compile(r'\{\s*"name"\s*:\s*"probe_fn"\s*,\s*"parameters"')
_cache: dict[tuple[str, str], TemplateTools] = {}


def template_tools(tpl: ChatTemplate) -> TemplateTools:
    """The tool format of ``tpl`` (see the module docstring); cached per template."""
    key = (tpl.name, tpl.source)
    got = _cache.get(key)
    if got is None:
        got = _cache[key] = _detect(tpl)
    return got


def _render_probe(tpl: ChatTemplate) -> tuple[str, bool]:
    """The probe conversation as ``tpl`` renders it ("" where it cannot), and whether it
    takes a call's arguments only as a string (it fails on the object)."""
    for as_string, probe in ((False, _PROBE), (True, _PROBE_STRING)):
        try:
            return tpl.render(probe, add_generation_prompt=True, tools=[_PROBE_TOOL]), as_string
        except TemplateError:
            continue
    return "", False


def _detect(tpl: ChatTemplate) -> TemplateTools:
    if "tools" in tpl.variables:
        text, as_string = _render_probe(tpl)
        fam = detect_family(tpl.source, text)
        if fam is not None and not fam.fmt:
            return TemplateTools(ToolFormat.FAMILY, True, fam.name, as_string)
        if _HERMES.search(text):
            return TemplateTools(ToolFormat.HERMES, True, "hermes")
        if "[TOOL_CALLS]" in text:
            return TemplateTools(ToolFormat.MISTRAL, True, "mistral")
        if _LLAMA3.search(text):
            return TemplateTools(ToolFormat.LLAMA3, True, "llama3")
    if tpl.name in BUILTIN_FORMATS:
        return TemplateTools(BUILTIN_FORMATS[tpl.name], False)
    return TemplateTools(ToolFormat.GENERIC, False)


# ---- messages ---------------------------------------------------------------------------


class CallFunction(TypedDict):
    name: str
    arguments: object  # a JSON value, as the template's ``tojson`` takes it


class TemplateCall(TypedDict):
    """An assistant message's call as templates take it (Hugging Face convention)."""

    id: str
    type: str
    function: CallFunction


def _text(v: object) -> str:
    """A string field of a checked message (``ChatRequest``): itself, else ""."""
    return v if isinstance(v, str) else ""


def _arguments(raw: JsonValue) -> JsonValue:
    """A call's arguments as templates take them: the JSON object OpenAI sends as a string
    (templates ``tojson`` it), or the string itself when it is not JSON. TemplateError (a
    client's: 400) when it nests deeper than the bodies this server reads (the template's
    ``tojson`` would recurse through every level)."""
    if isinstance(raw, str):
        try:
            return loads_bounded(raw)
        except TooDeep as e:
            raise TemplateError(f"a tool call's arguments: {e}", client=True) from None
        except ValueError:
            return raw
    return raw


def _calls(msg: ChatMessage, string_arguments: bool = False) -> list[TemplateCall]:
    out: list[TemplateCall] = []
    for c in msg.get("tool_calls") or []:
        fn = c.get("function")
        fn = fn if isinstance(fn, Mapping) else {}
        raw = fn.get("arguments", "{}")
        if string_arguments:
            args: object = raw if isinstance(raw, str) else json.dumps(raw)
        else:
            args = _arguments(raw)
        name = _text(fn.get("name"))
        out.append(
            {
                "id": _text(c.get("id")),
                "type": "function",
                "function": {"name": name, "arguments": args},
            }
        )
    return out


def _mistral_id(call_id: str) -> str:
    """A call id as Mistral's templates demand it (9 alphanumerics): kept when it is one,
    else derived from it, the same for the call and for the tool message answering it."""
    if len(call_id) == 9 and call_id.isalnum():
        return call_id
    digest = int(hashlib.sha256(call_id.encode()).hexdigest(), 16)
    alphabet = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
    return "".join(alphabet[(digest >> (6 * i)) % 62] for i in range(9))


def _native(messages: list[ChatMessage], tt: TemplateTools) -> list[ChatMessage]:
    """Hugging Face convention: assistant ``tool_calls`` with object arguments and string
    content (some templates fail on null), tool messages with ``tool_call_id`` and
    ``name`` (looked up from the call when the client left it out)."""
    fix = _mistral_id if tt.fmt is ToolFormat.MISTRAL else (lambda i: i)
    names: dict[str, str] = {}
    out = []
    for m in messages:
        checkpoint()  # the client may have left: stop between messages
        m = m.copy()
        if m.get("tool_calls"):
            calls = _calls(m, tt.string_arguments)
            for c in calls:
                names[c["id"]] = c["function"]["name"]
                c["id"] = fix(c["id"])
            m["tool_calls"] = calls
            m["content"] = m.get("content") or ""
        elif m["role"] == "tool":
            call_id = m.get("tool_call_id") or ""
            if not m.get("name") and names.get(call_id):
                m["name"] = names[call_id]
            m["tool_call_id"] = fix(call_id)
        out.append(m)
    return out


def _call_text(fmt: ToolFormat, calls: list[TemplateCall]) -> str:
    """Calls as the model of format ``fmt`` writes them."""
    fns = [(c["function"]["name"], c["function"]["arguments"], c["id"]) for c in calls]
    if fmt is ToolFormat.HERMES:
        return "\n".join(
            "<tool_call>\n" + json.dumps({"name": n, "arguments": a}) + "\n</tool_call>"
            for n, a, _ in fns
        )
    if fmt is ToolFormat.LLAMA3:
        return "\n".join(json.dumps({"name": n, "parameters": a}) for n, a, _ in fns)
    if fmt is ToolFormat.MISTRAL:
        body = [{"name": n, "arguments": a, "id": i} for n, a, i in fns]
        return "[TOOL_CALLS]" + json.dumps(body)
    return json.dumps({"tool_calls": [{"name": n, "arguments": a} for n, a, _ in fns]})


def _result(fmt: ToolFormat, m: ChatMessage, name: str) -> ChatMessage:
    """A tool message as the template of format ``fmt`` takes it."""
    content = m.get("content") or ""
    if fmt is ToolFormat.HERMES:
        return {"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"}
    if fmt is ToolFormat.LLAMA3:
        return {"role": "ipython", "content": content}
    if fmt is ToolFormat.MISTRAL:
        body = json.dumps({"content": content, "call_id": m.get("tool_call_id") or ""})
        return {"role": "tool", "content": body}
    head = f"Result of tool {name}" if name else "Tool result"
    return {"role": "user", "content": f"{head}:\n{content}"}


def _rewritten(fmt: ToolFormat, messages: list[ChatMessage]) -> list[ChatMessage]:
    """The history for a template without tool support: calls as text in the assistant
    turns, tool results as the family's tool turns (user turns for Hermes and generic,
    consecutive ones joined into one so that roles keep alternating)."""
    names: dict[str, str] = {}
    out: list[ChatMessage] = []
    # the texts that make out[-1]'s content while tool results join into it, joined once
    # when the run ends (joining one by one copies the growing text each time: quadratic)
    run: list[str] = []

    def end_run() -> None:
        if len(run) > 1:
            out[-1] = {"role": "user", "content": "\n\n".join(run)}
        run.clear()

    joinable = False  # the last message came from tool results
    for m in messages:
        checkpoint()  # the client may have left: stop between messages
        if m.get("tool_calls"):
            end_run()
            calls = _calls(m)
            names.update((c["id"], c["function"]["name"]) for c in calls)
            text = _call_text(fmt, calls)
            content = m.get("content") or ""
            out.append(
                {"role": "assistant", "content": f"{content}\n\n{text}" if content else text}
            )
            joinable = False
            continue
        if m["role"] == "tool":
            r = _result(fmt, m, m.get("name") or names.get(m.get("tool_call_id") or "", ""))
        else:
            r = {"role": m["role"], "content": m.get("content") or ""}
        if joinable and r["role"] == "user" and out[-1]["role"] == "user":
            run.extend([out[-1]["content"], r["content"]] if not run else [r["content"]])
        else:
            end_run()
            out.append(r)
        joinable = m["role"] == "tool" and r["role"] == "user"
    end_run()
    return out


# ---- the tool list ----------------------------------------------------------------------


def _tool_lines(spec: ToolSpec) -> str:
    return "\n".join(json.dumps(t.as_openai()) for t in spec.tools)


def system_text(fmt: ToolFormat, spec: ToolSpec) -> str:
    """The tool list and calling instructions, in the words of format ``fmt``'s models."""
    if fmt is ToolFormat.HERMES:
        return (
            "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n"
            f"<tools>\n{_tool_lines(spec)}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments "
            "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
        )
    if fmt is ToolFormat.LLAMA3:
        return (
            "When you receive a tool call response, use the output to format an answer to "
            "the original user question.\n\nGiven the following functions, please respond "
            "with a JSON for a function call with its proper arguments that best answers the "
            'given prompt.\n\nRespond in the format {"name": function name, "parameters": '
            "dictionary of argument name and its value}. Do not use variables.\n\n"
            + "\n\n".join(json.dumps(t.as_openai(), indent=4) for t in spec.tools)
        )
    if fmt is ToolFormat.MISTRAL:
        return (
            "[AVAILABLE_TOOLS]"
            + json.dumps([t.as_openai() for t in spec.tools])
            + ("[/AVAILABLE_TOOLS]")
        )
    return (
        "You can call these tools (functions); each comes with a JSON schema of its "
        f"parameters:\n{_tool_lines(spec)}\n\n"
        "To call tools, answer with only this JSON object and nothing else:\n"
        '{"tool_calls": [{"name": "<tool name>", "arguments": {<arguments>}}]}\n'
        "To answer without a tool, write the answer as plain text."
    )


def _with_system(messages: list[ChatMessage], text: str) -> list[ChatMessage]:
    """``text`` appended to the system message (one is added first when there is none)."""
    if messages and messages[0]["role"] == "system":
        first = messages[0]
        body = first.get("content") or ""
        return [{**first, "content": f"{body}\n\n{text}" if body else text}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


@dataclass
class Prepared:
    """What the template renders: messages and extra template variables."""

    messages: list[ChatMessage]
    extra: dict[str, object]
    fmt: ToolFormat


def prepare(
    tpl: ChatTemplate,
    messages: list[ChatMessage],
    spec: ToolSpec,
    kwargs: Mapping[str, object] | None = None,
) -> Prepared:
    """Messages and variables for ``tpl``: tools and tool history in the template's own way
    (native) or written into the messages (see the module docstring). ``kwargs`` are the
    request's ``chat_template_kwargs`` (and ``reasoning_effort``), minus reserved names."""
    tt = template_tools(tpl)
    extra = {k: v for k, v in (kwargs or {}).items() if k not in RESERVED}
    if "enable_thinking" in tpl.variables:
        # llama-server (--reasoning auto) turns thinking on for templates that support it
        extra.setdefault("enable_thinking", True)
    has_history = any(m.get("tool_calls") or m["role"] == "tool" for m in messages)
    if tt.native:
        if spec.tools:
            extra["tools"] = [t.as_openai() for t in spec.tools]
        return Prepared(_native(messages, tt) if has_history else messages, extra, tt.fmt)
    out = _rewritten(tt.fmt, messages) if has_history else messages
    if spec.tools:
        out = _with_system(out, system_text(tt.fmt, spec))
    return Prepared(out, extra, tt.fmt)
