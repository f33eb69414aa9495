"""CLI: llama-server-compatible flags -> Settings -> app -> uvicorn."""

from __future__ import annotations

import logging
import signal
import sys
import time
from types import FrameType

import uvicorn

from ..http import kv_setup
from ..http.app import create_app
from ..http.heap import settle_heap
from ..http.listen import bind
from ..router.forked import zygote_enabled
from ..router.router_app import UvicornOptions, router_mode
from ..router.router_app import serve as serve_router
from ..router.template_process import fork_template
from ..service.state import ServerState
from ..settings.config import Settings, csv_list, parse_settings, warn_ignored

# llama-server's -lv thresholds: 0 generic output, 1 error, 2 warning, 3 info, 4+ debug.
_LEVELS = {0: logging.ERROR, 1: logging.ERROR, 2: logging.WARNING, 3: logging.INFO}


def setup_logging(s: Settings) -> None:
    """-v / -lv set the level, --log-file adds a file, --log-disable silences everything."""
    level = logging.DEBUG if s.verbose or s.log_verbosity > 3 else _LEVELS.get(s.log_verbosity)
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if s.log_file:
        handlers.append(logging.FileHandler(s.log_file, encoding="utf-8"))
    logging.basicConfig(
        level=level or logging.ERROR,
        format="%(asctime)s %(levelname).1s %(name)s: %(message)s",
        handlers=handlers,
    )
    if s.log_disable:
        logging.disable(logging.CRITICAL)


# SIGTERM: uvicorn stops accepting and waits up to GRACE_S for connections to close. Running
# requests may finish for DRAIN_S; then the rest end with an error event (or a 503), so
# every stream still ends properly before uvicorn cuts what is left. Both fit within the
# usual grace period of a supervisor before its SIGKILL (llama.cpp's test harness: 5 s),
# so the server still ends its compile children itself (server.constrained.worker).
GRACE_S = 5
DRAIN_S = 4


class DrainingServer(uvicorn.Server):
    """uvicorn's server, telling the routes when a shutdown began (see service.tasks.TaskGroup)."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.state.drain_deadline is None:
            self.state.drain_deadline = time.monotonic() + DRAIN_S
            logging.getLogger("server").info("shutting down: draining for %d s", DRAIN_S)
        super().handle_exit(sig, frame)


def load_llama() -> None:
    """The router's template process: llama.cpp's library loaded (no backend initialised)."""
    from ..llama import backend  # noqa: F401


def main(argv: list[str] | None = None) -> None:
    settings = parse_settings(argv)
    problem = kv_setup.check(settings)
    if problem:  # before the model loads: exits 2, as a malformed flag does
        sys.stderr.write(f"error: --kv-events-endpoint: {problem}\n")
        sys.exit(2)
    setup_logging(settings)
    warn_ignored(settings)
    options: UvicornOptions = {
        "log_level": "critical"
        if settings.log_disable
        else "info"
        if settings.verbose
        else "warning",
        "timeout_graceful_shutdown": GRACE_S,
        "ssl_keyfile": settings.ssl_key_file,
        "ssl_certfile": settings.ssl_cert_file,
    }
    if router_mode(settings):  # no -m, a --models-dir or --models-preset: server.router
        # the template process that forks instances, forked now, before any thread. The
        # library is loaded first, here: the template starts ready, where a first request
        # right after the router's /health answered waited for the template's import (1.23x
        # llama-server's first request, 0.97x five seconds later)
        early = None
        if zygote_enabled():
            load_llama()
            early = fork_template(load_llama, main)
        serve_router(settings, sys.argv[1:] if argv is None else argv, options, early)
        return
    app = create_app(settings)
    config = uvicorn.Config(app, host=settings.host, port=settings.port, **options)
    # uvicorn re-raises the signal it caught once it has shut down; with this no-op as the
    # handler it restores, the process then exits with 0.
    signal.signal(signal.SIGTERM, lambda *_: None)
    hosts = csv_list(settings.host)
    # uvicorn binds one host itself; several, or --reuse-port, need our own sockets
    many = len(hosts) > 1 or settings.reuse_port
    sockets = bind(hosts, settings.port, settings.reuse_port) if many else None
    state = app.state.server
    server = DrainingServer(config, state)
    state.on_load_failed = lambda: setattr(server, "should_exit", True)
    settle_heap()
    server.run(sockets=sockets)
    if state.load_error:
        sys.exit(1)


if __name__ == "__main__":
    main()
