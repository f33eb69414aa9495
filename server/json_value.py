"""JSON as the server reads it from bodies and writes it in answers: the types that say a
value is JSON (not any Python object): the values of a client's body that are arbitrary by
nature (a tool's parameters, ``chat_template_kwargs``, a JSON schema, a prompt in one of
its forms), and the objects an answer is built from. Whoever reads one narrows it with
isinstance first. A leaf: it imports nothing of the server's.

``JsonValue`` is pydantic's recursive alias (null, bool, int, float, str, lists and objects
of JSON). ``BodyJson`` is the same type for a field of a request body: FastAPI has parsed
the body from JSON already, so pydantic does not walk the value again (as ``JsonValue`` a
100,000-token prompt took 17 ms more to validate, on the event loop; as ``object`` 0.04 ms).
"""

from __future__ import annotations

from typing import Annotated, TypeAlias

from pydantic import JsonValue, SkipValidation

JsonObject: TypeAlias = dict[str, JsonValue]
BodyJson: TypeAlias = Annotated[JsonValue, SkipValidation()]

__all__ = ["BodyJson", "JsonObject", "JsonValue"]
