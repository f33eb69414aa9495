"""``python -m server.cli.zygote FD``: the router's template process, started as its own
interpreter where the router could not fork it from itself (a thread already ran); see
``server.router.template_process``."""

from __future__ import annotations

import socket
import sys

from ..router.template_process import run_instance, template


def preload() -> None:
    """Import what an instance imports before it loads a model (nothing starts a thread,
    loads a model or opens a socket here)."""
    from ..llama import backend  # noqa: F401  (llama.cpp's library; no backend initialised)
    from . import main as _  # noqa: F401  (FastAPI, pydantic, uvicorn, NumPy, the server)


def main() -> None:
    from .main import main as server_main

    job = template(socket.socket(fileno=int(sys.argv[1])), preload)
    if job is not None:
        run_instance(job, server_main)


if __name__ == "__main__":
    main()
