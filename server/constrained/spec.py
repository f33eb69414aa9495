"""Checked, vocabulary-free constraints: a JSON schema, any JSON object, a GBNF or Lark grammar.

Every constructor measures its input against the limits (``limits``: size, depth, enum
entries), then has a compile child (``worker``) turn it into llguidance's grammar text and
validate it (no vocabulary needed, well under a millisecond for the schemas agents send), so
a bad schema is a ``ConstraintError`` (a 400) before a task exists, and one that would crash
or freeze the compiler costs a child process, never the server. The constructors block:
call them from a worker thread, never the event loop. Results, failures included, are kept
in an LRU cache keyed by the canonical text: an agent loop that resends the same schema
checks it once."""

from __future__ import annotations

import collections
import json
import threading
from collections.abc import Callable

from llguidance import LLMatcher, grammar_from

from ..json_value import JsonObject, JsonValue
from ..types import Constraint
from .limits import ShapeError, check_grammar_shape, check_schema_shape
from .worker import CompileRequest, limits, pool

# JSON whitespace between tokens is bounded, as llama.cpp's schema converter bounds it
# (``space ::= | " " | "\n"{1,2} [ \t]{0,20}``): a weak model that keeps choosing blanks must
# still come to the next token of the document.
WHITESPACE = r"(?:\x20|\x0A{1,2}[\x20\x09]{0,20})?"
JSON_OPTIONS: JsonObject = {"whitespace_pattern": WHITESPACE}

MAX_NUMBER = 2**53 - 1  # largest integer a JSON number holds exactly (JavaScript's safe integer)
CACHE_SIZE = 256  # distinct schemas/grammars whose check (or failure) is remembered

# Keywords whose value is one subschema, or a list / name map of subschemas: where the
# error search (``_locate``) looks for the offending part.
_ONE = ("additionalProperties", "items", "contains", "propertyNames", "not", "if", "then", "else")
_LIST = ("anyOf", "oneOf", "allOf", "prefixItems")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


class ConstraintError(ValueError):
    """A schema or grammar that cannot be compiled. ``where`` names the offending part: a JSON
    pointer into the schema (``#/properties/age/type``), ``#`` for the schema as a whole, or
    ``grammar`` for a grammar; ``reason`` is the compiler's message."""

    def __init__(self, where: str, reason: str) -> None:
        super().__init__(f"{where}: {reason}")
        self.where = where
        self.reason = reason


def _check(grammar: str, where: str) -> None:
    """ConstraintError(where, why) unless llguidance accepts ``grammar``."""
    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, None)
    if is_error:
        raise ConstraintError(where, messages[0] if messages else "invalid")


def _canonical(value: JsonValue) -> str:
    """Compact JSON text. Key order is kept: it is the order properties are generated in,
    so two schemas that differ only in order are different constraints."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _with_options(schema: JsonObject) -> JsonObject:
    """The schema as compiled (``_normalized``), with the server's JSON options (bounded
    whitespace) in ``x-guidance``."""
    schema = _normalized(schema)
    own = schema.get("x-guidance") or {}
    if not isinstance(own, dict):  # what ** says of it (the callers report TypeErrors)
        raise TypeError(f"'{type(own).__name__}' object is not a mapping")
    return {**schema, "x-guidance": {**JSON_OPTIONS, **own}}


# keywords that make a schema without "type" something else than a plain array/object
_NOT_INFERRED = ("type", "anyOf", "oneOf", "allOf", "enum", "const", "$ref", "not")


def _normalized(node: JsonObject) -> JsonObject:
    """A copy of ``node`` (and of its subschemas, never of enum/const/default values) that
    only narrows what it accepts, as llama.cpp's schema converter reads schemas:

    - numbers without a bound get +-MAX_NUMBER: an unbounded integer lets a weak model write
      digits until max_tokens ("2000000..."); bounded, it has at most 16 digits;
    - a draft-04 tuple (``items`` a list) becomes ``prefixItems`` with ``additionalItems``
      (default: none) as ``items``; a tuple holds all its items (``minItems`` its length,
      unless the schema sets one), as llama.cpp writes exactly those;
    - without a ``type``, ``properties`` make an object and ``items`` an array."""
    out = dict(node)
    if not any(k in node for k in _NOT_INFERRED):
        if "properties" in node:
            out["type"] = "object"
        elif "items" in node or "prefixItems" in node:
            out["type"] = "array"
    if isinstance(node.get("items"), list) and "prefixItems" not in node:
        out["prefixItems"] = node["items"]
        out["items"] = out.pop("additionalItems", False)
    if isinstance(prefix := out.get("prefixItems"), list):
        out.setdefault("minItems", len(prefix))
    _bound_numbers(out)
    for k in _ONE:
        if isinstance(v := out.get(k), dict):
            out[k] = _normalized(v)
    for k in _LIST:
        if isinstance(v := out.get(k), list):
            out[k] = [_normalized(x) if isinstance(x, dict) else x for x in v]
    for k in _MAP:
        if isinstance(v := out.get(k), dict):
            out[k] = {n: _normalized(x) if isinstance(x, dict) else x for n, x in v.items()}
    return out


def _bound_numbers(node: JsonObject) -> None:
    """Give a numeric schema without a bound +-MAX_NUMBER (in place); a bound the schema
    sets beyond ours wins (no empty range of our making)."""
    types = node.get("type")
    types = [types] if isinstance(types, str) else types if isinstance(types, list) else []
    if "integer" not in types and "number" not in types:
        return
    lo = node.get("minimum", node.get("exclusiveMinimum"))
    hi = node.get("maximum", node.get("exclusiveMaximum"))
    if lo is None and not (isinstance(hi, int | float) and hi < -MAX_NUMBER):
        node["minimum"] = -MAX_NUMBER
    if hi is None and not (isinstance(lo, int | float) and lo > MAX_NUMBER):
        node["maximum"] = MAX_NUMBER


def _schema_error(schema: JsonObject) -> str:
    """llguidance's complaint about ``schema`` alone, or "" when it compiles."""
    try:
        grammar = LLMatcher.grammar_from_json_schema(_with_options(schema))
    except (ValueError, TypeError) as e:
        return str(e)
    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, None)
    return (messages[0] if messages else "invalid") if is_error else ""


