"""Bounds a client's schema or grammar must keep before any compiler sees it.

llguidance recurses while it compiles: a ``$ref`` chain of a few thousand links, or a GBNF rule
chain of 4,000 rules, overflows its stack and ends the process (no exception to catch). So the
shape of every schema and grammar is measured here first, by iterative walks (no recursion of
our own either): JSON nesting plus ``$ref`` hops for a schema, rule-reference chains and
parenthesis nesting for a grammar, and the number of enum entries. What passes is compiled in
a child process (``worker``) anyway, so anything these bounds miss costs that process, never
the server. Each limit has a flag (``--constraint-max-*``) and the error names it."""

from __future__ import annotations

import re
from collections.abc import Callable, Hashable, Iterable, Iterator
from dataclasses import dataclass
from typing import TypeVar
from urllib.parse import unquote

from ..json_value import JsonObject, JsonValue


@dataclass(frozen=True)
class ConstraintLimits:
    """``max_bytes``: canonical schema / grammar text; ``max_depth``: nesting levels of a
    schema's JSON plus ``$ref`` hops on one path, or rule references on one chain of a grammar
    (and its parenthesis nesting); ``max_enum``: enum entries in one schema; ``timeout``:
    seconds one compile may take in the worker; ``workers``: compiling child processes;
    ``max_tools``: tools in one request."""

    max_bytes: int = 512 * 1024
    max_depth: int = 256
    max_enum: int = 4096
    timeout: float = 10.0
    workers: int = 2
    max_tools: int = 128


class ShapeError(ValueError):
    """A schema or grammar beyond one of the limits; the message names the limit's flag."""


N = TypeVar("N")  # a node of the graph _longest_path walks


# -- JSON schemas ------------------------------------------------------------------------


def _anchors(root: JsonValue) -> JsonObject:
    """``$id`` and ``$anchor`` names (``#name`` too) -> the subschema carrying them."""
    out: JsonObject = {}
    todo = [root]
    while todo:
        node = todo.pop()
        if isinstance(node, dict):
            for k in ("$id", "id", "$anchor", "$dynamicAnchor"):
                v = node.get(k)
                if isinstance(v, str) and v:
                    out.setdefault(v, node)
                    if k != "$id" and k != "id":
                        out.setdefault("#" + v, node)
            todo.extend(node.values())
        elif isinstance(node, list):
            todo.extend(node)
    return out


def _pointer(root: JsonValue, pointer: str) -> JsonValue:
    """The value a JSON pointer (``/a/b``, RFC 6901) names in ``root``; None when none."""
    node = root
    for raw in pointer.split("/")[1:]:
        part = unquote(raw).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict):
            node = node.get(part)
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _resolve(root: JsonValue, anchors: JsonObject, ref: str) -> JsonValue:
    """The subschema a ``$ref`` names, or None: ``#``, ``#/pointer``, ``#anchor``, an ``$id``
    (with or without a fragment)."""
    if ref in anchors:
        return anchors[ref]
    base, _, frag = ref.partition("#")
    node = anchors.get(base, root) if base else root
    if base and base not in anchors:
        return None
    if not frag:
        return node
    if frag.startswith("/"):
        return _pointer(node, frag)
    return anchors.get("#" + frag)


def _successors(node: JsonValue, root: JsonValue, anchors: JsonObject) -> Iterator[JsonValue]:
    """What a walk goes on to from ``node``: its JSON values that nest, and a ``$ref``'s target."""
    values = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
    for v in values:
        if isinstance(v, dict | list):
            yield v
    ref = node.get("$ref") if isinstance(node, dict) else None
    if isinstance(ref, str):
        target = _resolve(root, anchors, ref)
        if isinstance(target, dict | list):
            yield target


