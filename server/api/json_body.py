"""The one bounded JSON parser for bodies that a route reads by hand (the router's body model,
``/predict``, ``POST /lora-adapters``, slot actions): the same limits as the bodies FastAPI
parses for the typed routes, answered with a 400 ``APIError`` instead of a 500.

Size is bounded before this runs (``middleware.BodyLimit``); depth is bounded here. Python's
``json`` decoder (C) recurses once per nesting level and raises ``RecursionError`` near the
interpreter's recursion limit, which is answered as a 400 here; what it decodes is then walked
iteratively (no recursion, linear in the number of values) and refused deeper than
``max_depth``, so no later recursive code (pydantic, the template) meets a deeper value.
"""

from __future__ import annotations

import json

from .errors import APIError

# Deeper than any real request body (OpenAI's schemas nest a few levels; JSON schemas inside
# ``response_format`` are bounded separately by --constraint-max-depth, 256 by default).
MAX_DEPTH = 512


def json_depth(value: object, limit: int | None = None) -> int:
    """The deepest nesting of lists and dicts in ``value`` (0 for a scalar); stops early and
    returns ``limit + 1`` once ``limit`` is exceeded."""
    deepest = 0
    stack: list[tuple[object, int]] = [(value, 0)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict):
            v = v.values()
        elif not isinstance(v, list):
            continue
        d += 1
        if d > deepest:
            deepest = d
            if limit is not None and d > limit:
                return d
        stack.extend((c, d) for c in v if isinstance(c, (dict, list)))
    return deepest


def parse_json_body(raw: bytes | str, max_depth: int = MAX_DEPTH, empty: object = None) -> object:
    """``raw`` decoded, or ``empty`` when it is empty. Raises ``APIError(400)`` when it is not
    JSON or nests deeper than ``max_depth``; never ``RecursionError``."""
    data = raw.encode() if isinstance(raw, str) else raw
    if not data.strip():
        return empty
    try:
        value = json.loads(data)
    except RecursionError:
        raise APIError(400, f"the request body nests deeper than {max_depth} levels") from None
    except ValueError:
        raise APIError(400, "the request body is not valid JSON") from None
    if json_depth(value, max_depth) > max_depth:
        raise APIError(400, f"the request body nests deeper than {max_depth} levels")
    return value
