"""OpenAI-shaped errors: {"error": {"code", "message", "type"}} with the matching HTTP status.

``error_body`` builds every error body the server sends: exception handlers here, the
middlewares' 401 and 413, and the error events of streams."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic_core import ErrorDetails
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("server.schemas.errors")

# OpenAI's error type for a status, where the raiser names none.
TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    500: "server_error",
    501: "not_supported_error",
    503: "unavailable_error",
}


def error_type(status: int, type: str | None = None) -> str:
    """``type`` if given, else the one OpenAI uses for ``status``."""
    return type or TYPES.get(status, "server_error")


class APIError(Exception):
    """A request fails with ``status``: raised anywhere below a route, answered with
    ``error_body`` by the handler ``install`` registers. ``extra`` fields join the error
    object (e.g. ``n_ctx``); ``headers`` join the response (e.g. ``Retry-After``)."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str | None = None,
        headers: dict[str, str] | None = None,
        **extra: object,
    ) -> None:
        super().__init__(message)
        self.headers = headers
        self.status = status
        self.message = message
        self.type = error_type(status, type)
        self.extra = extra


def error_body(
    status: int, message: str, type: str | None = None, **extra: object
) -> dict[str, object]:
    """The one OpenAI-shaped error body: ``{"error": {code, message, type, **extra}}``."""
    return {
        "error": {"code": status, "message": message, "type": error_type(status, type), **extra}
    }


# Anthropic's error type for a status (its Messages API, server.protocols.anthropic)
ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    415: "invalid_request_error",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}
# Paths answered in Anthropic's shape, errors included (so a 404 under them is one too).
ANTHROPIC_PREFIXES = ("/v1/messages", "/messages")


def anthropic_path(path: str) -> bool:
    """Whether ``path`` belongs to the Anthropic Messages API."""
    return any(path == p or path.startswith(p + "/") for p in ANTHROPIC_PREFIXES)


def anthropic_error_body(status: int, message: str) -> dict[str, object]:
    """Anthropic's error body: ``{"type": "error", "error": {"type", "message"}}``; the
    type follows the status (``api_error`` for any other failure)."""
    kind = ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_body_for(
    path: str, status: int, message: str, type: str | None = None, **extra: object
) -> dict[str, object]:
    """The error body a request to ``path`` gets: Anthropic's shape under its paths,
    OpenAI's (``error_body``) everywhere else."""
    if anthropic_path(path):
        return anthropic_error_body(status, message)
    return error_body(status, message, type, **extra)


def error_response(
    status: int,
    message: str,
    type: str | None = None,
    headers: dict[str, str] | None = None,
    path: str = "",
    **extra: object,
) -> JSONResponse:
    """The error body for ``path`` (``error_body_for``) as a JSON response with ``status``."""
    return JSONResponse(
        error_body_for(path, status, message, type, **extra), status_code=status, headers=headers
    )


def _describe(errors: Sequence[ErrorDetails]) -> str:
    """Pydantic's validation errors as one line: ``field: problem; ...`` (the first five)."""
    parts = []
    for e in errors[:5]:
        loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
        if e.get("type") == "json_invalid":
            return "malformed JSON in request body"
        parts.append(f"{loc or 'body'}: {e.get('msg', 'invalid')}")
    return "; ".join(parts)


def install(app: FastAPI) -> None:
    """Answer every failure with ``error_body``: APIError, invalid bodies (400, not FastAPI's
    422), Starlette's HTTP errors (404, 405) and, as 500, anything unhandled."""

    @app.exception_handler(APIError)
    async def _api(req: Request, exc: APIError) -> JSONResponse:
        return error_response(
            exc.status, exc.message, exc.type, exc.headers, req.url.path, **exc.extra
        )

    @app.exception_handler(RequestValidationError)
    async def _invalid(req: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(400, _describe(list(exc.errors())), path=req.url.path)

    @app.exception_handler(UnicodeError)
    async def _unicode(req: Request, exc: UnicodeError) -> JSONResponse:
        # JSON may carry "\ud800": a lone surrogate, which no tokenizer can encode
        msg = f"the request holds text that is not valid Unicode: {exc}"
        return error_response(400, msg, path=req.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(req: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail), path=req.url.path)

    @app.exception_handler(Exception)
    async def _crash(req: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return error_response(500, f"internal error: {type(exc).__name__}", path=req.url.path)
