"""Forced calls in a family's own syntax, byte for byte what the template renders.

The frame of a call is learnt from the template itself (as llama.cpp's chat-diff-analyzer
does): a conversation whose assistant turn holds one call of a probe function with probe
arguments is rendered, the generation prompt is cut off its front and the turn's end off its
back; what is left is the call as the template writes it. The probe name and the probe
arguments are then holes: the name becomes the forced tool's name, the arguments a JSON
island (llguidance ``%json``) with the template's separators (``tojson``: ", " and ": ", no
other whitespace), properties in schema order. XML-parameter families (arguments rendered
one by one) get their per-parameter frame from two probe parameters, one string and one
integer.

The next turn's template renders the generated call again: the same bytes, so the prompt
cache reuses the call (``tests/e2e/test_families_e2e.py`` checks it through ``prompt_n``)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from ..json_value import JsonObject
from .chat_template import ChatTemplate, TemplateError
from .control_tokens import NO_CONTROL, ControlTokens
from .tool_fields import Tool

FN = "probe_fn"
_JSON_ARGS = {"probe_arg": 1}
_XML_ARGS = {"probe_s": "PROBESTR", "probe_n": 7}
# fixed separators as the templates' tojson writes them (no flexible whitespace)
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class Frame:
    """``head`` joined by NAME (a template may write the name more than once), then ARGS
    (JSON arguments) or, with ``params``, per parameter ``p_open`` KEY ``p_str``/``p_num``
    VALUE ``p_close``; then ``tail``."""

    head: tuple[str, ...]
    tail: str
    params: bool = False
    p_open: str = ""
    p_str: str = ""
    p_num: str = ""
    p_close: str = ""


def _turn(tpl: ChatTemplate, args: Mapping[str, object], kwargs: dict[str, object]) -> str | None:
    """The call text the template renders for one probe call (None when it cannot)."""
    tools = [
        {
            "type": "function",
            "function": {
                "name": FN,
                "description": "probe",
                "parameters": {
                    "type": "object",
                    "properties": {k: {"type": "string"} for k in args},
                },
            },
        }
    ]
    user = [{"role": "user", "content": "probe user"}]
    call = {"id": "pr0be0001", "type": "function", "function": {"name": FN, "arguments": args}}
    turn = {"role": "assistant", "content": "", "tool_calls": [call]}
    plain = {"role": "assistant", "content": "PROBEANSWER"}
    try:
        gen = tpl.render(user, True, tools=tools, **kwargs)
        full = tpl.render([*user, turn], False, tools=tools, **kwargs)
        ans = tpl.render([*user, plain], False, tools=tools, **kwargs)
    except TemplateError:
        return None
    if "PROBEANSWER" not in ans:
        return None
    # where the history renders the turn otherwise than the generation prompt opened it
    # (an opened <think> dropped), the call follows what both share
    n = len(os.path.commonprefix([gen, full]))
    while n < len(gen) and n > 0 and gen[n - 1] not in ">\n":
        n -= 1  # not inside a tag both begin alike (<think> and </think>)
    text = full[n:]
    end = ans[ans.index("PROBEANSWER") + len("PROBEANSWER") :]
    return _strip_end(text, end)


END_TAGS = ("<|eom_id|>", "<|eot_id|>", "<|im_end|>", "</s>")  # end-of-turn tokens
_END = re.compile(r"eos|eot|eom|end_of_(?:turn|text|sentence)")


def _last_tag(text: str) -> str:
    """The ``<...>`` the text ends with ("" when none)."""
    i = text.rfind("<")
    return text[i:] if text.endswith(">") and i >= 0 and "\n" not in text[i:] else ""


def _strip_end(text: str, end: str) -> str:
    """``text`` without the turn's end-of-turn tag: the last tag, where a plain answer's
    turn ends with it too (or it is a known end-of-turn token). The model stops on its own
    end-of-generation token there; whitespace before the tag stays (the model writes it)."""
    body = text.rstrip()
    if body.endswith("[e~["):  # MiniMax's end of turn
        return body[: -len("[e~[")]
    tag = _last_tag(body)
    if tag and (tag == _last_tag(end.rstrip()) or tag in END_TAGS or _END.search(tag)):
        return body[: len(body) - len(tag)]
    return text


def _history_head(tpl: ChatTemplate, kwargs: dict[str, object]) -> str | None:
    """What the template writes before the call's name once a tool result follows the call
    (the next turn's prompt): some drop there what they write for a last turn (Qwen3's empty
    ``<think>`` block). None when it cannot be read."""
    user = [{"role": "user", "content": "probe user"}]
    call = {
        "id": "pr0be0001",
        "type": "function",
        "function": {"name": FN, "arguments": _JSON_ARGS},
    }
    turn = {"role": "assistant", "content": "", "tool_calls": [call]}
    result = {"role": "tool", "tool_call_id": "pr0be0001", "name": FN, "content": "probe"}
    tools = [{"type": "function", "function": {"name": FN, "parameters": {"type": "object"}}}]
    try:
        gen = tpl.render(user, True, tools=tools, **kwargs)
        full = tpl.render([*user, turn, result], False, tools=tools, **kwargs)
    except TemplateError:
        return None
    n = len(os.path.commonprefix([gen, full]))
    while n < len(gen) and n > 0 and gen[n - 1] not in ">\n":
        n -= 1
    i = full.find(FN, n)
    return full[n:i] if i >= 0 else None


def derive(tpl: ChatTemplate, kwargs: dict[str, object]) -> Frame | None:
    """The call frame of ``tpl`` (see the module docstring), its head as the next turn
    renders it; None when the probe's rendering cannot be read."""
    f = _derive(tpl, kwargs)
    head = _history_head(tpl, kwargs)
    if f is None or head is None or head == f.head[0]:
        return f
    return dataclasses.replace(f, head=(head, *f.head[1:]))


