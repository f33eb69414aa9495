"""Pure ASGI middlewares (they keep streaming responses and disconnect detection intact)."""

from __future__ import annotations

from typing import Any

from .routes.metrics import KNOWN


class JsonBody:
    """Read POST bodies as JSON whatever Content-Type says, as llama-server does
    (``curl -d`` sends application/x-www-form-urlencoded)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope.get("method") == "POST":
            headers = [(k, v) for k, v in scope.get("headers", []) if k != b"content-type"]
            ctype = next((v for k, v in scope.get("headers", []) if k == b"content-type"), b"")
            if b"json" not in ctype:
                scope = {**scope, "headers": [*headers, (b"content-type", b"application/json")]}
        await self.app(scope, receive, send)


class RequestCounter:
    """Counts requests by endpoint and outcome (status class)."""

    def __init__(self, app: Any, metrics: Any) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        if path.startswith("/slots/"):
            path = "/slots/{id}"
        endpoint = path if path in KNOWN or path == "/slots/{id}" else "other"
        status = 500

        async def send_wrapper(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            self.metrics.count_request(endpoint, status)
