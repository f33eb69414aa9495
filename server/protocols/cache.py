"""GET /cache: the RAM prompt cache's entries, totals and limits; GET /debug/integrity.

Both read snapshots the engine thread makes between two steps (service/engine_views.py):
the route never walks the caches itself."""

from __future__ import annotations

from fastapi import APIRouter, Request

from ..service import engine_views
from ..service.state import tenant_of
from .common import state_of

router = APIRouter()


@router.get("/cache")
async def cache_info(request: Request) -> dict[str, object]:
    """The RAM prompt cache: ``{"enabled": false}`` without one, else its entries and limits,
    and under ``disk`` the disk tier's (``{"enabled": false}`` without one).

    Under --cache-isolation the caller sees its own tenant's entries only (``?cache_salt=``
    names its salt, as in /slots), and the totals (entries, bytes, tokens) are of those:
    another tenant's entry sizes would tell its prompts' lengths. Limits and the
    server-wide counters stay (/metrics has them too); the disk tier's write queue is not
    shown."""
    st = state_of(request)
    st.require_engine()
    owner: str | None = None
    if st.settings.cache_isolation != "none":
        owner = tenant_of(st, request, request.query_params.get("cache_salt"))
    view = await engine_views.cache(st, owner)
    if view is None:
        return {"enabled": False}
    return {"enabled": True, "idle_slots": view.idle_slots, **view.ram, "disk": view.disk}


@router.get("/debug/integrity")
async def integrity(request: Request) -> dict[str, object]:
    """Run the engine's and the RAM cache's integrity checks between two engine steps:
    every slot's tokens match its KV positions, checkpoints lie within them, cache bytes equal
    the sum of its entries, no entry is a prefix of another."""
    report = await engine_views.integrity(state_of(request))
    return {"ok": report.ok, "problems": report.problems}