def _derive(tpl: ChatTemplate, kwargs: dict[str, object]) -> Frame | None:
    text = _turn(tpl, _JSON_ARGS, kwargs)
    args = json.dumps(_JSON_ARGS, ensure_ascii=False)
    if text and text.count(args) == 1 and FN in text[: text.index(args)]:
        a = text.index(args)
        return Frame(tuple(text[:a].split(FN)), text[a + len(args) :])
    text = _turn(tpl, _XML_ARGS, kwargs)
    if not text or FN not in text:
        return None
    keys = ["probe_s", "PROBESTR", "probe_n", "7"]
    at = [text.find(k, text.index(FN)) for k in keys]
    if any(x < 0 for x in at) or at != sorted(at):
        return None
    i = text.rindex(FN, 0, at[0])
    segs = [text[i + len(FN) : at[0]]]
    for (x, k), y in zip(zip(at, keys, strict=True), at[1:], strict=False):
        segs.append(text[x + len(k) : y])
    after = text[at[3] + 1 :]
    s0, s1, s2, s3 = segs  # FN s0 probe_s s1 PROBESTR s2 probe_n s3 7 after
    # s2 = close + open of the next parameter; s0 ends with the same open
    n = 0
    while n < min(len(s0), len(s2)) and s0[len(s0) - 1 - n] == s2[len(s2) - 1 - n]:
        n += 1
    p_open, p_close = s2[len(s2) - n :], s2[: len(s2) - n]
    if not after.startswith(p_close):
        return None
    head = (*text[:i].split(FN), s0[: len(s0) - n])
    return Frame(head, after[len(p_close) :], True, p_open, s1, s3, p_close)


def _lit(text: str) -> str:
    return json.dumps(text, ensure_ascii=False) if text else ""


def _markup(text: str, control: ControlTokens) -> str:
    """A frame's literal markup in Lark: its control tokens by id (``<[id]>``: no literal
    text matches a control token), the rest as strings."""
    return " ".join(_lit(p) if isinstance(p, str) else f"<[{p}]>" for p in control.split(text))


def _json_island(schema: JsonObject) -> str:
    given = schema.get("x-guidance") or {}
    # not an object: left as it is, for llguidance to refuse (a 400, as outside a frame)
    s = {**schema, "x-guidance": {**JSON_OPTIONS, **given} if isinstance(given, dict) else given}
    return "%json " + json.dumps(s, separators=(",", ":"), ensure_ascii=False)


MAX_STRING = 256  # a raw string parameter without maxLength: bounded, as JSON numbers are


def _string(schema: JsonObject) -> str:
    """A raw (unquoted) string parameter: its enum, else text without ``<`` (the frames'
    markup starts with it) of at most maxLength characters."""
    enum = schema.get("enum")
    if isinstance(enum, list) and enum and all(isinstance(e, str) for e in enum):
        return "(" + " | ".join(_lit(str(e)) or '""' for e in enum) + ")"
    n = schema.get("maxLength")
    n = n if isinstance(n, int) and 0 <= n < MAX_STRING else MAX_STRING
    return f"/[^<]{{0,{n}}}/"


def _args_rule(f: Frame, tool: Tool, control: ControlTokens) -> str:
    if not f.params:
        return _json_island(tool.parameters)
    props = tool.parameters.get("properties") or {}
    props = props if isinstance(props, dict) else {}  # not an object: no parameters
    listed = tool.parameters.get("required") or []
    required = set(listed) if isinstance(listed, list) else set()
    parts = []
    p_open, p_close = _markup(f.p_open, control), _markup(f.p_close, control)
    for key, sub in props.items():
        sub = sub if isinstance(sub, dict) else {}
        if sub.get("type") == "string":
            value = f"{_markup(f.p_str, control)} {_string(sub)}" if f.p_str else _string(sub)
        else:
            island = _json_island(sub)
            value = f"{_markup(f.p_num, control)} {island}" if f.p_num else island
        item = f"{p_open} {_lit(key)} {value} {p_close}"
        parts.append(f"({item})" + ("" if key in required else "?"))
    return " ".join(parts) or '""'


def grammar(f: Frame, tools: list[Tool], control: ControlTokens = NO_CONTROL) -> str:
    """Lark (llguidance's dialect) for one call of one of ``tools`` in frame ``f`` (one: the
    frame holds the family's section markers, which a second call would not repeat); the
    markup's ``control`` tokens are named by id."""
    head = [_markup(h, control) for h in f.head]
    tail = _markup(f.tail, control)
    alts = [f" {_lit(t.name)} ".join(head) + f" {_args_rule(f, t, control)} {tail}" for t in tools]
    rule = "call: " + "\n    | ".join(a.strip() for a in alts)
    return f"start: call\n{rule}\n"


def text_of(f: Frame, name: str, args: JsonObject) -> str:
    """The text the grammar of ``f`` produces for this call (what the template renders for
    it, when the frame is right: the tests compare the two)."""
    if not f.params:
        return name.join(f.head) + json.dumps(args, ensure_ascii=False) + f.tail
    body = "".join(
        f.p_open
        + k
        + (f.p_str + v if isinstance(v, str) else f.p_num + json.dumps(v, ensure_ascii=False))
        + f.p_close
        for k, v in args.items()
    )
    return name.join(f.head) + body + f.tail
