"""CORS headers as llama-server writes them (``server-http.cpp``'s pre-routing handler).

- ``--cors-origins *`` (the default) with ``--cors-credentials`` (the default): the request's
  ``Origin`` is echoed back; without credentials the answer is ``*``.
- ``--cors-origins localhost``: only a local ``Origin`` (``localhost``, ``127.0.0.1``,
  ``[::1]``, any port) is echoed back; others get no ``Access-Control-Allow-Origin``. This is
  the default when server tools or MCP servers are configured (``--tools``,
  ``--mcp-servers-*``, ``--agent``) and ``--cors-origins`` is not given.
- a list of origins: the request's ``Origin`` is echoed back when listed (``localhost`` may be
  one item). llama-server writes the configured text whatever the ``Origin``; for a browser
  the two are the same.
- every ``OPTIONS`` request is answered here with 200 and an empty body, before keys are
  checked (browsers send no key on a preflight): ``Access-Control-Allow-Credentials``,
  ``-Methods`` and ``-Headers`` as configured.

The headers only tell a browser what it may read. What a page may make the server do is
``middleware.RequestGuard``'s job, which refuses requests from origins this policy does not
allow (and more; see there).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from starlette.types import ASGIApp, Message, Receive, Scope, Send

LOCAL_HOSTS = {"localhost", "127.0.0.1", "::1", "[::1]"}
LOCALHOST = "localhost"  # the --cors-origins value (or item) meaning "any local origin"
# Ignored llama-server flags that, given, make llama-server default to --cors-origins localhost.
_TOOL_FLAGS = ("--tools", "--mcp-servers-config", "--mcp-servers-json")


def hostname(authority: str) -> str:
    """``host[:port]`` (or ``[v6]:port``) without the port, lower case."""
    a = authority.strip().lower()
    if a.startswith("["):
        return a[: a.find("]") + 1] if "]" in a else a
    return a.rsplit(":", 1)[0] if a.count(":") == 1 else a


def origin_host(origin: str) -> str:
    """The host of an ``Origin`` value (``scheme://host[:port]``); empty if it has no scheme."""
    if "://" not in origin:
        return ""
    return hostname(origin.split("://", 1)[1].split("/", 1)[0])


def is_local_origin(origin: str) -> bool:
    return origin_host(origin) in LOCAL_HOSTS


def normalize_origin(origin: str) -> str:
    return origin.strip().rstrip("/").lower()


def effective_origins(cors_origins: str | None, compat: dict[str, object]) -> str:
    """``--cors-origins`` as given, else llama-server's default: ``localhost`` when server
    tools or MCP servers are configured (accepted-and-ignored flags here, but a command line
    that has them expects the narrower default), else ``*``."""
    if cors_origins is not None:
        return cors_origins
    tools = any(compat.get(f) for f in _TOOL_FLAGS) or compat.get("--agent") is True
    return LOCALHOST if tools else "*"


@dataclass(frozen=True)
class CorsPolicy:
    """The CORS configuration. ``origins`` is the effective ``--cors-origins`` text."""

    origins: str = "*"
    methods: str = "GET, POST, DELETE, OPTIONS"
    headers: str = "*"
    credentials: bool = True

    @functools.cached_property
    def items(self) -> frozenset[str]:
        """The configured origins, normalized (parsed once, not per request)."""
        return frozenset(normalize_origin(o) for o in self.origins.split(",") if o.strip())

    @functools.cached_property
    def any_origin(self) -> bool:
        return self.items in (set(), {"*"})

    def allows(self, origin: str) -> bool:
        """Whether a page at ``origin`` is one this configuration names (``*`` names all)."""
        items = self.items
        if self.any_origin or normalize_origin(origin) in items:
            return True
        return LOCALHOST in items and is_local_origin(origin)

    def allow_origin(self, origin: str | None) -> str | None:
        """The ``Access-Control-Allow-Origin`` value for a request from ``origin``, or None."""
        if self.any_origin and not self.credentials:
            return "*"
        if origin is None or not origin.strip():
            return None
        return origin if self.allows(origin) else None


class Cors:
    """Writes ``policy``'s headers on every response and answers every ``OPTIONS`` itself.
    Names go out in llama-server's case (ASGI raw headers; h11 sends them as given): some
    clients, llama.cpp's own tests among them, look them up case-sensitively."""

    def __init__(self, app: ASGIApp, policy: CorsPolicy) -> None:
        self.app = app
        self.policy = policy

    def _headers(self, scope: Scope) -> list[tuple[bytes, bytes]]:
        origin = None
        for k, v in scope.get("headers", []):
            if k == b"origin":
                origin = v.decode("latin-1")
                break
        allowed = self.policy.allow_origin(origin)
        out = [] if allowed is None else [(b"Access-Control-Allow-Origin", allowed.encode())]
        if allowed not in (None, "*"):
            # the answer depends on the Origin: caches must key on it
            out.append((b"Vary", b"Origin"))
        return out

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = self._headers(scope)
        if scope.get("method") == "OPTIONS":
            p = self.policy
            headers += [
                (b"Access-Control-Allow-Credentials", b"true" if p.credentials else b"false"),
                (b"Access-Control-Allow-Methods", p.methods.encode()),
                (b"Access-Control-Allow-Headers", p.headers.encode()),
                (b"content-type", b"text/html"),
                (b"content-length", b"0"),
            ]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            await send({"type": "http.response.body", "body": b""})
            return

        async def send_with_cors(message: Message) -> None:
            if message["type"] == "http.response.start" and headers:
                kept = [
                    (k, v)
                    for k, v in message.get("headers", [])
                    if k.lower() != b"access-control-allow-origin"
                ]
                message = {**message, "headers": [*kept, *headers]}
            await send(message)

        await self.app(scope, receive, send_with_cors)
