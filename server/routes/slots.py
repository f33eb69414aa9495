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

from ..api.errors import APIError
from ..api.schemas import SlotActionBody
from ..cache import slot_file, tenancy
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
        # with a draft model: the tokens of the slot its sequence holds
        **({"draft": {"n_tokens": _draft_tokens(st, s)}} if st.draft is not None else {}),
    }


def _draft_tokens(st: Any, s: Slot) -> int:
    return st.engine.store.draft_shared(s) if st.engine is not None else 0


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


class TenantRefused(slot_file.SlotFileError):
    """A slot action on another tenant's slot or file (--cache-isolation): a 403."""

    def __init__(self, message: str) -> None:
        super().__init__(message, 403)


@dataclass(frozen=True)
class Caller:
    """Who asks for a slot action: its tenant, and whether tenants are kept apart."""

    tenant: str
    isolated: bool

    def check_slot(self, s: Slot, what: str) -> None:
        """Under isolation, a slot holding another tenant's prompt is not the caller's to
        ``what`` (save, erase, restore into): TenantRefused. Engine thread, in the op that
        acts, so the check and the action see the same slot."""
        if self.isolated and s.tokens and s.tenant != self.tenant:
            raise TenantRefused(f"slot {s.id} holds another tenant's prompt: cannot {what} it")

    def check_file(self, parsed: slot_file.ParsedFile, name: str) -> None:
        """Under isolation, only the tenant that saved a file may restore it; a file that
        names no tenant (llama-server's, or saved before tenants were recorded) is nobody's
        to restore: TenantRefused."""
        if self.isolated and parsed.tenant != self.tenant:
            whose = "another tenant" if parsed.tenant is not None else "no recorded tenant"
            raise TenantRefused(f"slot file {name!r} was saved by {whose}: cannot restore it")


def _save_op(slot_id: int, tmp: Path, who: Caller):
    """llama.cpp writes the body (its own llama_state_seq_save_file, straight from the KV
    cache, no copy in Python); the appendix, fsync and rename happen off the engine thread.
    Returns the tokens saved, the appendices, and the tenant the file records (the slot's;
    None for one request's private tenant, which is never persisted)."""

    def op(engine: Engine) -> tuple[int, FileAppendix, str | None]:
        s = engine.slots[slot_id]
        who.check_slot(s, "save")
        owner = s.tenant if s.tokens else who.tenant
        app = engine.store.save_file(s, str(tmp))
        if app is None:
            raise slot_file.SlotFileError("llama.cpp could not write the slot state", 500)
        return len(s.tokens), app, owner if tenancy.persistable(owner) else None

    return op


REFUSED_STATE = (
    "the slot file's state does not fit this model or context (another model, a "
    "truncated or corrupt file, or a token list that does not match the state)"
)


def _restore_op(slot_id: int, parsed: slot_file.ParsedFile, plan: RestorePlan, who: Caller):
    """Load the file into the slot. With a known layout the appendices were parsed off this
    thread (``plan``) and everything is done here; else only the state is loaded, and the
    op returns the bytes consumed, for the appendices to be parsed off this thread and
    applied by ``_appendices_op``."""

    def op(engine: Engine) -> tuple[int, list[str]] | int:
        s = engine.slots[slot_id]
        who.check_slot(s, "restore into")
        # the plan proved these bytes off this thread; the store proves them again here,
        # where they are loaded: the mapping is private, but the file is another's to change
        tokens = list(parsed.tokens)
        args = (s, parsed.buf, parsed.state_off, plan.state_end, tokens)
        if plan.appendices is None:
            consumed = engine.store.load_file_state(*args, exact=False)
            if consumed == 0:
                raise slot_file.SlotFileError(REFUSED_STATE)
            _claim(s, who)
            return consumed
        app = engine.store.restore_file(*args, exact=plan.known, appendices=plan.appendices)
        if app is None:
            raise slot_file.SlotFileError(REFUSED_STATE)
        _claim(s, who)
        return len(parsed.tokens), app.warnings

    return op


def _claim(s: Slot, who: Caller) -> None:
    s.tenant = who.tenant  # the restoring request's (under isolation: the file's too)
    s.last_used = time.perf_counter()  # most recently used: kept by the LRU choice


def _appendices_op(slot_id: int, tokens: list[int], app: slot_file.Appendices, who: Caller):
    """Give a slot restored by ``_restore_op`` (state only) its file's appendices, parsed
    off the engine thread, if it still holds just that state (a request may have used it
    meanwhile: then they are dropped, with a warning)."""

    def op(engine: Engine) -> tuple[int, list[str]]:
        s = engine.slots[slot_id]
        if s.tenant != who.tenant or s.tokens != tokens:
            app.warnings.append("the slot was used before its appendices were read; dropped")
            return len(tokens), app.warnings
        if not engine.store.apply_appendices(s, app):
            raise slot_file.SlotFileError(REFUSED_STATE)
        return len(tokens), app.warnings

    return op


@dataclass
class RestorePlan:
    """What is known of a slot file before the engine loads it: where its state ends (the
    end of its appendices when unknown) and its appendices, parsed off the engine thread
    (None: the state's end is unknown, so they are parsed once the engine has loaded it)."""

    known: bool
    state_end: int
    appendices: slot_file.Appendices | None


