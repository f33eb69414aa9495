"""GET /cache: the RAM prompt cache's entries, totals and limits."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from .openai import state_of

router = APIRouter()


@router.get("/cache")
async def cache_info(request: Request) -> dict[str, Any]:
    engine = state_of(request).require_engine()
    if engine.cache is None:
        return {"enabled": False}
    return {"enabled": True, "idle_slots": engine.opts.cache_idle_slots, **engine.cache.describe()}
