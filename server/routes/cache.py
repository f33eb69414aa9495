"""GET /cache: the RAM prompt cache's entries, totals and limits; GET /debug/integrity."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request

from .common import state_of

if TYPE_CHECKING:
    from ..slots.engine import Engine

router = APIRouter()


@router.get("/cache")
async def cache_info(request: Request) -> dict[str, Any]:
    """The RAM prompt cache: ``{"enabled": false}`` without one, else its entries and limits,
    and under ``disk`` the disk tier's (``{"enabled": false}`` without one)."""
    engine = state_of(request).require_engine()
    if engine.cache is None:
        return {"enabled": False}
    disk = engine.disk.describe() if engine.disk is not None else {"enabled": False}
    return {
        "enabled": True,
        "idle_slots": engine.opts.cache_idle_slots,
        **engine.cache.describe(),
        "disk": disk,  # the tier under RAM (--cache-disk)
    }


@router.get("/debug/integrity")
async def integrity(request: Request) -> dict[str, Any]:
    """Run the engine's and the RAM cache's integrity checks between two engine steps:
    every slot's tokens match its KV positions, checkpoints lie within them, cache bytes equal
    the sum of its entries, no entry is a prefix of another."""
    engine = state_of(request).require_engine()

    def check(e: Engine) -> list[str]:
        return e.check_integrity() + (e.cache.check_integrity() if e.cache is not None else [])

    # engine.call runs check on the engine thread between steps: nothing moves meanwhile
    problems = await asyncio.wrap_future(engine.call(check))
    return {"ok": not problems, "problems": problems}
