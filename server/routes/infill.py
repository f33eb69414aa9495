"""llama-server's /infill: fill in the middle, for models with FIM tokens. The prompt is
built as llama-server builds it (server.api.infill); the response is /completion's."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from ..api.errors import APIError
from ..api.infill import InfillInputError, InfillLimits, check_infill_body, infill_prompt
from ..api.schemas import InfillRequest
from ..service.state import ServerState
from ..service.submit import Prompt
from ..service.tokenizer import tokenize
from .common import state_of
from .native import run_native

router = APIRouter()

_FIM_FIELDS = {"input_prefix", "input_suffix", "input_extra", "prompt"}


def _prompt(st: ServerState, body: InfillRequest, extra: list) -> list[Prompt]:
    """The FIM prompt: ``prompt`` (special tokens parsed, no BOS) goes after the prefix."""
    b = st.backend
    lim = InfillLimits(
        n_batch=b.n_batch,
        n_predict=st.settings.n_predict,
        n_ctx=b.n_ctx_slot,
        spm=st.settings.spm_infill,
    )
    bos = b.bos_id if b.add_bos and b.bos_id >= 0 else None

    def tok(text: str, add_special: bool, parse_special: bool) -> list[int]:
        return tokenize(b, text, add_special, parse_special)

    tokens = tok(body.prompt or "", False, True)
    return [
        Prompt(
            infill_prompt(tok, b.fim, bos, body.input_prefix, body.input_suffix, extra, tokens, lim)
        )
    ]


@router.post("/infill")
async def infill(body: InfillRequest, request: Request) -> Response:
    """Code infill: 501 (llama-server's error) for a model without FIM tokens, 400 for a
    malformed body; otherwise /completion's response, streamed or not."""
    st = state_of(request)
    st.require_engine()
    missing = st.backend.fim.missing()
    if missing:
        raise APIError(501, f"Infill is not supported by this model: {missing}")
    try:
        extra = check_infill_body(body.model_dump(include=body.model_fields_set & _FIM_FIELDS))
    except InfillInputError as e:
        raise APIError(400, str(e)) from None
    return await run_native(st, request, body, lambda: _prompt(st, body, extra))
