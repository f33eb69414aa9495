"""Pure ASGI middlewares (they keep streaming responses and disconnect detection intact).

They sit below the routes: they import nothing from ``server.routes``."""

from __future__ import annotations

import hmac
import json
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import error_body
from .metrics import ServerMetrics, endpoint_label

# Load balancers probe these without credentials.
PUBLIC_PATHS = {"/health", "/v1/health"}

Headers = list[tuple[bytes, bytes]]


async def send_json(
    send: Send, status: int, body: dict[str, Any], headers: Headers | None = None
) -> None:
    """Answer with ``body`` as JSON without calling the app."""
    data = json.dumps(body).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(data)).encode()),
                *(headers or []),
            ],
        }
    )
    await send({"type": "http.response.body", "body": data})


def _header(scope: Scope, name: bytes) -> bytes | None:
    """The first value of header ``name`` (lower case, as ASGI gives them), or None."""
    for k, v in scope.get("headers", []):
        if k == name:
            return v
    return None


class ApiKeyAuth:
    """Every endpoint but /health needs a key: ``Authorization: Bearer KEY`` or ``X-Api-Key``.

    Keys are compared in constant time, against every configured key (no early exit).
    CORS preflights (OPTIONS) are answered by the CORS layer outside this one.
    """

    def __init__(self, app: ASGIApp, keys: list[str]) -> None:
        self.app = app
        self.keys = [k.encode() for k in keys if k]

    def _valid(self, given: bytes) -> bool:
        """Whether ``given`` is a configured key; the time taken does not say which or how
        close (every key is compared, each in constant time)."""
        ok = False
        for k in self.keys:
            ok |= hmac.compare_digest(given, k)
        return ok

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or not self.keys
            or scope.get("path") in PUBLIC_PATHS
            or scope.get("method") == "OPTIONS"
        ):
            await self.app(scope, receive, send)
            return
        given = b""
        auth = _header(scope, b"authorization")
        if auth and auth[:7].lower() == b"bearer ":
            given = auth[7:].strip()
        else:
            given = (_header(scope, b"x-api-key") or b"").strip()
        if given and self._valid(given):
            await self.app(scope, receive, send)
            return
        await send_json(
            send, 401, error_body(401, "Invalid API Key"), [(b"www-authenticate", b"Bearer")]
        )


class BodyLimit:
    """Bodies over the limit get 413 before the app sees them (chunked bodies included)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        too_big = error_body(413, f"request body exceeds {self.max_bytes} bytes")
        length = _header(scope, b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await send_json(send, 413, too_big)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            body = msg.get("body", b"")
            size += len(body)
            if size > self.max_bytes:
                await send_json(send, 413, too_big)
                return
            chunks.append(body)
            if not msg.get("more_body"):
                break
        # The app reads the body again: hand it over whole, then pass on what follows
        # (the disconnect that streaming responses wait for).
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


class JsonBody:
    """Read POST bodies as JSON whatever Content-Type says, as llama-server does
    (``curl -d`` sends application/x-www-form-urlencoded)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope.get("method") == "POST":
            headers = [(k, v) for k, v in scope.get("headers", []) if k != b"content-type"]
            ctype = next((v for k, v in scope.get("headers", []) if k == b"content-type"), b"")
            if b"json" not in ctype:
                scope = {**scope, "headers": [*headers, (b"content-type", b"application/json")]}
        await self.app(scope, receive, send)


class RequestCounter:
    """Counts requests by endpoint and outcome (status class)."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        endpoint = endpoint_label(scope.get("path", ""))
        status = 500  # what counts if the app fails before it starts a response

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            self.metrics.count_request(endpoint, status)
