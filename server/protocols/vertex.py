"""Vertex AI prediction (llama-server's GCP compatibility, on with ``AIP_MODE=PREDICTION``):
``POST /predict`` with ``{"instances": [...]}``, each instance a body for the POST route its
``@requestFormat`` names (camelCase, ``chatCompletions`` for ``/v1/chat/completions``, or
the path itself), answered as ``{"predictions": [...]}`` in order.

Each instance runs through the whole application, as a request of its own with the outer
request's headers (the same key, host and origin rules), all at once; streaming is off.
An instance that fails has its error body as its prediction, as llama-server's."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Sequence

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from starlette.routing import BaseRoute
from starlette.types import Message

from server.json_value import JsonObject

from ..schemas.errors import APIError, error_body
from ..schemas.json_body import loads_bounded, parse_json_body
from ..settings.config import GcpCompat

log = logging.getLogger("server.gcp")

MAX_INSTANCES = 128  # llama-server's


def request_format(path: str) -> str:
    """A route's ``@requestFormat`` alias: ``/v1/chat/completions`` -> ``chatCompletions``,
    ``/apply-template`` -> ``applyTemplate``."""
    s = path[3:] if path.startswith("/v1/") else path
    out, cap = [], False
    for ch in s.lstrip("/"):
        if ch == "{":  # path parameters end the alias
            break
        if ch in "/-_":
            cap = True
            continue
        out.append(ch.upper() if cap else ch)
        cap = False
    return "".join(out)


def api_routes(routes: Sequence[BaseRoute]) -> list[APIRoute]:
    """Every API route, included routers' too (FastAPI keeps an included router as one
    entry that holds its ``original_router``; none is included under a prefix here)."""
    out: list[APIRoute] = []
    for r in routes:
        if isinstance(r, APIRoute):
            out.append(r)
        elif hasattr(r, "original_router"):
            out += api_routes(r.original_router.routes)
    return out


def post_routes(app: FastAPI) -> dict[str, str]:
    """``@requestFormat`` (alias or path) -> path, for every POST route; the first route
    registered wins an alias two share, as in llama-server."""
    out: dict[str, str] = {}
    for r in api_routes(app.routes):
        if "POST" in (r.methods or ()) and "{" not in r.path:
            out.setdefault(request_format(r.path), r.path)
            out.setdefault(r.path, r.path)
    return out


async def _dispatch(
    request: Request, gone: asyncio.Event, path: str, payload: JsonObject
) -> object:
    """Run ``payload`` as a POST to ``path`` through the whole application; its JSON body.
    ``gone`` is set when the client of the outer request disconnects: the inner request
    sees its own disconnect then (and its tasks are cancelled)."""
    data = json.dumps(payload).encode()
    headers = [
        (k, v) for k, v in request.scope["headers"] if k not in (b"content-length", b"content-type")
    ]
    headers += [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(data)).encode()),
    ]
    scope = {**request.scope, "path": path, "raw_path": path.encode(), "query_string": b""}
    scope.update(headers=headers, method="POST", state=dict(request.scope.get("state", {})))
    sent = False
    body: list[bytes] = []

    async def receive() -> Message:
        nonlocal sent
        if sent:  # the body is in; what follows is the client's disconnect
            await gone.wait()
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": data, "more_body": False}

    async def send(message: Message) -> None:
        if message["type"] == "http.response.body":
            body.append(message.get("body", b""))

    await request.app(scope, receive, send)
    raw = b"".join(body)
    try:
        return loads_bounded(raw) if raw else None
    except ValueError:  # not JSON, or deeper than any body: the text as it is
        return raw.decode("utf-8", "replace")


async def _instance(
    request: Request, gone: asyncio.Event, routes: dict[str, str], instance: object
) -> object:
    """One prediction: the answer of the route the instance names, or an error body."""
    if not isinstance(instance, dict):
        return error_body(400, "each instance must be a JSON object")
    fmt = instance.get("@requestFormat")
    if not isinstance(fmt, str):
        return error_body(400, "each instance must include a string @requestFormat")
    path = routes.get(fmt)
    if path is None:
        return error_body(400, f"no handler registered for @requestFormat: {fmt}")
    payload = {k: v for k, v in instance.items() if k != "@requestFormat"}
    if payload.get("stream"):
        log.warning("ignoring an instance's stream field: the predict route does not stream")
    payload["stream"] = False
    return await _dispatch(request, gone, path, payload)


async def _watch(request: Request, gone: asyncio.Event) -> None:
    """Set ``gone`` when the client disconnects (the body was read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    gone.set()


def install(app: FastAPI, gcp: GcpCompat) -> None:
    """Add the predict route (and the health alias) once every other route is in."""
    routes = post_routes(app)
    if gcp.predict_route in routes:
        raise ValueError(f"AIP_PREDICT_ROUTE={gcp.predict_route} is one of this server's routes")

    async def predict(request: Request) -> Response:
        data = parse_json_body(await request.body())  # depth-bounded: a 400, never a 500
        instances = data.get("instances") if isinstance(data, dict) else None
        if not isinstance(instances, list):
            raise APIError(400, "request body must include an array field named instances")
        if len(instances) > MAX_INSTANCES:
            raise APIError(400, f"instances array exceeds maximum size of {MAX_INSTANCES}")
        gone = asyncio.Event()
        watcher = asyncio.create_task(_watch(request, gone))
        try:
            predictions = await asyncio.gather(
                *(_instance(request, gone, routes, i) for i in instances)
            )
        finally:
            watcher.cancel()
        return JSONResponse({"predictions": list(predictions)})

    app.add_api_route(gcp.predict_route, predict, methods=["POST"], include_in_schema=False)
    if gcp.health_route:
        health = next(r.endpoint for r in api_routes(app.routes) if r.path == "/health")
        app.add_api_route(gcp.health_route, health, methods=["GET"], include_in_schema=False)
