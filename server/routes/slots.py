"""/slots: inspect slots; save, restore and erase them (DESIGN §8)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from pydantic import ValidationError

from ..cache import slot_file
from ..errors import APIError
from ..schemas import SlotActionBody
from ..service import ServerState, tenant_of
from ..slots.audit import kv_type_problem, seq_state_problem
from ..slots.engine import Engine, EngineDead
from ..slots.slot import Slot
from ..slots.store import FileAppendix
from .common import generation_settings, state_of

router = APIRouter()
log = logging.getLogger("server.slots")


def slot_json(st: Any, s: Slot, viewer: str | None = None) -> dict[str, Any]:
    """One slot as llama-server shows it. With ``viewer`` (cache isolation on), another
    tenant's request parameters (stop strings, logit bias, seed...) are not shown."""
    # Read without locks from the event loop: each field is a consistent snapshot of
    # itself (the GIL), the whole object may straddle one engine step.
    task = s.task
    run = s.run  # the running task's, or the last one's when idle
    n_decoded = run.n_decoded if run is not None else 0
    ckpts = list(s.checkpoints)
    return {
        "id": s.id,
        "n_ctx": s.n_ctx,
        "is_processing": task is not None,
        "id_task": task.id if task is not None else -1,
        "state": s.state.value,
        "n_tokens": len(s.tokens),
        "n_prompt_tokens": run.n_prompt if run is not None else 0,
        "n_prompt_tokens_cache": run.n_cached if run is not None else 0,
        "n_prompt_tokens_processed": run.n_processed if run is not None else 0,
        "n_decoded": n_decoded,
        # llama-server's shape (a one-item list); an idle slot keeps no budget of its last task
        "next_token": [
            {
                "has_next_token": task is not None,
                "has_new_line": False,
                "n_remain": (task.gen.max_tokens - n_decoded)
                if task is not None and task.gen.max_tokens >= 0
                else -1,
                "n_decoded": n_decoded if task is not None else 0,
            }
        ],
        "params": generation_settings(st, task) if viewer is None or viewer == s.tenant else {},
        "checkpoints": {
            "count": len(ckpts),
            "bytes": sum(c.nbytes for c in ckpts),
            "n_tokens": [c.n_tokens for c in ckpts],
        },
        # with a draft model: the tokens its sequence holds (a prefix of n_tokens)
        **({"draft": {"n_tokens": s.n_dft}} if getattr(st, "draft", None) is not None else {}),
    }


@router.get("/slots")
async def list_slots(request: Request, fail_on_no_slot: int = 0) -> list[dict[str, Any]]:
    st = state_of(request)
    if not st.settings.slots:
        raise APIError(
            501,
            "This server does not support slots endpoint. Start it without --no-slots",
            "not_supported_error",
        )
    engine = st.require_engine()
    if fail_on_no_slot and all(not s.idle for s in engine.slots):
        raise APIError(503, "no slot available", "unavailable_error")
    isolated = st.settings.cache_isolation != "none"
    viewer = tenant_of(st, request, request.query_params.get("cache_salt")) if isolated else None
    return [slot_json(st, s, viewer) for s in engine.slots]


def _save_op(slot_id: int, tmp: Path):
    """llama.cpp writes the body (its own llama_state_seq_save_file, straight from the KV
    cache, no copy in Python); the appendix, fsync and rename happen off the engine thread."""

    def op(engine: Engine) -> tuple[int, FileAppendix]:
        s = engine.slots[slot_id]
        app = engine.store.save_file(s, str(tmp))
        if app is None:
            raise slot_file.SlotFileError("llama.cpp could not write the slot state", 500)
        return len(s.tokens), app

    return op


def _restore_op(slot_id: int, parsed: slot_file.ParsedFile, plan: RestorePlan, tenant: str):
    def op(engine: Engine) -> tuple[int, list[str]]:
        s = engine.slots[slot_id]
        # the plan proved these bytes off this thread; restore_file proves them again here,
        # where they are loaded: the mapping is private, but the file is another's to change
        app = engine.store.restore_file(
            s,
            parsed.buf,
            parsed.state_off,
            plan.state_end,
            list(parsed.tokens),
            exact=plan.known,
            appendices=plan.appendices,
        )
        if app is None:
            raise slot_file.SlotFileError(
                "the slot file's state does not fit this model or context (another model, a "
                "truncated or corrupt file, or a token list that does not match the state)"
            )
        s.tenant = tenant  # the restoring request's, whoever saved the file
        s.last_used = time.perf_counter()  # most recently used: kept by the LRU choice
        return len(parsed.tokens), app.warnings

    return op


@dataclass
class RestorePlan:
    """What is known of a slot file before the engine loads it: where its state ends (the
    file's end when unknown) and its appendices, parsed off the engine thread."""

    known: bool
    state_end: int
    appendices: slot_file.Appendices | None


