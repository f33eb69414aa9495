"""GET /cache: the RAM prompt cache's entries, totals and limits; GET /debug/integrity."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from fastapi import APIRouter, Request

from ..engine.commands import CheckIntegrity
from ..service.state import tenant_of
from ..tiers import tenancy
from .common import state_of

if TYPE_CHECKING:
    from ..engine.engine import Engine

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
    engine = st.require_engine()
    if engine.cache is None:
        return {"enabled": False}
    disk = engine.disk.describe() if engine.disk is not None else {"enabled": False}
    ram = engine.cache.describe()
    if st.settings.cache_isolation != "none":
        tenant = tenant_of(st, request, request.query_params.get("cache_salt"))
        ram = _ram_of(engine, ram, tenant)
        disk = _disk_of(engine, disk, tenant) if engine.disk is not None else disk
    return {
        "enabled": True,
        "idle_slots": engine.opts.cache_idle_slots,
        **ram,
        "disk": disk,  # the tier under RAM (--cache-disk)
    }


def _ram_of(engine: Engine, ram: dict[str, object], tenant: str) -> dict[str, object]:
    """The RAM cache's description cut to ``tenant``'s entries (and their totals)."""
    assert engine.cache is not None
    mine = [e for e in list(engine.cache.entries) if tenancy.owner(e.tenant) == tenant]
    now = time.time()
    entries = [
        {
            "n_tokens": len(e.tokens),
            "n_bytes": e.nbytes,
            "n_checkpoints": len(e.checkpoints),
            "age_s": round(now - e.created, 3),
        }
        for e in mine
    ]
    return {
        **ram,
        "n_entries": len(entries),
        "n_bytes": sum(x["n_bytes"] for x in entries),
        "n_tokens": sum(x["n_tokens"] for x in entries),
        "entries": entries,
    }


def _disk_of(engine: Engine, disk: dict[str, object], tenant: str) -> dict[str, object]:
    """The disk tier's description cut to ``tenant``'s entries (file names are unique; an
    entry indexed or dropped meanwhile is left out, never another tenant's shown)."""
    assert engine.disk is not None
    names = {e.name for e in list(engine.disk.index.entries) if tenancy.owner(e.tenant) == tenant}
    listed = disk.get("entries", [])
    entries = [x for x in (listed if isinstance(listed, list) else []) if x["name"] in names]
    out = {k: v for k, v in disk.items() if k not in ("n_pending", "pending_bytes")}
    out |= {"n_entries": len(entries), "n_bytes": sum(x["n_bytes"] for x in entries)}
    return out | {"entries": entries}


@router.get("/debug/integrity")
async def integrity(request: Request) -> dict[str, object]:
    """Run the engine's and the RAM cache's integrity checks between two engine steps:
    every slot's tokens match its KV positions, checkpoints lie within them, cache bytes equal
    the sum of its entries, no entry is a prefix of another."""
    engine = state_of(request).require_engine()
    report = await asyncio.wrap_future(engine.submit_command(CheckIntegrity()))
    return {"ok": report.ok, "problems": report.problems}
