"""The one bounded JSON parser for bodies that a route reads by hand (the router's body model,
``/predict``, ``POST /lora-adapters``, slot actions): the same limits as the bodies FastAPI
parses for the typed routes, answered with a 400 ``APIError`` instead of a 500. Also JSON
text inside a request or an answer (a history call's ``arguments`` string, the arguments a
model writes): ``loads_bounded``, whose too-deep text is a ``ValueError`` like text that is
not JSON, so a caller that keeps non-JSON text as a string keeps this too.

Size is bounded before this runs (``middleware.BodyLimit``); depth is bounded here. Python's
``json`` decoder (C) recurses once per nesting level and raises ``RecursionError`` near the
interpreter's recursion limit, which is answered as a 400 here; what it decodes is then walked
iteratively (no recursion, linear in the number of values) and refused deeper than
``max_depth``, so no later recursive code (pydantic, the template) meets a deeper value.
"""

from __future__ import annotations

import json

from ..json_value import JsonValue
from .errors import APIError

# Deeper than any real request body (OpenAI's schemas nest a few levels; JSON schemas inside
# ``response_format`` are bounded separately by --constraint-max-depth, 256 by default).
MAX_DEPTH = 512


def json_depth(value: JsonValue, limit: int | None = None) -> int:
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


class TooDeep(ValueError):
    """JSON text nesting deeper than the bound (a ValueError: not JSON this server reads)."""


def loads_bounded(text: str | bytes, max_depth: int = MAX_DEPTH) -> JsonValue:
    """``json.loads(text)``, nesting at most ``max_depth`` levels. Raises ``TooDeep`` for
    deeper text and ``json.JSONDecodeError`` for text that is not JSON (both ValueErrors);
    never ``RecursionError``. Linear time (the decoder, then one iterative walk)."""
    try:
        value = json.loads(text)
    except RecursionError:  # the C decoder recurses per level: ~1,000 levels end it
        raise TooDeep(f"the JSON nests deeper than {max_depth} levels") from None
    if json_depth(value, max_depth) > max_depth:
        raise TooDeep(f"the JSON nests deeper than {max_depth} levels")
    return value


def parse_json_body(
    raw: bytes | str, max_depth: int = MAX_DEPTH, empty: JsonValue = None
) -> JsonValue:
    """``raw`` decoded, or ``empty`` when it is empty. Raises ``APIError(400)`` when it is not
    JSON or nests deeper than ``max_depth``; never ``RecursionError``."""
    data = raw.encode() if isinstance(raw, str) else raw
    if not data.strip():
        return empty
    try:
        return loads_bounded(data, max_depth)
    except TooDeep:
        raise APIError(400, f"the request body nests deeper than {max_depth} levels") from None
    except ValueError:
        raise APIError(400, "the request body is not valid JSON") from None
