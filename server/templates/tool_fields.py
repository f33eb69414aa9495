"""The tool fields of a chat request, checked: ``tools``, ``tool_choice``,
``parallel_tool_calls``; and the JSON schema that forces a call in each output format."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ..constrained.limits import ShapeError, check_schema_shape
from ..constrained.worker import limits
from ..json_value import JsonObject, JsonValue
from .output_parse import ToolFormat

_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
EMPTY_PARAMETERS: JsonObject = {"type": "object", "properties": {}}


class ToolSpecError(ValueError):
    """A malformed ``tools`` / ``tool_choice`` (the route answers 400)."""


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: JsonObject

    def as_openai(self) -> JsonObject:
        """The Hugging Face / OpenAI form templates take: ``{"type": "function", ...}``."""
        fn: JsonObject = {"name": self.name}
        if self.description:
            fn["description"] = self.description
        fn["parameters"] = self.parameters
        return {"type": "function", "function": fn}


@dataclass(frozen=True)
class ToolSpec:
    """A request's tools. ``choice``: none, auto, required, or function (``forced_name``)."""

    tools: list[Tool] = field(default_factory=list)
    choice: str = "auto"
    forced_name: str = ""
    parallel: bool = False

    @property
    def parse_calls(self) -> bool:
        """Whether the output is parsed for calls (tools given and choice is not none)."""
        return bool(self.tools) and self.choice != "none"

    @property
    def forced(self) -> bool:
        """Whether decoding is constrained to a call (required or a named function)."""
        return bool(self.tools) and self.choice in ("required", "function")


def _tool(raw: JsonValue, i: int) -> Tool:
    where = f"tools[{i}]"
    if not isinstance(raw, dict):
        raise ToolSpecError(f"{where} must be an object")
    if raw.get("type", "function") != "function":
        raise ToolSpecError(f"{where}.type {raw.get('type')!r} is not supported (only 'function')")
    fn = raw.get("function")
    if not isinstance(fn, dict):
        raise ToolSpecError(f"{where}.function must be an object")
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise ToolSpecError(
            f"{where}.function.name must be 1-64 characters of a-z, A-Z, 0-9, '_', '.', '-'"
        )
    desc = fn.get("description", "") or ""
    if not isinstance(desc, str):
        raise ToolSpecError(f"{where}.function.description must be a string")
    params = fn.get("parameters")
    if params is None:
        params = EMPTY_PARAMETERS
    if not isinstance(params, dict):
        raise ToolSpecError(f"{where}.function.parameters must be a JSON schema object")
    return Tool(name, desc, params)


def _choice(raw: JsonValue, names: set[str]) -> tuple[str, str]:
    if raw is None:
        return "auto", ""
    if isinstance(raw, str):
        if raw not in ("none", "auto", "required"):
            raise ToolSpecError(
                f"tool_choice must be 'none', 'auto', 'required' or a function, not {raw!r}"
            )
        if raw == "required" and not names:
            raise ToolSpecError("tool_choice 'required' needs tools")
        return raw, ""
    fn = raw.get("function") if isinstance(raw, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(raw, dict) or raw.get("type") != "function" or not isinstance(name, str):
        raise ToolSpecError('tool_choice must be {"type": "function", "function": {"name": ...}}')
    if name not in names:
        raise ToolSpecError(f"tool_choice names the function {name!r}, which is not in tools")
    return "function", name


def tool_spec(tools: JsonValue, tool_choice: JsonValue, parallel: JsonValue) -> ToolSpec:
    """The checked tool fields; ToolSpecError names the offending field."""
    if tools is None:
        tools = []
    if not isinstance(tools, list):
        raise ToolSpecError("tools must be an array")
    lim = limits()
    if len(tools) > lim.max_tools:
        raise ToolSpecError(f"at most {lim.max_tools} tools (--constraint-max-tools)")
    parsed = [_tool(t, i) for i, t in enumerate(tools)]
    for i, t in enumerate(parsed):
        try:  # the template renders them (recursively): bounded before it does
            check_schema_shape(t.parameters, lim)
        except ShapeError as e:
            raise ToolSpecError(f"tools[{i}].function.parameters: {e}") from None
    names = [t.name for t in parsed]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise ToolSpecError(f"tools has duplicate function names: {', '.join(sorted(dup))}")
    choice, name = _choice(tool_choice, set(names))
    if parallel is not None and not isinstance(parallel, bool):
        raise ToolSpecError("parallel_tool_calls must be a boolean")
    # Absent means false, as llama-server has it for templates without parallel-call
    # support: a forced call is then exactly one (a weak model would repeat calls).
    return ToolSpec(parsed, choice, name, bool(parallel))


# ---- forcing a call -------------------------------------------------------------------


def _call_schema(tool: Tool, args_key: str) -> JsonObject:
    return {
        "type": "object",
        "properties": {"name": {"const": tool.name}, args_key: tool.parameters},
        "required": ["name", args_key],
        "additionalProperties": False,
    }


def _one_of(schemas: list[JsonObject]) -> JsonObject:
    return schemas[0] if len(schemas) == 1 else {"anyOf": [*schemas]}


@dataclass(frozen=True)
class CallConstraint:
    """A JSON schema with the literal text around it: what decoding is held to."""

    schema: JsonObject
    prefix: str = ""
    suffix: str = ""


def forced_call(spec: ToolSpec, fmt: ToolFormat) -> CallConstraint:
    """The output shape that makes the answer a call of one of ``spec``'s tools (the named
    one for a named choice) in format ``fmt``, with arguments valid against its parameters.

    Generic and Mistral hold a list: with ``parallel`` one or more calls, else exactly one.
    Hermes and Llama 3 force one call (their multi-call forms have no single JSON value)."""
    tools = [t for t in spec.tools if spec.choice != "function" or t.name == spec.forced_name]
    args_key = "parameters" if fmt is ToolFormat.LLAMA3 else "arguments"
    call = _one_of([_call_schema(t, args_key) for t in tools])
    array: JsonObject = {"type": "array", "items": call, "minItems": 1}
    if not spec.parallel:
        array["maxItems"] = 1
    if fmt is ToolFormat.GENERIC:
        schema: JsonObject = {
            "type": "object",
            "properties": {"tool_calls": array},
            "required": ["tool_calls"],
            "additionalProperties": False,
        }
        return CallConstraint(schema)
    if fmt is ToolFormat.MISTRAL:
        return CallConstraint(array)
    if fmt is ToolFormat.HERMES:
        return CallConstraint(call, "<tool_call>\n", "\n</tool_call>")
    return CallConstraint(call)
