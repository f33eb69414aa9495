"""GET /metrics (behind --metrics): the Prometheus exposition of ``server.http.metrics``."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from ..schemas.errors import APIError
from .common import state_of

router = APIRouter()


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    """Prometheus text; 501 (llama-server's answer) unless started with --metrics."""
    st = state_of(request)
    if not st.settings.metrics:
        raise APIError(
            501,
            "This server does not support metrics endpoint. Start it with --metrics",
            "not_supported_error",
        )
    if st.sleeping:  # what it said just before falling asleep (llama-server's rule)
        text = st.sleep_metrics
    else:
        st.require_engine()
        text = st.metrics.exposition()
    response = Response(text, media_type=CONTENT_TYPE_LATEST)
    # llama-server's header: scrapers tell a restart from a counter reset by it. Appended raw
    # because Starlette lower-cases the names it is given, and some clients (llama.cpp's own
    # tests among them) look this one up case-sensitively; h11 sends names as they are.
    response.raw_headers.append((b"Process-Start-Time-Unix", str(int(st.started)).encode()))
    return response