def _children(node: JsonObject) -> list[tuple[str, JsonObject]]:
    """(pointer suffix, subschema) for every subschema directly under ``node``."""
    out: list[tuple[str, object]] = []
    for k in _ONE:
        v = node.get(k)
        if isinstance(v, dict):
            out.append((f"/{k}", v))
        elif k == "items" and isinstance(v, list):
            out += [(f"/items/{i}", s) for i, s in enumerate(v)]
    for k in _LIST:
        v = node.get(k)
        if isinstance(v, list):
            out += [(f"/{k}/{i}", s) for i, s in enumerate(v)]
    for k in _MAP:
        v = node.get(k)
        if isinstance(v, dict):
            out += [(f"/{k}/{_escape(name)}", s) for name, s in v.items()]
    return [(p, s) for p, s in out if isinstance(s, dict)]


def _escape(name: str) -> str:
    """A JSON-pointer reference token (RFC 6901)."""
    return name.replace("~", "~0").replace("/", "~1")


def _locate(root: JsonObject, reason: str) -> str:
    """The JSON pointer of the deepest subschema that fails alone with the same ``reason``
    as the whole schema (``#`` when only the whole fails that way). A subschema is checked
    with the root's ``$defs``/``definitions`` beside it, so its references still resolve."""
    defs: JsonObject = {k: root[k] for k in ("$defs", "definitions") if k in root}
    where, node = "#", root
    while True:
        for suffix, child in _children(node):
            if _schema_error({**defs, **child}) == reason:
                where, node = where + suffix, child
                break
        else:
            return where


def compile_schema(canon: str, prefix: str, suffix: str) -> str:
    """llguidance's grammar for the schema ``canon`` (with literal ``prefix``/``suffix`` text
    around it), checked; ConstraintError naming the offending subschema. The slow, native
    step: runs in a compile child (``worker``), never in the server."""
    schema = json.loads(canon)
    reason = _schema_error(schema)
    if reason:
        raise ConstraintError(_locate(schema, reason), reason)
    if not (prefix or suffix):
        return LLMatcher.grammar_from_json_schema(_with_options(schema))
    # Lark with a JSON island: the literal text around one schema-shaped value.
    parts = [json.dumps(prefix)] if prefix else []
    parts.append("%json " + _canonical(_with_options(schema)))
    if suffix:
        parts.append(json.dumps(suffix))
    grammar = LLMatcher.grammar_from_lark("start: " + " ".join(parts))
    _check(grammar, "#")
    return grammar


def compile_grammar(kind: str, text: str) -> str:
    """llguidance's grammar for a GBNF or Lark text, checked; ConstraintError("grammar", why).
    Runs in a compile child, like ``compile_schema``."""
    try:
        grammar = grammar_from("gbnf" if kind == "gbnf" else "lark", text)
    except ValueError as e:
        raise ConstraintError("grammar", str(e)) from None
    _check(grammar, "grammar")
    return grammar


