"""/slots: inspect slots; save, restore and erase them (ARCHITECTURE §8). The routes check
the request (slot id, action, body, the server's flags); the file work and the engine's
part are service/slot_files.py's."""

from __future__ import annotations

from fastapi import APIRouter, Request
from pydantic import ValidationError

from ..engine_api import SlotSnapshot
from ..json_value import JsonObject
from ..schemas.bodies import SlotActionBody
from ..schemas.errors import APIError
from ..schemas.json_body import parse_json_body
from ..service import engine_views, slot_files
from ..service.state import ServerState, tenant_of
from .common import generation_settings, state_of

router = APIRouter()


def slot_json(st: ServerState, s: SlotSnapshot, viewer: str | None = None) -> JsonObject:
    """One slot as llama-server shows it. With ``viewer`` (cache isolation on), another
    tenant's request parameters (stop strings, logit bias, seed...) are not shown."""
    task = s.task
    return {
        "id": s.id,
        "n_ctx": s.n_ctx,
        "is_processing": task is not None,
        "id_task": task.id if task is not None else -1,
        "state": s.state,
        "n_tokens": s.n_tokens,
        "n_prompt_tokens": s.n_prompt,
        "n_prompt_tokens_cache": s.n_cached,
        "n_prompt_tokens_processed": s.n_processed,
        "n_decoded": s.n_decoded,
        # llama-server's shape (a one-item list); an idle slot keeps no budget of its last task
        "next_token": [
            {
                "has_next_token": task is not None,
                "has_new_line": False,
                "n_remain": (task.gen.max_tokens - s.n_decoded)
                if task is not None and task.gen.max_tokens >= 0
                else -1,
                "n_decoded": s.n_decoded if task is not None else 0,
            }
        ],
        "params": generation_settings(st, task) if viewer is None or viewer == s.owner else {},
        "checkpoints": {
            "count": len(s.checkpoint_tokens),
            "bytes": s.checkpoint_bytes,
            "n_tokens": list(s.checkpoint_tokens),
        },
        # with a draft model: the tokens of the slot its sequence holds
        **({"draft": {"n_tokens": s.draft_tokens}} if st.draft is not None else {}),
    }


@router.get("/slots")
async def list_slots(request: Request, fail_on_no_slot: int = 0) -> list[JsonObject]:
    st = state_of(request)
    if not st.settings.slots:
        raise APIError(
            501,
            "This server does not support slots endpoint. Start it without --no-slots",
            "not_supported_error",
        )
    views = await engine_views.slots(st)
    if fail_on_no_slot and all(not s.idle for s in views):
        raise APIError(503, "no slot available", "unavailable_error")
    isolated = st.settings.cache_isolation != "none"
    viewer = tenant_of(st, request, request.query_params.get("cache_salt")) if isolated else None
    return [slot_json(st, s, viewer) for s in views]


def _slot_id(id_slot: str, n_slots: int) -> int:
    try:
        sid = int(id_slot)
    except ValueError:
        raise APIError(400, f"invalid slot id {id_slot!r}") from None
    if not 0 <= sid < n_slots:
        raise APIError(400, f"invalid slot id {sid}: this server has {n_slots} slots")
    return sid


def _filename(raw: bytes) -> str:
    body = parse_json_body(raw, empty={})  # depth-bounded: a 400, never a RecursionError
    try:
        return SlotActionBody.model_validate(body).filename
    except (ValueError, ValidationError):
        raise APIError(400, 'the body must be JSON like {"filename": "name"}') from None


@router.post("/slots/{id_slot}")
async def slot_action(id_slot: str, request: Request, action: str = "") -> JsonObject:
    """save, restore, erase (ARCHITECTURE §8). Under --cache-isolation each is checked against
    the caller's tenant: another tenant's slot or file is a 403."""
    st = state_of(request)
    engine = st.require_engine()
    sid = _slot_id(id_slot, len(engine.slots))
    if action not in ("save", "restore", "erase"):
        raise APIError(400, f"invalid action {action!r}: use save, restore or erase")
    if not st.settings.slot_save_path:  # llama-server gates every slot action so
        raise APIError(
            501,
            "This server does not support slot save/restore/erase. Start it with --slot-save-path",
            "not_supported_error",
        )
    who = slot_files.caller(st, tenant_of(st, request, request.query_params.get("cache_salt")))
    if action == "erase":
        return await slot_files.erase(engine, sid, who)
    name = _filename(await request.body())
    return await slot_files.save_or_restore(st, engine, sid, action, name, who)