def plan_restore(backend: Any, parsed: slot_file.ParsedFile) -> RestorePlan:
    """Read the state's cells without loading them (any thread): a state that is not exactly
    the KV of the file's tokens is refused here, with a 400, and never reaches llama.cpp."""
    size = len(parsed.buf)
    try:
        read = backend.state_cells(parsed.buf, size, start=parsed.state_off)
    except ValueError as e:
        raise slot_file.SlotFileError(f"the slot file's state is not readable: {e}") from None
    if read is None:
        return RestorePlan(False, size, None)
    caches, end = read
    problem = seq_state_problem(caches, len(parsed.tokens), backend.n_swa)
    if problem:
        raise slot_file.SlotFileError(
            f"the slot file's state does not match its {len(parsed.tokens)} tokens: {problem}"
        )
    # another KV cache type (-ctk / -ctv): the state's own per-layer types, then SKVT
    want = getattr(backend, "kv_type_ids", None)
    app = slot_file.parse_appendices(parsed.buf, end, len(parsed.tokens))
    problem = kv_type_problem(caches, want) or slot_file.kv_types_problem(app, want)
    if problem:
        raise slot_file.SlotFileError(
            f"the slot file's KV cache does not fit this server: {problem}"
        )
    return RestorePlan(True, end, app)


def _erase_op(slot_id: int):
    def op(engine: Engine) -> int:
        return engine.store.clear(engine.slots[slot_id])

    return op


def _record(engine: Engine, **counts: int) -> None:
    """Count a slot-file operation in the engine statistics, on the engine thread (they are
    written there only). Fire and forget: a stopped engine has nothing left to count."""

    def op(e: Engine) -> None:
        e.stats.on_slot_file(**counts)

    try:
        engine.call(op)
    except EngineDead:
        pass


@router.post("/slots/{id_slot}")
async def slot_action(id_slot: str, request: Request, action: str = "") -> dict[str, Any]:
    st = state_of(request)
    engine = st.require_engine()
    try:
        sid = int(id_slot)
    except ValueError:
        raise APIError(400, f"invalid slot id {id_slot!r}") from None
    if not 0 <= sid < len(engine.slots):
        raise APIError(400, f"invalid slot id {sid}: this server has {len(engine.slots)} slots")
    if action not in ("save", "restore", "erase"):
        raise APIError(400, f"invalid action {action!r}: use save, restore or erase")
    if not st.settings.slot_save_path:  # llama-server gates every slot action so
        raise APIError(
            501,
            "This server does not support slot save/restore/erase. Start it with --slot-save-path",
            "not_supported_error",
        )
    tenant = tenant_of(st, request, request.query_params.get("cache_salt"))
    held = engine.slots[sid]
    isolated = st.settings.cache_isolation != "none"
    if action == "save" and isolated and held.tokens and held.tenant != tenant:
        raise APIError(403, f"slot {sid} holds another tenant's prompt")
    if action == "erase":
        n = await asyncio.wrap_future(engine.call(_erase_op(sid), slot=sid))
        return {"id_slot": sid, "n_erased": n}
    try:
        body = SlotActionBody.model_validate(json.loads(await request.body() or b"{}"))
    except (ValueError, ValidationError):
        raise APIError(400, 'the body must be JSON like {"filename": "name"}') from None
    try:
        path = slot_file.resolve(st.settings.slot_save_path, body.filename)
        if action == "save":
            return await _save(engine, sid, path, body.filename)
        return await _restore(st, engine, sid, path, body.filename, tenant)
    except slot_file.SlotFileError as e:
        _record(engine, failures=1)
        raise APIError(e.status, str(e)) from None
    except MemoryError:
        _record(engine, failures=1)
        raise APIError(400, "slot file is too large to load") from None
    except OSError as e:
        _record(engine, failures=1)
        raise APIError(500, f"slot file I/O failed: {e.strerror or e}") from None


async def _save(engine: Engine, sid: int, path: Path, name: str) -> dict[str, Any]:
    t0 = time.perf_counter()
    tmp = slot_file.temp_for(path)
    try:
        n_saved, app = await asyncio.wrap_future(engine.call(_save_op(sid, tmp), slot=sid))
        written = await asyncio.to_thread(
            slot_file.finish_file, tmp, path, app.checkpoints, app.draft, app.kv_types
        )
    finally:
        tmp.unlink(missing_ok=True)
    _record(engine, saves=1, bytes_written=written)
    return {
        "id_slot": sid,
        "filename": name,
        "n_saved": n_saved,
        "n_written": written,
        "timings": {"save_ms": (time.perf_counter() - t0) * 1e3},
    }


async def _restore(
    st: ServerState, engine: Engine, sid: int, path: Path, name: str, tenant: str
) -> dict[str, Any]:
    t0 = time.perf_counter()
    b = st.backend
    parsed = await asyncio.to_thread(
        slot_file.read_file, path, engine.slots[sid].n_ctx, b.n_vocab, sid, b.state_file_version
    )
    plan = await asyncio.to_thread(plan_restore, b, parsed)
    n, warnings = await asyncio.wrap_future(
        engine.call(_restore_op(sid, parsed, plan, tenant), slot=sid)
    )
    for w in warnings:
        log.warning("slot %d restore from %s: %s", sid, name, w)
    _record(engine, restores=1, bytes_read=parsed.n_read)
    out: dict[str, Any] = {
        "id_slot": sid,
        "filename": name,
        "n_restored": n,
        "n_read": parsed.n_read,
        "timings": {"restore_ms": (time.perf_counter() - t0) * 1e3},
    }
    if warnings:
        out["warnings"] = warnings
    return out
