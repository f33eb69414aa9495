"""The router's endpoints: its own (``/health``, ``/props``, ``/models``, ``/models/load``,
``/models/unload``, ``/models/sse``) and every other path, passed to the instance its
request names (the body's ``model`` for POST, ``?model=`` for GET)."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import json
import math
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..http.middleware import from_foreign_page
from ..json_value import JsonValue
from ..schemas.errors import APIError
from ..schemas.json_body import parse_json_body
from .conv_map import ConvMap, Pending
from .instances import LOADING, READY, Instance
from .manager import Manager
from .mmproj import input_modalities
from .presets import ModelSpec
from .proxy import Upstream, forward, upstream_headers
from .stream_routes import note_request, settle_request

router = APIRouter()

_TRUE = ("1", "true", "yes", "on")
# Silence past an instance's own time limit before the router gives up on it (it answers
# its own timeout error within that).
UPSTREAM_GRACE_S = 5.0


@dataclass
class RouterState:
    """What the router's routes share."""

    manager: Manager
    models_max: int
    autoload: bool
    internal_key: str
    checks_keys: bool  # --api-key given: the client's key is passed on
    reload: Callable[[], dict[str, ModelSpec]] | None = None  # re-reads the sources
    started: float = 0.0
    timeout: float = 600.0  # --timeout: an instance's own limit unless its preset sets one
    streams: ConvMap = field(default_factory=ConvMap)  # resumable streams' owners


def llama_version() -> str:
    """The installed llama-cpp-python's version (what single-model ``/props`` reports)."""
    try:
        return importlib.metadata.version("llama_cpp_python")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def state_of(request: Request) -> RouterState:
    st: RouterState = request.app.state.router
    return st


def autoload_of(st: RouterState, request: Request) -> bool:
    """``?autoload=`` wins over ``--models-autoload``."""
    given = request.query_params.get("autoload")
    return st.autoload if given is None else given.lower() in _TRUE


@router.get("/health")
@router.get("/v1/health")
async def health() -> dict[str, str]:
    """The router itself is up (starts nothing)."""
    return {"status": "ok"}


@router.get("/props")
async def props(request: Request) -> Response:
    """The router's own properties, or with ``?model=`` the instance's ``/props``."""
    st = state_of(request)
    if request.query_params.get("model"):
        return await _proxy(request, request.query_params.get("model"), RoutedBody(b""))
    return JSONResponse(
        {
            "role": "router",
            "max_instances": st.models_max,
            "models_autoload": st.autoload,
            "model_alias": "llama-server",
            "model_path": "none",
            "default_generation_settings": {"params": {}, "n_ctx": 0},
            "build_info": f"b{llama_version()}-slot",  # as system_fingerprint: b...
            "is_sleeping": False,
        }
    )


@router.post("/sleep")
@router.post("/wake_up")
@router.get("/is_sleeping")
async def sleep_mode(request: Request) -> Response:
    """vLLM's sleep mode, per instance: the one ``?model=`` names (400 without one), never
    started for it (400 when it is not running)."""
    name = request.query_params.get("model")
    return await _proxy(request, name, RoutedBody(b""), autoload=False)


def model_json(inst: Instance, created: int, private: bool) -> dict[str, object]:
    """One entry of ``GET /models`` (llama-server's fields); the model's file and the
    instance's command line only when ``private`` (``may_see_paths``)."""
    status = inst.status_json()
    if not private:
        status.pop("args", None)
    out = {
        "id": inst.name,
        "aliases": [],
        "tags": [],
        "object": "model",
        "owned_by": "llamacpp",
        "created": created,
        "path": inst.spec.path,
        "status": status,
        "architecture": {
            "input_modalities": input_modalities(inst.spec.args.get("mmproj")),
            "output_modalities": ["text"],
        },
        "source": inst.spec.source,
        "can_remove": False,
    }
    if not private:
        del out["path"]
    return out


def may_see_paths(st: RouterState, request: Request) -> bool:
    """Whether a ``GET /models`` caller sees files and command lines: with ``--api-key``,
    every caller that got this far holds a key; without, a request that no page elsewhere
    sent (no non-local ``Origin`` or ``Referer``, no cross-site ``Sec-Fetch-Site``)."""
    return st.checks_keys or not from_foreign_page(request.scope)


@router.get("/models")
@router.get("/v1/models")
async def models(request: Request) -> dict[str, object]:
    """Every model with its status; ``?reload=1`` re-reads the sources first."""
    st = state_of(request)
    if request.query_params.get("reload") and st.reload is not None:
        await st.manager.replace_specs(st.reload())
    now = int(time.time())
    private = may_see_paths(st, request)
    data = [model_json(i, now, private) for i in st.manager.instances.values()]
    return {"object": "list", "data": data}


@dataclass(frozen=True)
class RoutedBody:
    """A request body as the router reads it: the bytes passed on, the ``model`` it names
    and its ``timeout`` (seconds, when a positive number)."""

    raw: bytes
    model: str | None = None
    timeout: float | None = None


