"""GET /metrics (behind --metrics) and the ASGI middleware that counts requests."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from ..errors import APIError
from .openai import state_of

router = APIRouter()

KNOWN = {
    "/v1/completions",
    "/completions",
    "/v1/chat/completions",
    "/chat/completions",
    "/completion",
    "/tokenize",
    "/debug/integrity",
    "/detokenize",
    "/health",
    "/v1/health",
    "/props",
    "/slots",
    "/metrics",
    "/cache",
    "/v1/models",
    "/models",
}


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    st = state_of(request)
    if not st.settings.metrics:
        raise APIError(
            501,
            "This server does not support metrics endpoint. Start it with --metrics",
            "not_supported_error",
        )
    st.require_engine()
    return Response(st.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)
