"""Passing a request to an instance and its answer back, unbuffered.

The answer streams chunk by chunk as the instance writes it (SSE included). When the client
goes away, the upstream response is closed, so the instance sees its client disconnect and
cancels the task. An instance that is gone (crashed, killed) answers 503, one silent past the
request's timeout (``--timeout``) 504; a stream cut either way ends with its error event."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from urllib.parse import quote

import anyio
import httpx
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from ..schemas.errors import APIError, anthropic_path, error_body_for

log = logging.getLogger("server.router")

# Request headers not passed on: hop-by-hop ones and the ones httpx sets. The cross-site
# facts (``Origin``, ``Referer``, ``Sec-Fetch-*``) go on: the instance judges them again with
# the router's --cors-origins (``Manager._argv``), so it never takes a request the router
# should have refused for one from its own machine. Cookies stop here (an instance
# authenticates by key alone, and its Host is not the one the page saw).
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
        b"cookie",
        b"accept-encoding",
    }
)
# The router writes its own CORS headers (``cors.Cors``).
DROP_RESPONSE = frozenset(
    {
        "connection",
        "keep-alive",
        "transfer-encoding",
        "date",
        "server",
        "content-length",
        "access-control-allow-origin",
        "access-control-allow-credentials",
        "vary",
    }
)
# The streams that end with ``data: [DONE]`` (OpenAI's; the native, Responses and Anthropic
# streams send none): one cut off ends with it too, after its error event.
DONE_PATHS = frozenset({"/v1/chat/completions", "/chat/completions", "/v1/completions"})
CONNECT_TIMEOUT_S = 10.0


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
        self,
        body: AsyncIterator[bytes],
        on_close: Callable[[], Awaitable[None]],
        status_code: int = 200,
        headers: Mapping[str, str] | None = None,
        media_type: str | None = None,
    ) -> None:
        super().__init__(body, status_code=status_code, headers=headers, media_type=media_type)
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.on_close()


def cut_off_event(path: str, name: str, status: int = 503, why: str = "stopped") -> bytes:
    """The SSE error event that ends a stream whose instance died or froze mid-answer (a
    blank line first closes any event the cut left open), in the shape of the route's API,
    then ``data: [DONE]`` where the route's streams end with it."""
    body = error_body_for(path, status, f"model '{name}' {why} mid-answer", "unavailable_error")
    head = "event: error\n" if anthropic_path(path) else ""
    done = "data: [DONE]\n\n" if path in DONE_PATHS else ""
    return f"\n\n{head}data: {json.dumps(body)}\n\n{done}".encode()


def upstream_url(scope: Scope, port: int) -> str:
    """The instance's URL for this request: the raw path the client sent (the one the
    router's rules judged, never re-decoded or normalized: ``RequestGuard`` has refused any
    path a hop could read otherwise) and its query string, as sent."""
    raw = scope.get("raw_path")
    path = raw.decode("latin-1") if raw else quote(scope.get("path", "/"))
    query = scope.get("query_string", b"").decode("latin-1")
    return f"http://127.0.0.1:{port}{path}" + (f"?{query}" if query else "")


def upstream_timeout(read_s: float | None) -> httpx.Timeout:
    """``read_s``: the longest the instance may stay silent (each read, each write)."""
    return httpx.Timeout(connect=CONNECT_TIMEOUT_S, read=read_s, write=read_s, pool=None)


@dataclass
class Upstream:
    """Where and how a request goes on: the instance's ``port`` and ``name``, the
    ``headers`` to send, ``timeout`` (seconds of silence before the router gives up, None:
    none) and ``release``, run once its answer is over (or could not be had)."""

    port: int
    name: str
    headers: list[tuple[bytes, bytes]]
    timeout: float | None
    release: Callable[[], None]


def _unavailable(e: httpx.HTTPError, up: Upstream) -> APIError:
    if isinstance(e, httpx.TimeoutException) and not isinstance(e, httpx.ConnectTimeout):
        return APIError(
            504, f"model '{up.name}' sent nothing for {up.timeout:g} s", "unavailable_error"
        )
    return APIError(
        503, f"model '{up.name}' is unavailable: {type(e).__name__}", "unavailable_error"
    )


async def forward(
    client: httpx.AsyncClient, request: Request, body: bytes, up: Upstream
) -> ProxiedResponse:
    """Send ``request`` (with ``body``) to the instance ``up`` names and stream its answer
    back. An instance silent for ``up.timeout`` s: a 504 before its answer began, else the
    stream ends (an SSE one with the error event and, OpenAI's, ``[DONE]``)."""
    url = upstream_url(request.scope, up.port)
    upstream = client.build_request(
        request.method, url, headers=up.headers, content=body, timeout=upstream_timeout(up.timeout)
    )
    try:
        resp = await client.send(upstream, stream=True)
    except httpx.HTTPError as e:
        up.release()
        raise _unavailable(e, up) from None

    sse = resp.headers.get("content-type", "").startswith("text/event-stream")
    path = request.scope.get("path", "")

    async def chunks() -> AsyncIterator[bytes]:
        try:
            async for chunk in resp.aiter_raw():
                yield chunk
        except httpx.HTTPError as e:  # the instance died or froze mid-answer: end here
            log.warning("model %s: answer cut off: %s", up.name, type(e).__name__)
            if sse:  # the status went out already: the failure travels as an event
                err = _unavailable(e, up)
                why = "went silent" if err.status == 504 else "stopped"
                yield cut_off_event(path, up.name, err.status, why)

    async def close() -> None:
        up.release()
        await resp.aclose()

    kept = [(k, v) for k, v in resp.headers.multi_items() if k.lower() not in DROP_RESPONSE]
    out = ProxiedResponse(chunks(), close, status_code=resp.status_code)
    out.raw_headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in kept]
    return out