async def _body_model(request: Request) -> RoutedBody:
    """The body, parsed by the one bounded parser (a 400 for bad or too deep JSON)."""
    body = await request.body()
    parsed = parse_json_body(body, empty={})
    if not isinstance(parsed, dict):
        return RoutedBody(body)
    name = parsed.get("model")
    return RoutedBody(
        body, name if isinstance(name, str) else None, _seconds(parsed.get("timeout"))
    )


def _seconds(value: JsonValue) -> float | None:
    """``value`` when it is a positive finite number of seconds, else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) and value > 0 else None


@router.post("/models/load")
async def load(request: Request) -> dict[str, bool]:
    """Start a model (in the background; ``GET /models`` tells when it is ``loaded``)."""
    st = state_of(request)
    name = (await _body_model(request)).model
    inst = st.manager.get(name or "")
    if inst is None:
        raise APIError(404, "model is not found", "not_found_error")
    if inst.status in READY or inst.status == LOADING:
        raise APIError(400, "model is already running")
    st.manager.load(inst.name)
    return {"success": True}


@router.post("/models/unload")
async def unload(request: Request) -> dict[str, bool]:
    """Stop a model's instance (waits until its process has exited)."""
    st = state_of(request)
    name = (await _body_model(request)).model
    inst = st.manager.get(name or "")
    if inst is None:
        raise APIError(400, "model is not found")
    if inst.proc is None:
        raise APIError(400, "model is not running")
    await st.manager.unload(inst.name)
    return {"success": True}


@router.get("/models/sse")
async def models_sse(request: Request) -> StreamingResponse:
    """Status events as Server-Sent Events, from now on (``model_status``, ``models_reload``)."""
    st = state_of(request)

    async def events() -> AsyncIterator[bytes]:
        with st.manager.events.subscribe() as q:
            yield b": connected\n\n"
            idle = 0
            while not st.manager.events.closed:
                try:
                    msg = await asyncio.wait_for(q.get(), 0.5)
                except asyncio.TimeoutError:
                    idle += 1
                    if idle % 30 == 0:
                        yield b": ping\n\n"
                    continue
                yield f"data: {json.dumps(msg)}\n\n".encode()

    return StreamingResponse(events(), media_type="text/event-stream")


async def _until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def silence_limit(st: RouterState, inst: Instance, asked: float | None) -> float:
    """How long ``inst`` may send nothing before the router gives up on it: the instance
    ends a request itself at its ``--timeout`` (or the request's own ``timeout``), so
    silence ``UPSTREAM_GRACE_S`` beyond that means it is frozen."""
    own = inst.spec.args.get("timeout")
    try:
        limit = float(own) if own is not None else st.timeout
    except ValueError:
        limit = st.timeout
    return max(limit, asked or 0.0) + UPSTREAM_GRACE_S


async def _proxy(
    request: Request,
    name: str | None,
    body: RoutedBody,
    autoload: bool | None = None,
    named: bool = False,
) -> Response:
    """Hold the named instance (starting it when allowed: ``autoload``, by default the
    request's or the router's), then pass the request on. ``named``: a request that may
    name a stream (``X-Conversation-Id``): once its model is known it is pending
    (router.stream_routes.note_request), remembered when its instance opened the stream."""
    st = state_of(request)
    inst = st.manager.require(name, autoload_of(st, request) if autoload is None else autoload)
    pending = note_request(st, request, inst.name) if named else None
    response: Response | None = None
    try:
        response = await _pass_on(request, inst, body, pending)
        return response
    finally:
        if pending is not None:
            settle_request(st, request, pending, response)


async def _pass_on(
    request: Request, inst: Instance, body: RoutedBody, pending: Pending | None
) -> Response:
    """Wait until ``inst`` is ready and pass the request on. A client that leaves while
    waiting gives up its place; the start goes on for others. A named stream's request
    (``pending``) waits on without its client, unless a stop came meanwhile (400)."""
    st = state_of(request)
    release = st.manager.hold(inst)
    try:
        waiting = asyncio.create_task(st.manager.ready(inst))
        watched: set[asyncio.Task[None]] = {waiting}
        if pending is None:  # else the client may leave: only a stop ends the request
            watched.add(asyncio.create_task(_until_disconnect(request)))
        await asyncio.wait(watched, return_when=asyncio.FIRST_COMPLETED)
        for t in watched - {waiting}:
            t.cancel()
        if not waiting.done():
            waiting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await waiting
            release()
            return Response(status_code=499)
        waiting.result()
        if pending is not None and not st.streams.wanted(pending):
            raise APIError(400, "request cancelled by a stop while the model was loading")
    except BaseException:
        release()
        raise
    headers = upstream_headers(request, st.internal_key, st.checks_keys)
    limit = silence_limit(st, inst, body.timeout)
    up = Upstream(inst.port, inst.name, headers, limit, release)
    return await forward(st.manager.client_for_proxy, request, body.raw, up)


@router.api_route("/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"])
async def proxied(request: Request, path: str) -> Response:
    """Any other endpoint: routed by the body's ``model`` (POST) or ``?model=`` (GET)."""
    if request.method in ("POST", "PUT", "PATCH"):
        body = await _body_model(request)
        return await _proxy(request, body.model, body, named=True)
    return await _proxy(request, request.query_params.get("model"), RoutedBody(b""))
