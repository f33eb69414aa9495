"""A request's constraint from its fields, as OpenAI and llama-server name them.

Chat takes OpenAI's ``response_format`` (``text``, ``json_object``, ``json_schema``) and, as
llama-server does, a top-level ``json_schema`` or ``grammar``; completions take the latter
two. Every malformed field is a ConstraintError whose ``where`` names it."""

from __future__ import annotations

from ..json_value import JsonValue
from .spec import Constraint, ConstraintError, gbnf_constraint, json_schema_constraint


def _schema(value: JsonValue, field: str) -> Constraint:
    """``value`` as a JSON-schema constraint; an empty schema means any object (llama-server)."""
    if not isinstance(value, dict):
        raise ConstraintError(field, "the schema must be a JSON object")
    try:
        return json_schema_constraint(value or {"type": "object"})
    except ConstraintError as e:
        raise ConstraintError(field + e.where, e.reason) from None


def _response_format(rf: JsonValue) -> Constraint | None:
    """OpenAI's ``response_format``; llama-server's ``json_object`` may carry a ``schema``."""
    if not isinstance(rf, dict):
        raise ConstraintError("response_format", "must be an object with a type")
    kind = rf.get("type")
    if kind in (None, "", "text"):
        return None
    if kind == "json_object":
        if "schema" in rf:
            return _schema(rf["schema"], "response_format.schema")
        return _schema({"type": "object"}, "response_format")
    if kind == "json_schema":
        wrapper = rf.get("json_schema")
        if not isinstance(wrapper, dict):
            raise ConstraintError("response_format.json_schema", "must be an object with a schema")
        return _schema(wrapper.get("schema", {}), "response_format.json_schema.schema")
    raise ConstraintError(
        "response_format.type",
        f'must be one of "text", "json_object" or "json_schema", but got: {kind!r}',
    )


def request_constraint(
    *, response_format: JsonValue = None, json_schema: JsonValue = None, grammar: JsonValue = None
) -> Constraint | None:
    """The one constraint these fields ask for (None: free text). A request may set one of
    ``response_format``, ``json_schema`` and ``grammar`` (a GBNF string); two of them, a
    malformed field or a schema/grammar that cannot be compiled raise ConstraintError."""
    given = [
        n
        for n, v in (
            ("response_format", response_format),
            ("json_schema", json_schema),
            ("grammar", grammar),
        )
        if v is not None and not (n == "grammar" and v == "")
    ]
    if len(given) > 1:
        raise ConstraintError(given[1], f"cannot be used together with {given[0]}")
    if response_format is not None:
        return _response_format(response_format)
    if json_schema is not None:
        return _schema(json_schema, "json_schema")
    if grammar:
        if not isinstance(grammar, str):
            raise ConstraintError("grammar", "must be a GBNF grammar string")
        try:
            return gbnf_constraint(grammar)
        except ConstraintError as e:
            raise ConstraintError("grammar", e.reason) from None
    return None
