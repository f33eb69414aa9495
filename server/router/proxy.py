"""Passing a request to an instance and its answer back, unbuffered.

The answer streams chunk by chunk as the instance writes it (SSE included). When the client
goes away, the upstream response is closed, so the instance sees its client disconnect and
cancels the task. An instance that is gone (crashed, killed) answers 503."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
import httpx
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from ..api.errors import APIError, anthropic_path, error_body_for

log = logging.getLogger("server.router")

# Request headers not passed on: hop-by-hop ones, the ones httpx sets, and those the router
# has already judged (the instance trusts the router: no Origin or Referer rules twice).
DROP_REQUEST = frozenset(
    {
        b"host",
        b"content-length",
        b"connection",
        b"keep-alive",
        b"transfer-encoding",
        b"te",
        b"upgrade",
        b"proxy-authorization",
        b"origin",
        b"referer",
        b"sec-fetch-site",
        b"sec-fetch-mode",
        b"sec-fetch-dest",
        b"accept-encoding",
    }
)
DROP_RESPONSE = frozenset(
    {"connection", "keep-alive", "transfer-encoding", "date", "server", "content-length"}
)


def upstream_headers(
    request: Request, internal_key: str, router_keys: bool
) -> list[tuple[bytes, bytes]]:
    """The headers sent on: the client's own key when the router checks keys (so the
    instance's per-key cache isolation still tells clients apart), else the internal key."""
    out = [(k, v) for k, v in request.headers.raw if k not in DROP_REQUEST]
    if not router_keys:
        out = [(k, v) for k, v in out if k not in (b"authorization", b"x-api-key")]
        out.append((b"authorization", f"Bearer {internal_key}".encode()))
    return out


class ProxiedResponse(StreamingResponse):
    """A streaming response that always runs ``on_close`` (shielded from cancellation),
    whether the body was sent in full, the client left, or sending failed."""

    def __init__(
        self, body: AsyncIterator[bytes], on_close: Callable[[], Awaitable[None]], **kw: Any
    ) -> None:
        super().__init__(body, **kw)
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.on_close()


def cut_off_event(path: str, name: str) -> bytes:
    """The SSE error event that ends a stream whose instance died mid-answer (a blank line
    first closes any event the cut left open), in the shape of the route's API."""
    body = error_body_for(path, 503, f"model '{name}' stopped mid-answer", "unavailable_error")
    head = "event: error\n" if anthropic_path(path) else ""
    return f"\n\n{head}data: {json.dumps(body)}\n\n".encode()


async def forward(
    client: httpx.AsyncClient,
    request: Request,
    body: bytes,
    port: int,
    headers: list[tuple[bytes, bytes]],
    release: Callable[[], None],
    name: str,
) -> ProxiedResponse:
    """Send ``request`` (with ``body``) to the instance on ``port``; ``release`` runs once
    its answer is over (or could not be had)."""
    query = request.url.query
    url = f"http://127.0.0.1:{port}{request.url.path}" + (f"?{query}" if query else "")
    upstream = client.build_request(request.method, url, headers=headers, content=body)
    try:
        resp = await client.send(upstream, stream=True)
    except httpx.HTTPError as e:
        release()
        raise APIError(
            503, f"model '{name}' is unavailable: {type(e).__name__}", "unavailable_error"
        ) from None

    sse = resp.headers.get("content-type", "").startswith("text/event-stream")

    async def chunks() -> AsyncIterator[bytes]:
        try:
            async for chunk in resp.aiter_raw():
                yield chunk
        except httpx.HTTPError as e:  # the instance died mid-answer: end the stream here
            log.warning("model %s: answer cut off: %s", name, type(e).__name__)
            if sse:  # the status went out already: the failure travels as an event
                yield cut_off_event(request.url.path, name)

    async def close() -> None:
        release()
        await resp.aclose()

    kept = [(k, v) for k, v in resp.headers.multi_items() if k.lower() not in DROP_RESPONSE]
    out = ProxiedResponse(chunks(), close, status_code=resp.status_code)
    out.raw_headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in kept]
    return out
