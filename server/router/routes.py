"""The router's endpoints: its own (``/health``, ``/props``, ``/models``, ``/models/load``,
``/models/unload``, ``/models/sse``) and every other path, passed to the instance its
request names (the body's ``model`` for POST, ``?model=`` for GET)."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..api.errors import APIError
from .instances import LOADING, READY, Instance
from .manager import Manager
from .proxy import forward, upstream_headers

router = APIRouter()

_TRUE = ("1", "true", "yes", "on")


@dataclass
class RouterState:
    """What the router's routes share."""

    manager: Manager
    models_max: int
    autoload: bool
    internal_key: str
    checks_keys: bool  # --api-key given: the client's key is passed on
    reload: Any = None  # () -> dict[str, ModelSpec], re-reading the sources
    started: float = 0.0


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
        return await _proxy(request, request.query_params.get("model"), b"")
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


def model_json(inst: Instance, created: int) -> dict[str, Any]:
    """One entry of ``GET /models`` (llama-server's fields)."""
    return {
        "id": inst.name,
        "aliases": [],
        "tags": [],
        "object": "model",
        "owned_by": "llamacpp",
        "created": created,
        "path": inst.spec.path,
        "status": inst.status_json(),
        "architecture": {"input_modalities": ["text"], "output_modalities": ["text"]},
        "source": inst.spec.source,
        "can_remove": False,
    }


@router.get("/models")
@router.get("/v1/models")
async def models(request: Request) -> dict[str, Any]:
    """Every model with its status; ``?reload=1`` re-reads the sources first."""
    st = state_of(request)
    if request.query_params.get("reload") and st.reload is not None:
        await st.manager.replace_specs(st.reload())
    now = int(time.time())
    data = [model_json(i, now) for i in st.manager.instances.values()]
    return {"object": "list", "data": data}


async def _body_model(request: Request) -> tuple[bytes, str | None]:
    body = await request.body()
    try:
        parsed = json.loads(body) if body else {}
    except ValueError:
        raise APIError(400, "the request body is not valid JSON") from None
    name = parsed.get("model") if isinstance(parsed, dict) else None
    return body, name if isinstance(name, str) else None


@router.post("/models/load")
async def load(request: Request) -> dict[str, bool]:
    """Start a model (in the background; ``GET /models`` tells when it is ``loaded``)."""
    st = state_of(request)
    _, name = await _body_model(request)
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
    _, name = await _body_model(request)
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


async def _proxy(request: Request, name: str | None, body: bytes) -> Response:
    """Hold the named instance (starting it when allowed), then pass the request on. A
    client that leaves while waiting gives up its place; the start goes on for others."""
    st = state_of(request)
    inst = st.manager.require(name, autoload_of(st, request))
    release = st.manager.hold(inst)
    try:
        waiting = asyncio.create_task(st.manager.ready(inst))
        gone = asyncio.create_task(_until_disconnect(request))
        await asyncio.wait({waiting, gone}, return_when=asyncio.FIRST_COMPLETED)
        gone.cancel()
        if not waiting.done():
            waiting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await waiting
            release()
            return Response(status_code=499)
        waiting.result()
    except BaseException:
        release()
        raise
    headers = upstream_headers(request, st.internal_key, st.checks_keys)
    return await forward(
        st.manager.client_for_proxy, request, body, inst.port, headers, release, inst.name
    )


@router.api_route("/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"])
async def proxied(request: Request, path: str) -> Response:
    """Any other endpoint: routed by the body's ``model`` (POST) or ``?model=`` (GET)."""
    if request.method in ("POST", "PUT", "PATCH"):
        body, name = await _body_model(request)
    else:
        body, name = b"", request.query_params.get("model")
    return await _proxy(request, name, body)
