"""Resumable streams' names (``X-Conversation-Id``) and whose they are: the rules the
single-model server (server.service.stream_buffers) and the router (server.router.stream_routes) share."""

from __future__ import annotations

import re

from .errors import APIError
from .json_body import parse_json_body

ID_MAX = 256
# Ids are names a client chooses (llama-server's web UI: "<uuid>::<model>", a model name may
# hold '/', ':', '.', '@', '+'): printable, no spaces, quotes, '%', '?', '&' or '#'.
_ID = re.compile(r"[A-Za-z0-9._~:/@+=-]{1,256}")
LOOKUP_MAX = 256  # ids one lookup may name


def valid_id(conv_id: str) -> bool:
    """Whether ``conv_id`` may name a stream: 1 to ID_MAX characters of ``_ID``."""
    return _ID.fullmatch(conv_id) is not None


def check_id(conv_id: str | None) -> str:
    """``conv_id``, or APIError 400 when it is missing or not a valid id."""
    if not conv_id:
        raise APIError(400, "Missing conversation id (conv_id)")
    if not valid_id(conv_id):
        raise APIError(
            400,
            f"invalid conversation id: 1 to {ID_MAX} characters of letters, digits and ._~:/@+=-",
        )
    return conv_id


def lookup_ids(raw: bytes) -> list[str]:
    """The ``conversation_ids`` of a lookup body, each checked (400 otherwise)."""
    body = parse_json_body(raw, empty={})
    ids = body.get("conversation_ids") if isinstance(body, dict) else None
    if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
        raise APIError(400, "'conversation_ids' must be a list of strings")
    if len(ids) > LOOKUP_MAX:
        raise APIError(400, f"at most {LOOKUP_MAX} conversation_ids per lookup")
    return [check_id(i) for i in ids if isinstance(i, str)]  # all are (checked above)


HEADER = "x-conversation-id"


def owner_of(request: object) -> str:
    """Whose sessions a request reaches: its API key's digest (``""`` without keys)."""
    return str(getattr(getattr(request, "state", None), "api_key_id", "") or "")