# Checked constraints and failures, by (kind, canonical text): an agent loop that resends a
# schema checks it once, and so does an attacker resending a slow failing one.
_results: collections.OrderedDict[tuple[str, ...], Constraint | ConstraintError] = (
    collections.OrderedDict()
)
_results_lock = threading.Lock()


def _remembered(key: tuple[str, ...], make: Callable[[], Constraint]) -> Constraint:
    """``make()``'s Constraint or ConstraintError for ``key``, computed once (LRU)."""
    with _results_lock:
        hit = _results.get(key)
        if hit is not None:
            _results.move_to_end(key)
    if hit is None:
        try:
            hit = make()
        except ConstraintError as e:
            hit = e
        with _results_lock:
            _results[key] = hit
            while len(_results) > CACHE_SIZE:
                _results.popitem(last=False)
    if isinstance(hit, ConstraintError):
        raise ConstraintError(hit.where, hit.reason)
    return hit


def _in_child(request: CompileRequest, where: str) -> str:
    """The grammar a compile child makes of ``request``; ConstraintError when it fails, dies
    or overruns (``where`` is used when the child could not say)."""
    answer = pool().run(request)
    if "grammar" in answer:
        return answer["grammar"]
    raise ConstraintError(answer.get("where") or where, answer["reason"])


def _schema_constraint(canon: str, prefix: str, suffix: str) -> Constraint:
    def make() -> Constraint:
        request = {"op": "schema", "canon": canon, "prefix": prefix, "suffix": suffix}
        grammar = _in_child(request, "#")
        key = canon if not (prefix or suffix) else _canonical([prefix, canon, suffix])
        return Constraint("json_schema", key, grammar)

    return _remembered(("json_schema", canon, prefix, suffix), make)


def json_schema_constraint(schema: JsonObject, *, prefix: str = "", suffix: str = "") -> Constraint:
    """Output is one JSON value valid against ``schema`` (JSON Schema as llguidance
    implements it: types, properties/required/additionalProperties, items/prefixItems,
    enum/const, anyOf/oneOf/allOf, $ref/$defs, string length/pattern/format, numeric
    bounds), with ``prefix`` text before and ``suffix`` text after it when given.

    Raises ConstraintError(where, reason) for a schema that cannot be compiled (an
    unsupported keyword, a bad pattern, a dangling $ref, an unsatisfiable part, too large),
    ``where`` being the JSON pointer of the offending subschema. Cached by canonical text."""
    if not isinstance(schema, dict):
        raise ConstraintError("#", "the schema must be a JSON object")
    lim = limits()
    try:  # first, as _canonical and _normalized recurse: the depth is bounded from here on
        check_schema_shape(schema, lim)
    except ShapeError as e:
        raise ConstraintError("#", str(e)) from None
    canon = _canonical(schema)
    if len(canon) + len(prefix) + len(suffix) > lim.max_bytes:
        raise ConstraintError(
            "#", f"the schema is larger than {lim.max_bytes} bytes (--constraint-max-bytes)"
        )
    return _schema_constraint(canon, prefix, suffix)


def json_object_constraint() -> Constraint:
    """Output is one JSON object (any keys and values): OpenAI's ``json_object`` mode."""
    return _schema_constraint(_canonical({"type": "object"}), "", "")


def _grammar_constraint(kind: str, text: str) -> Constraint:
    lim = limits()
    if len(text) > lim.max_bytes:
        raise ConstraintError(
            "grammar", f"the grammar is larger than {lim.max_bytes} bytes (--constraint-max-bytes)"
        )
    try:
        check_grammar_shape(text, lim)
    except ShapeError as e:
        raise ConstraintError("grammar", str(e)) from None

    def make() -> Constraint:
        grammar = _in_child({"op": "grammar", "kind": kind, "text": text}, "grammar")
        return Constraint(kind, text, grammar)

    return _remembered((kind, text), make)


def gbnf_constraint(text: str) -> Constraint:
    """Output follows a GBNF grammar (llama.cpp's syntax, start rule ``root``). Raises
    ConstraintError("grammar", reason) for one that cannot be compiled; the reason names
    the rule or line. Cached by text."""
    return _grammar_constraint("gbnf", text)


def lark_constraint(text: str) -> Constraint:
    """Output follows a Lark grammar in llguidance's dialect (start rule ``start``; ``%json
    {schema}`` embeds a JSON schema; ``<[id]>`` or ``<token>`` matches a special token).
    Raises ConstraintError("grammar", reason). Cached by text."""
    return _grammar_constraint("lark", text)
