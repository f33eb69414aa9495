"""The snapshots the HTTP side reads of the engine (GET /slots, GET /cache,
GET /debug/integrity): each is an engine command run between two steps on the engine
thread, so what a route shows is one consistent moment, and the route neither walks the
engine's slots and caches nor imports the engine (server/engine_api.py holds the views)."""

from __future__ import annotations

import asyncio

from ..engine.commands import CheckIntegrity, DescribeCache, DescribeSlots
from ..engine_api import CacheView, IntegrityReport, SlotSnapshot
from .state import ServerState


async def slots(st: ServerState) -> list[SlotSnapshot]:
    """Every slot, in slot order (503 without a running engine)."""
    engine = st.require_engine()
    return await asyncio.wrap_future(engine.submit_command(DescribeSlots()))


async def cache(st: ServerState, owner: str | None) -> CacheView | None:
    """The RAM cache and the disk tier (None without a RAM cache); ``owner``: only that
    tenant's entries and totals (--cache-isolation)."""
    engine = st.require_engine()
    ask = DescribeCache(owner, engine.opts.cache_idle_slots)
    return await asyncio.wrap_future(engine.submit_command(ask))


async def integrity(st: ServerState) -> IntegrityReport:
    """The engine's, the RAM cache's and the disk tier's integrity checks."""
    engine = st.require_engine()
    return await asyncio.wrap_future(engine.submit_command(CheckIntegrity()))
