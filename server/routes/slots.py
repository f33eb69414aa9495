"""/slots: inspect slots (save/restore/erase on disk come with the slot-file module)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from ..engine.slot import Slot
from ..errors import APIError
from .native import generation_settings
from .openai import state_of

router = APIRouter()


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
        "params": generation_settings(st),
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