def _longest_path(
    root: N,
    successors: Callable[[N], Iterable[N]],
    key: Callable[[N], Hashable],
    limit: int,
) -> int:
    """The number of nodes on the longest path from ``root`` (iterative DFS: cycles are cut
    where they close, and a finished node's depth is remembered and added to any later path
    that reaches it, so each node is walked once). Returns a value above ``limit`` as soon as
    a path passes it."""
    done: dict[Hashable, int] = {}  # key -> nodes on the longest path below and including it
    best: dict[Hashable, int] = {key(root): 0}
    on_path = {key(root)}
    stack = [(root, iter(successors(root)))]
    while stack:
        node, it = stack[-1]
        child = next(it, None)
        if child is None:
            stack.pop()
            on_path.discard(key(node))
            d = 1 + best.pop(key(node))
            done[key(node)] = d
            if stack:
                parent = key(stack[-1][0])
                best[parent] = max(best[parent], d)
            continue
        k = key(child)
        if k in on_path:
            continue
        if k in done:
            best[key(node)] = max(best[key(node)], done[k])
            if len(stack) + done[k] > limit:
                return len(stack) + done[k]
            continue
        if len(stack) + 1 > limit:
            return len(stack) + 1
        on_path.add(k)
        best[k] = 0
        stack.append((child, iter(successors(child))))
    return done[key(root)]


def schema_depth(root: JsonValue, limit: int) -> int:
    """The longest path from ``root`` through nested JSON values and ``$ref`` hops (cycles cut
    where they close). Stops early and returns a value above ``limit`` as soon as a path
    passes it."""
    anchors = _anchors(root)
    return _longest_path(root, lambda n: _successors(n, root, anchors), id, limit)


def enum_entries(root: JsonValue) -> int:
    """How many ``enum`` entries the schema lists, in all its subschemas."""
    n = 0
    todo = [root]
    while todo:
        node = todo.pop()
        if isinstance(node, dict):
            e = node.get("enum")
            if isinstance(e, list):
                n += len(e)
            todo.extend(v for k, v in node.items() if k not in ("enum", "const", "default"))
        elif isinstance(node, list):
            todo.extend(node)
    return n


def check_schema_shape(schema: JsonValue, limits: ConstraintLimits) -> None:
    """ShapeError unless the schema keeps ``max_depth`` and ``max_enum``."""
    depth = schema_depth(schema, limits.max_depth)
    if depth > limits.max_depth:
        raise ShapeError(
            f"nested or chained through $ref more than {limits.max_depth} levels deep "
            f"(--constraint-max-depth)"
        )
    n = enum_entries(schema)
    if n > limits.max_enum:
        raise ShapeError(f"{n} enum entries, more than {limits.max_enum} (--constraint-max-enum)")


# -- GBNF grammars -----------------------------------------------------------------------

# One GBNF token: a string, a character class, a comment, a repetition count, a name, the
# definition sign, a parenthesis, or any other character.
_GBNF_TOKEN = re.compile(
    r'"(?:\\.|[^"\\])*"|\[(?:\\.|[^\]\\])*\]|#[^\n]*|\{[^}]*\}|[A-Za-z0-9_-]+|::=|[()]|\S'
)


def _gbnf_rules(text: str) -> tuple[dict[str, set[str]], int]:
    """Each rule's referenced names, and the deepest parenthesis nesting in the grammar."""
    rules: dict[str, set[str]] = {}
    current: set[str] | None = None
    nest = deepest = 0
    tokens = [m.group() for m in _GBNF_TOKEN.finditer(text)]
    for i, tok in enumerate(tokens):
        if tok == "(":
            nest += 1
            deepest = max(deepest, nest)
        elif tok == ")":
            nest = max(nest - 1, 0)
        elif tok[0].isalnum() or tok[0] in "_-":
            if i + 1 < len(tokens) and tokens[i + 1] == "::=":
                current = rules.setdefault(tok, set())
            elif current is not None:
                current.add(tok)
    return rules, deepest


def gbnf_depth(text: str, limit: int) -> int:
    """The longest chain of rule references from ``root`` (cycles cut where they close), or
    the deepest parenthesis nesting if that is more. Stops early above ``limit``."""
    rules, deepest = _gbnf_rules(text)
    if deepest > limit or "root" not in rules:
        return deepest
    chain = _longest_path("root", lambda n: (r for r in rules[n] if r in rules), str, limit)
    return max(chain, deepest)


def check_grammar_shape(text: str, limits: ConstraintLimits) -> None:
    """ShapeError unless the grammar's rule chains and nesting keep ``max_depth``."""
    if gbnf_depth(text, limits.max_depth) > limits.max_depth:
        raise ShapeError(
            f"rules chained or nested more than {limits.max_depth} levels deep "
            f"(--constraint-max-depth)"
        )
