"""/slots: inspect slots; save, restore and erase them (DESIGN §8)."""

from __future__ import annotations

import asyncio
import ctypes
import json
import logging
import time
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from pydantic import ValidationError

from ..cache import slot_file
from ..errors import APIError
from ..schemas import SlotActionBody
from ..slots.slot import Slot
from .native import generation_settings
from .openai import state_of

router = APIRouter()
log = logging.getLogger("server.slots")


def slot_json(st: Any, s: Slot) -> dict[str, Any]:
    # Read without locks from the event loop: each field is a consistent snapshot of
    # itself (the GIL), the whole object may straddle one engine step.
    task = s.task
    ckpts = list(s.checkpoints)
    return {
        "id": s.id,
        "n_ctx": s.n_ctx,
        "is_processing": task is not None,
        "id_task": task.id if task is not None else -1,
        "state": s.state.value,
        "n_tokens": len(s.tokens),
        "n_prompt_tokens": s.n_prompt,
        "n_prompt_tokens_cache": s.n_cached,
        "n_prompt_tokens_processed": s.n_processed,
        "n_decoded": s.n_decoded,
        "next_token": {
            "has_next_token": task is not None,
            "n_remain": (task.gen.max_tokens - s.n_decoded)
            if task is not None and task.gen.max_tokens >= 0
            else -1,
            "n_decoded": s.n_decoded,
        },
        "params": generation_settings(st, task),
        "checkpoints": {
            "count": len(ckpts),
            "bytes": sum(c.nbytes for c in ckpts),
            "n_tokens": [c.n_tokens for c in ckpts],
        },
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
    return [slot_json(st, s) for s in engine.slots]


def _save_op(slot_id: int, tmp: Path):
    """llama.cpp writes the body (its own llama_state_seq_save_file, straight from the KV
    cache, no copy in Python); the appendix, fsync and rename happen off the engine thread."""

    def op(engine) -> tuple[int, list]:
        s = engine.slots[slot_id]
        if engine.b.state_save_file(str(tmp), s.id, s.tokens) == 0:
            raise slot_file.SlotFileError("llama.cpp could not write the slot state", 500)
        return len(s.tokens), list(s.checkpoints)

    return op


def _restore_op(slot_id: int, parsed: slot_file.ParsedFile):
    def op(engine) -> tuple[int, list[str]]:
        s = engine.slots[slot_id]
        b = engine.b
        size = len(parsed.buf) - parsed.state_off
        region = (ctypes.c_uint8 * size).from_buffer(parsed.buf, parsed.state_off)
        consumed = b.state_set(s.id, region, nbytes=size)
        n = len(parsed.tokens)
        if consumed == 0 or (n > 0 and b.seq_pos_max(s.id) != n - 1):
            b.seq_clear(s.id)
            s.tokens, s.checkpoints = [], []
            raise slot_file.SlotFileError(
                "the slot file's state does not fit this model or context (another model, "
                "or a truncated or corrupt file)"
            )
        app = slot_file.parse_appendices(parsed.buf, parsed.state_off + consumed, n)
        s.tokens = list(parsed.tokens)
        s.checkpoints = app.checkpoints
        s.last_used = time.perf_counter()  # most recently used: kept by the LRU choice
        return n, app.warnings

    return op


def _erase_op(slot_id: int):
    def op(engine) -> int:
        s = engine.slots[slot_id]
        n = len(s.tokens)
        engine.b.seq_clear(s.id)
        s.tokens, s.checkpoints = [], []
        return n

    return op


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
    if action == "erase":
        n = await asyncio.wrap_future(engine.call(_erase_op(sid), slot=sid))
        return {"id_slot": sid, "n_erased": n}
    if not st.settings.slot_save_path:
        raise APIError(
            501,
            "This server does not support slot save/restore. Start it with --slot-save-path",
            "not_supported_error",
        )
    try:
        body = SlotActionBody.model_validate(json.loads(await request.body() or b"{}"))
    except (ValueError, ValidationError):
        raise APIError(400, 'the body must be JSON like {"filename": "name"}') from None
    stats = engine.stats
    try:
        path = slot_file.resolve(st.settings.slot_save_path, body.filename)
        t0 = time.perf_counter()
        if action == "save":
            tmp = slot_file.temp_for(path)
            try:
                n_saved, ckpts = await asyncio.wrap_future(
                    engine.call(_save_op(sid, tmp), slot=sid)
                )
                written = await asyncio.to_thread(slot_file.finish_file, tmp, path, ckpts)
            finally:
                tmp.unlink(missing_ok=True)
            stats.slot_saves += 1
            stats.slot_bytes_written += written
            return {
                "id_slot": sid,
                "filename": body.filename,
                "n_saved": n_saved,
                "n_written": written,
                "timings": {"save_ms": (time.perf_counter() - t0) * 1e3},
            }
        b = st.backend
        parsed = await asyncio.to_thread(
            slot_file.read_file, path, engine.slots[sid].n_ctx, b.n_vocab, sid, b.state_file_version
        )
        n, warnings = await asyncio.wrap_future(engine.call(_restore_op(sid, parsed), slot=sid))
        for w in warnings:
            log.warning("slot %d restore from %s: %s", sid, body.filename, w)
        stats.slot_restores += 1
        stats.slot_bytes_read += parsed.n_read
        out = {
            "id_slot": sid,
            "filename": body.filename,
            "n_restored": n,
            "n_read": parsed.n_read,
            "timings": {"restore_ms": (time.perf_counter() - t0) * 1e3},
        }
        if warnings:
            out["warnings"] = warnings
        return out
    except slot_file.SlotFileError as e:
        stats.slot_file_failures += 1
        raise APIError(e.status, str(e)) from None
    except MemoryError:
        stats.slot_file_failures += 1
        raise APIError(400, "slot file is too large to load") from None
    except OSError as e:
        stats.slot_file_failures += 1
        raise APIError(500, f"slot file I/O failed: {e.strerror or e}") from None
