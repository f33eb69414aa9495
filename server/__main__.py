"""CLI: llama-server-compatible flags -> Settings -> app -> uvicorn."""

from __future__ import annotations

import logging
import signal
import sys

import uvicorn

from .app import create_app
from .config import parse_settings


def main(argv: list[str] | None = None) -> None:
    settings = parse_settings(argv)
    logging.basicConfig(
        level=logging.DEBUG if settings.verbose else logging.INFO,
        format="%(asctime)s %(levelname).1s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    app = create_app(settings)
    # uvicorn drains connections on SIGTERM (graceful shutdown), then re-raises the signal it
    # caught; with this no-op as the handler it restores, the process then exits with 0.
    signal.signal(signal.SIGTERM, lambda *_: None)
    uvicorn.run(
        app,
        host=settings.host,
        port=settings.port,
        log_level="info" if settings.verbose else "warning",
        timeout_graceful_shutdown=10,
    )


if __name__ == "__main__":
    main()
