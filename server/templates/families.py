"""Tool-call and reasoning families, recognised from a chat template's own text (never from
the model's name), as llama.cpp's ``common/chat.cpp`` tells them apart.

A ``Family`` is data: the ``detect`` regex on the template source, the markers that open and
close a region of calls in the output, the regex of one call inside the region (its name, and
its arguments as JSON or as a body of parameters), the regex of one parameter, and the
family's reasoning tags. ``regions.RegionParser`` reads any family from this data.

Hermes, Llama 3 and Mistral (``parse.ToolFormat``) keep their JSON parsers; they appear here
for detection and reasoning only (``fmt`` names the ToolFormat).

``reasoning_end_tag(source)``: the tag that ends a template's reasoning (``</think>``,
``<|end|>`` for Harmony, ...), what a reasoning budget forces when it is spent.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_S = re.S


@dataclass(frozen=True)
class Family:
    """One call syntax. ``opens``/``closes``: literal markers around a region of calls
    (``closes`` empty: the region runs to the end of the output); ``call``: one call in the
    region, groups ``name`` and ``args`` (JSON text) or ``body`` (parameters, read with
    ``param``: groups ``key``, ``value`` and optionally ``str`` / ``type`` telling a raw
    string from a JSON value); ``body`` kinds: ``json`` (a JSON value of calls, keys
    ``name_key``/``args_key``; ``name_key`` empty: ``{name: args}``), ``python``
    (``[f(a=1), ...]``), ``gemma`` (``{k:<|"|>v<|"|>}``)."""

    name: str
    detect: re.Pattern[str]
    opens: tuple[str, ...] = ()
    closes: tuple[str, ...] = ()
    call: re.Pattern[str] | None = None
    param: re.Pattern[str] | None = None
    body: str = ""
    name_key: str = "name"
    args_key: str = "arguments"
    think: tuple[str, str] = ("<think>", "</think>")
    fmt: str = ""  # a parse.ToolFormat value: that JSON parser reads the calls
    parallel: bool = True


def _c(p: str) -> re.Pattern[str]:
    return re.compile(p, _S)


_XML_PARAM = _c(r"<parameter=(?P<key>[^>\n]+)>\n?(?P<value>.*?)\n?</parameter>")
_INVOKE_PARAM = r"<{p}parameter name=\"(?P<key>[^\"]+)\"(?: string=\"(?P<str>true|false)\")?>(?P<value>.*?)</{p}parameter>"
_GLM_PARAM = _c(r"<arg_key>(?P<key>.*?)</arg_key>\s*<arg_value>(?P<value>.*?)</arg_value>")


def _invoke(prefix: str) -> tuple[re.Pattern[str], re.Pattern[str]]:
    p = re.escape(prefix)
    call = _c(rf"<{p}invoke name=\"(?P<name>[^\"]+)\">(?P<body>.*?)</{p}invoke>")
    return call, _c(_INVOKE_PARAM.format(p=p))


_MINIMAX = _invoke("")
_DSML = _invoke("｜DSML｜")
_ATEM = _invoke("atem:")

# Order matters: the first family whose ``detect`` matches wins (more specific first).
FAMILIES: tuple[Family, ...] = (
    Family(
        "gpt-oss",
        _c(r"<\|channel\|>"),
        think=("<|channel|>analysis<|message|>", "<|end|>"),
    ),
    Family(
        "seed-oss",
        _c(r"<seed:tool_call>"),
        ("<seed:tool_call>",),
        ("</seed:tool_call>",),
        _c(r"<function=(?P<name>[^>\n]+)>(?P<body>.*?)</function>"),
        _XML_PARAM,
        think=("<seed:think>", "</seed:think>"),
    ),
    Family(
        "qwen3-coder",
        _c(r"<function=.*<parameter="),
        ("<tool_call>",),
        ("</tool_call>",),
        _c(r"<function=(?P<name>[^>\n]+)>(?P<body>.*?)</function>"),
        _XML_PARAM,
    ),
    Family(
        "hy3",
        _c(r"<arg_key:opensource>"),
        ("<tool_call:opensource>",),
        ("</tool_call:opensource>",),
        _c(
            r"<tool_call:opensource>\s*(?P<name>[^\s<]+)\s*<tool_sep:opensource>(?P<body>.*?)</tool_call:opensource>"
        ),
        _c(
            r"<arg_key:opensource>(?P<key>.*?)</arg_key:opensource>\s*<arg_value:opensource>(?P<value>.*?)</arg_value:opensource>"
        ),
        think=("<think:opensource>", "</think:opensource>"),
    ),
    Family(
        "glm",
        _c(r"<arg_key>"),
        ("<tool_call>",),
        ("</tool_call>",),
        _c(r"<tool_call>\s*(?P<name>[^\s<]+)(?P<body>.*?)</tool_call>"),
        _GLM_PARAM,
    ),
    Family(
        "minimax-m2",
        _c(r"<minimax:tool_call>"),
        ("<minimax:tool_call>",),
        ("</minimax:tool_call>",),
        *_MINIMAX,
    ),
    Family(
        "minimax-m3",
        _c(r"\]<\]minimax\[>\[<tool_call>"),
        ("]<]minimax[>[<tool_call>",),
        ("]<]minimax[>[</tool_call>",),
        _c(r"<invoke name=\"(?P<name>[^\"]+)\">(?P<body>.*?)\]<\]minimax\[>\[</invoke>"),
        _c(r"<(?P<key>[^<>/\s]+)>(?P<value>.*?)\]<\]minimax\[>\[</(?P=key)>"),
        think=("<mm:think>", "</mm:think>"),
    ),
    Family(
        "deepseek-dsml",
        _c(r"｜DSML｜"),
        ("<｜DSML｜function_calls>", "<｜DSML｜tool_calls>"),
        ("</｜DSML｜function_calls>", "</｜DSML｜tool_calls>"),
        *_DSML,
    ),
    Family(
        "atem",
        _c(r"<atem:function_calls>"),
        ("<atem:function_calls>",),
        ("</atem:function_calls>",),
        *_ATEM,
    ),
    Family(
        "deepseek-r1",
        _c(r"<｜tool▁calls▁begin｜>"),
        ("<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>"),
        ("<｜tool▁calls▁end｜>",),
        _c(
            r"<｜tool▁call▁begin｜>(?:function)?(?:<｜tool▁sep｜>)?(?P<name>[^\n<]+?)\s*"
            r"(?:<｜tool▁sep｜>)?(?:```json)?\s*(?P<args>\{.*?\})\s*(?:```)?\s*<｜tool▁call▁end｜>"
        ),
    ),
    Family(
        "kimi-k2",
        _c(r"<\|tool_calls_section_begin\|>"),
        ("<|tool_calls_section_begin|>",),
        ("<|tool_calls_section_end|>",),
        _c(
            r"<\|tool_call_begin\|>\s*(?P<id>(?:functions\.)?(?P<name>[\w.\-]+?)(?::\d+)?)\s*"
            r"<\|tool_call_argument_begin\|>(?P<args>.*?)<\|tool_call_end\|>"
        ),
    ),
    Family(
        "kimi-k3",
        _c(r"<\|open\|>call tool="),
        ("<|open|>tools<|sep|>",),
        ("<|close|>tools<|sep|>",),
        _c(
            r"<\|open\|>call tool=\"(?P<name>[^\"]+)\"[^<]*<\|sep\|>(?P<body>.*?)<\|close\|>call<\|sep\|>"
        ),
        _c(
            r"<\|open\|>argument key=\"(?P<key>[^\"]+)\" type=\"(?P<type>\w+)\"<\|sep\|>"
            r"(?P<value>.*?)<\|close\|>argument<\|sep\|>"
        ),
        think=("<|open|>think<|sep|>", "<|close|>think<|sep|>"),
    ),
    Family(
        "solar-open",
        _c(r"<\|tool_call:begin\|>"),
        ("<|tool_calls|>", "<|tool_call:begin|>"),
        ("<|calls|>",),
        _c(
            r"<\|tool_call:begin\|>(?P<id>[^<]*)<\|tool_call:name\|>(?P<name>[^<]+)"
            r"<\|tool_call:args\|>(?P<args>.*?)<\|tool_call:end\|>"
        ),
    ),
    Family(
        "minicpm5",
        _c(r"<function name=.*<param name="),
        ('<function name="',),
        ("</function>",),
        _c(r"<function name=\"(?P<name>[^\"]+)\">(?P<body>.*?)</function>"),
        _c(r"<param name=\"(?P<key>[^\"]+)\">(?P<value>.*?)</param>"),
    ),
    Family(
        "gemma4",
        _c(r"<\|tool_call>"),
        ("<|tool_call>",),
        ("<tool_call|>",),
        _c(r"<\|tool_call>call:(?P<name>[\w.\-]+)(?P<body>\{.*?\})<tool_call\|>"),
        body="gemma",
        think=("<|channel>thought", "<channel|>"),
    ),
    Family(
        "lfm2",
        _c(r"<\|tool_call_start\|>|List of tools: (?:<\|tool_list_start\|>)?\["),
        ("<|tool_call_start|>",),
        ("<|tool_call_end|>",),
        _c(r"<\|tool_call_start\|>(?P<body>.*?)<\|tool_call_end\|>"),
        body="python",
    ),
    Family(
        "command-r7b",
        _c(r"<\|START_ACTION\|>"),
        ("<|START_ACTION|>",),
        ("<|END_ACTION|>",),
        _c(r"<\|START_ACTION\|>(?P<body>.*?)<\|END_ACTION\|>"),
        body="json",
        name_key="tool_name",
        args_key="parameters",
        think=("<|START_THINKING|>", "<|END_THINKING|>"),
    ),
    Family(
        "command-r-plus",
        _c(r"Action:\s*```json"),
        ("Action:",),
        ("```\n", "```"),
        _c(r"Action:\s*```json(?P<body>.*?)```"),
        body="json",
        name_key="tool_name",
        args_key="parameters",
    ),
    Family(
        "apertus",
        _c(r"<\|tools_prefix\|>"),
        ("<|tools_prefix|>",),
        ("<|tools_suffix|>",),
        _c(r"<\|tools_prefix\|>(?P<body>.*?)<\|tools_suffix\|>"),
        body="json",
        name_key="",
        think=("<|inner_prefix|>", "<|inner_suffix|>"),
    ),
    Family(
        "nemotron-v2",
        _c(r"<TOOLCALL>"),
        ("<TOOLCALL>",),
        ("</TOOLCALL>",),
        _c(r"<TOOLCALL>(?P<body>.*?)</TOOLCALL>"),
        body="json",
    ),
    Family(
        "apriel",
        _c(r"<tool_calls>"),
        ("<tool_calls>",),
        ("</tool_calls>",),
        _c(r"<tool_calls>(?P<body>.*?)</tool_calls>"),
        body="json",
        think=("Here are my reasoning steps:\n", "[BEGIN FINAL RESPONSE]"),
    ),
    Family(
        "granite-3",
        _c(r"<\|tool_call\|>"),
        ("<|tool_call|>",),
        (),
        _c(r"<\|tool_call\|>(?P<body>.*)"),
        body="json",
    ),
    Family(
        "firefunction-v2",
        _c(r" functools\["),
        (" functools[", "functools["),
        (),
        _c(r"functools(?P<body>\[.*)"),
        body="json",
    ),
    Family(
        "gigachat3.1",
        _c(r"<\|function_call\|>"),
        ("<|function_call|>",),
        (),
        _c(r"<\|function_call\|>(?P<body>.*)"),
        body="json",
    ),
    Family(
        "gigachat3",
        _c(r"function call<\|role_sep\|>"),
        ("<|message_sep|>\n\nfunction call<|role_sep|>", "function call<|role_sep|>"),
        (),
        _c(r"function call<\|role_sep\|>(?P<body>.*)"),
        body="json",
    ),
    Family(
        "functionary-v3.2",
        _c(r">>>all"),
        (">>>",),
        (),
        _c(r"(?:>>>)?(?P<name>[\w.\-]+)\n(?P<args>\{.*?\})(?=\s*>>>|\s*$)"),
    ),
    Family(
        "functionary-v3.1",
        _c(r"<function="),
        ("<function=",),
        ("</function>",),
        _c(r"<function=(?P<name>[^>]+)>(?P<args>.*?)</function>"),
    ),
    Family("mistral", _c(r"\[TOOL_CALLS\]"), fmt="mistral", think=("[THINK]", "[/THINK]")),
    Family("hermes", _c(r"<tool_call>"), fmt="hermes"),
    Family("llama3", _c(r"<\|python_tag\|>|\"parameters\""), fmt="llama3"),
)

BY_NAME = {f.name: f for f in FAMILIES}


def detect_family(source: str, probe: str = "") -> Family | None:
    """The family of a template's tool calls, by its text and ``probe`` (what it renders of
    a conversation holding a call: markers some templates assemble from pieces); None when
    it writes none known."""
    text = source + "\n" + probe
    for f in FAMILIES:
        if f.detect.search(text):
            return f
    return None


def reasoning_tags(source: str) -> tuple[str, str]:
    """(open, close) reasoning tags of a template: its family's, else ``<think>``."""
    f = detect_family(source)
    if f is not None and f.think[0] in source:
        return f.think
    for open_, close in (("<seed:think>", "</seed:think>"), ("[THINK]", "[/THINK]")):
        if open_ in source:
            return open_, close
    return "<think>", "</think>"


def reasoning_end_tag(source: str) -> str:
    """The tag that ends reasoning for this template (``</think>`` unless its family has
    its own): what a spent reasoning budget forces, after its message."""
    return reasoning_tags(source)[1]
