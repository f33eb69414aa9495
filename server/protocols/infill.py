"""llama-server's /infill: fill in the middle, for models with FIM tokens. The prompt is
built as llama-server builds it (server.prompts.infill_prompt); the response is /completion's."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from ..prompts.infill_prompt import InfillInputError, check_infill_body
from ..prompts.sources import InfillSource
from ..schemas.bodies import InfillRequest
from ..schemas.errors import APIError
from .common import state_of
from .native import run_native

router = APIRouter()

_FIM_FIELDS = {"input_prefix", "input_suffix", "input_extra", "prompt"}


@router.post("/infill")
async def infill(body: InfillRequest, request: Request) -> Response:
    """Code infill: 501 (llama-server's error) for a model without FIM tokens, 400 for a
    malformed body; otherwise /completion's response, streamed or not."""
    st = state_of(request)
    st.require_engine()
    missing = st.require_backend().fim.missing()
    if missing:
        raise APIError(501, f"Infill is not supported by this model: {missing}")
    try:
        extra = check_infill_body(body.model_dump(include=body.model_fields_set & _FIM_FIELDS))
    except InfillInputError as e:
        raise APIError(400, str(e)) from None
    return await run_native(st, request, body, InfillSource(st, body, extra))
