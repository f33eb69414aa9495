"""vLLM's sleep mode by hand: ``POST /sleep?level=1|2``, ``POST /wake_up``,
``GET /is_sleeping`` (server.http.model_sleep does the work; README "Router mode and sleeping
when idle" states what each level frees).

/sleep is no task for the sleep gate (it neither wakes a sleeping server nor counts as a
running request); /wake_up is one, so the gate has woken the server before it gets here."""

from __future__ import annotations

from typing import Protocol

from fastapi import APIRouter, Request

from ..json_value import JsonObject
from ..schemas.errors import APIError

router = APIRouter()


class Sleeper(Protocol):
    """What these routes need of the app's sleep controller (server.http.model_sleep, a layer
    above the routes: it is reached through ``app.state.sleeper``, never imported)."""

    sleeping: bool
    level: int

    async def sleep_now(self, level: int) -> str: ...

    async def wake(self) -> None: ...


LEVELS = {"1": 1, "2": 2}
# vLLM's wake_up tags; both are always woken together here (the model and its KV)
WAKE_TAGS = frozenset({"weights", "kv_cache"})


def controller(request: Request) -> Sleeper:
    return request.app.state.sleeper


@router.post("/sleep")
async def sleep(request: Request) -> JsonObject:
    """Level 1: free the context and KV cache, keep the model and the conversations (RAM
    cache or disk tier); level 2: free the model and the RAM cache too (the disk tier
    keeps them). 409 while requests run."""
    raw = request.query_params.get("level", "1")
    level = LEVELS.get(raw.strip())
    if level is None:
        raise APIError(400, f"level must be 1 or 2, not {raw[:20]!r}")
    outcome = await controller(request).sleep_now(level)
    if outcome == "busy":
        raise APIError(409, "requests are running; sleep when they have finished")
    if outcome == "unloaded":
        raise APIError(503, "no model is loaded (loading, or its load failed)")
    return {"is_sleeping": True, "level": controller(request).level}


@router.post("/wake_up")
async def wake_up(request: Request) -> JsonObject:
    """Wake the server (any task does: this one waits until it is awake). ``tags``:
    vLLM's ``weights`` / ``kv_cache``, accepted (both wake together); others are 400."""
    tags = [t for v in request.query_params.getlist("tags") for t in v.split(",") if t]
    unknown = sorted(set(tags) - WAKE_TAGS)
    if unknown:
        raise APIError(400, f"unknown tags {unknown[:4]}; known: kv_cache, weights")
    await controller(request).wake()
    return {"is_sleeping": False}


@router.get("/is_sleeping")
async def is_sleeping(request: Request) -> dict[str, bool]:
    """vLLM's: whether the server sleeps (by hand or idle). Neither wakes it nor resets
    the idle timer."""
    return {"is_sleeping": controller(request).sleeping}
