"""``GET``/``POST /lora-adapters``: llama-server's list of loaded LoRA adapters and their
global scales (service/adapters.py). A request's own ``lora`` field, or a ``model`` naming
an alias, overrides the global scales for that request only."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse
from pydantic import TypeAdapter, ValidationError

from ..json_value import JsonObject
from ..schemas.bodies import LoraScale
from ..schemas.errors import APIError
from ..schemas.json_body import parse_json_body
from ..service import lora_runtime
from .common import state_of

router = APIRouter()
_ITEMS = TypeAdapter(list[LoraScale])


@router.get("/lora-adapters")
async def get_lora_adapters(request: Request) -> list[JsonObject]:
    """Each adapter: ``id``, ``path``, ``scale`` (global), ``task_name``, ``prompt_prefix``
    (llama-server's fields) and ``alias`` where --lora-alias names it."""
    return state_of(request).adapters.describe()


@router.post("/lora-adapters")
async def post_lora_adapters(request: Request) -> JsonObject:
    """Set the global scales: ``[{"id": 0, "scale": 0.5}]``; an adapter left out gets 0
    (llama-server's rule). 400 for a malformed body or an unknown id. Runs already started
    keep the scales they started with; cached states stay keyed by theirs."""
    st = state_of(request)
    body = parse_json_body(await request.body())  # depth-bounded: a 400, never a 500
    try:
        items = _ITEMS.validate_python(body)
    except (ValidationError, ValueError) as e:
        raise APIError(400, f"expected a list of {{id, scale}} items: {e}") from None
    st.adapters.set_global(items)
    return {"success": True}


def _object(raw: bytes) -> JsonObject:
    body = parse_json_body(raw)
    if not isinstance(body, dict):
        raise APIError(400, "expected a JSON object")
    return body


@router.post("/v1/load_lora_adapter", response_class=PlainTextResponse)
async def load_lora_adapter(request: Request) -> str:
    """vLLM's: ``{"lora_name", "lora_path"}`` loads the adapter file (under
    --lora-runtime-dir; --enable-lora-runtime, else 404); requests then name it as their
    ``model`` (service/lora_runtime.py)."""
    st = state_of(request)
    return await lora_runtime.load(st, _object(await request.body()))


@router.post("/v1/unload_lora_adapter", response_class=PlainTextResponse)
async def unload_lora_adapter(request: Request) -> str:
    """vLLM's: ``{"lora_name"}`` unloads an adapter loaded at run time."""
    st = state_of(request)
    return await lora_runtime.unload(st, _object(await request.body()))