def plan_restore(
    backend: Any, parsed: slot_file.ParsedFile, max_checkpoints: int | None = None
) -> RestorePlan:
    """Read the state's cells without loading them (any thread): a state that is not exactly
    the KV of the file's tokens is refused here, with a 400, and never reaches llama.cpp.
    The appendices are parsed here too (at most ``max_checkpoints`` kept), never on the
    engine thread."""
    size = parsed.end  # the state and its appendices; the STNT footer after them
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
    want = backend.kv_type_ids
    app = parse_after_state(parsed, end, max_checkpoints)
    problem = kv_type_problem(caches, want) or slot_file.kv_types_problem(app, want)
    if problem:
        raise slot_file.SlotFileError(
            f"the slot file's KV cache does not fit this server: {problem}"
        )
    return RestorePlan(True, end, app)


def parse_after_state(
    parsed: slot_file.ParsedFile, pos: int, max_checkpoints: int | None
) -> slot_file.Appendices:
    """The appendices from ``pos`` (where the state ends) up to the STNT footer. Any
    thread."""
    with memoryview(parsed.buf) as whole, whole[: parsed.end] as body:
        return slot_file.parse_appendices(body, pos, len(parsed.tokens), max_checkpoints)


def _erase_op(slot_id: int, who: Caller):
    def op(engine: Engine) -> int:
        s = engine.slots[slot_id]
        who.check_slot(s, "erase")
        return engine.store.clear(s)

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


def _slot_id(id_slot: str, engine: Engine) -> int:
    try:
        sid = int(id_slot)
    except ValueError:
        raise APIError(400, f"invalid slot id {id_slot!r}") from None
    if not 0 <= sid < len(engine.slots):
        raise APIError(400, f"invalid slot id {sid}: this server has {len(engine.slots)} slots")
    return sid


def _filename(raw: bytes) -> str:
    try:
        return SlotActionBody.model_validate(json.loads(raw or b"{}")).filename
    except (ValueError, ValidationError):
        raise APIError(400, 'the body must be JSON like {"filename": "name"}') from None


@router.post("/slots/{id_slot}")
async def slot_action(id_slot: str, request: Request, action: str = "") -> dict[str, Any]:
    """save, restore, erase (DESIGN §8). Under --cache-isolation each is checked against
    the caller's tenant: another tenant's slot or file is a 403."""
    st = state_of(request)
    engine = st.require_engine()
    sid = _slot_id(id_slot, engine)
    if action not in ("save", "restore", "erase"):
        raise APIError(400, f"invalid action {action!r}: use save, restore or erase")
    if not st.settings.slot_save_path:  # llama-server gates every slot action so
        raise APIError(
            501,
            "This server does not support slot save/restore/erase. Start it with --slot-save-path",
            "not_supported_error",
        )
    tenant = tenant_of(st, request, request.query_params.get("cache_salt"))
    who = Caller(tenant, st.settings.cache_isolation != "none")
    try:
        if action == "erase":
            n = await asyncio.wrap_future(engine.call(_erase_op(sid, who), slot=sid))
            return {"id_slot": sid, "n_erased": n}
        name = _filename(await request.body())
        path = slot_file.resolve(st.settings.slot_save_path, name)
        if action == "save":
            return await _save(engine, sid, path, name, who)
        return await _restore(st, engine, sid, path, name, who)
    except TenantRefused as e:
        raise APIError(403, str(e)) from None
    except slot_file.SlotFileError as e:
        _record(engine, failures=1)
        raise APIError(e.status, str(e)) from None
    except MemoryError:
        _record(engine, failures=1)
        raise APIError(400, "slot file is too large to load") from None
    except OSError as e:
        _record(engine, failures=1)
        raise APIError(500, f"slot file I/O failed: {e.strerror or e}") from None


async def _save(engine: Engine, sid: int, path: Path, name: str, who: Caller) -> dict[str, Any]:
    t0 = time.perf_counter()
    tmp = slot_file.temp_for(path)
    try:
        fut = engine.call(_save_op(sid, tmp, who), slot=sid)
        n_saved, app, owner = await asyncio.wrap_future(fut)
        written = await asyncio.to_thread(
            slot_file.finish_file, tmp, path, app.checkpoints, app.draft, app.kv_types, owner
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
    st: ServerState, engine: Engine, sid: int, path: Path, name: str, who: Caller
) -> dict[str, Any]:
    """Read, check and parse the file off the engine thread (tenant, state cells,
    appendices); the engine thread only loads what was proven."""
    t0 = time.perf_counter()
    b = st.backend
    parsed = await asyncio.to_thread(
        slot_file.read_file, path, engine.slots[sid].n_ctx, b.n_vocab, sid, b.state_file_version
    )
    who.check_file(parsed, name)
    keep = engine.store.ckpt.max_per_slot
    plan = await asyncio.to_thread(plan_restore, b, parsed, keep)
    got = await asyncio.wrap_future(engine.call(_restore_op(sid, parsed, plan, who), slot=sid))
    if isinstance(got, int):  # the state alone: its appendices start where it ended
        app = await asyncio.to_thread(parse_after_state, parsed, parsed.state_off + got, keep)
        op = _appendices_op(sid, list(parsed.tokens), app, who)
        got = await asyncio.wrap_future(engine.call(op, slot=sid))
    n, warnings = got
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
