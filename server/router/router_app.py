"""Router mode (``--models-dir`` / ``--models-preset`` without ``-m``): an app that owns no
model, starts one server process per model on demand and passes requests to it.

The router applies the API key, CORS and host rules at the front (its instances listen on
127.0.0.1 with an internal key); each instance judges the cross-site headers the router
passes on again, by the router's ``--cors-origins``; see ``server.router.manager`` for the life of
instances and ``server.router.proxy`` for the passing on."""

from __future__ import annotations

import contextlib
import logging
import secrets
import sys
import time
from collections.abc import AsyncIterator
from types import FrameType
from typing import TypedDict

import uvicorn
from fastapi import FastAPI

from ..http.cors import Cors, CorsPolicy, effective_origins
from ..http.heap import settle_heap
from ..http.listen import bind
from ..http.middleware import ApiKeyAuth, ApiPrefix, BodyLimit, RequestGuard
from ..protocols import webui
from ..schemas import errors
from ..settings.config import Settings, csv_list, load_api_keys
from . import stream_routes
from .manager import Manager, RouterConfig
from .presets import FlagTable, ModelSpec, PresetError, build_specs, flag_table, parse_argv
from .routes import RouterState, router

log = logging.getLogger("server.router")


def router_mode(s: Settings) -> bool:
    """llama-server's rule, narrowed: no ``-m`` and a model source given."""
    return s.model is None and bool(s.models_dir or s.models_preset)


def load_specs(s: Settings, argv: list[str], table: FlagTable) -> dict[str, ModelSpec]:
    """The models of the sources, each with its arguments (PresetError, OSError)."""
    text = None
    if s.models_preset:
        with open(s.models_preset, encoding="utf-8") as f:
            text = f.read()
    return build_specs(
        parse_argv(argv, table),
        table,
        models_dir=s.models_dir,
        preset_text=text,
        preset_path=s.models_preset or "<preset>",
    )


def create_router_app(
    s: Settings, argv: list[str], template: tuple[int, int] | None = None
) -> FastAPI:
    """The router's app; raises PresetError or OSError when the sources cannot be read.
    ``template``: the pid and socket of a template process forked already (its instances
    are forked from it; see server.router.template_process)."""
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per health poll else
    table = flag_table()
    specs = load_specs(s, argv, table)
    keys = load_api_keys(s)
    internal = secrets.token_urlsafe(24)
    origins = effective_origins(s.cors_origins, s.compat)
    cfg = RouterConfig(
        s.models_max, table, [*keys, internal], cors_origins=origins, template=template
    )
    manager = Manager(specs, cfg)
    st = RouterState(
        manager=manager,
        models_max=s.models_max,
        autoload=s.models_autoload,
        internal_key=internal,
        checks_keys=bool(keys),
        reload=lambda: load_specs(s, argv, table),
        started=time.time(),
        timeout=s.timeout,
    )

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await manager.start()
        log.info(
            "router: %d models (%s), at most %s at once",
            len(specs),
            ", ".join(specs),
            s.models_max or "any number",
        )
        yield
        await manager.close()

    app = FastAPI(title="llama-slot-server router", lifespan=lifespan)
    app.state.router = st
    errors.install(app)
    page = webui.load_assets() if s.webui else {}
    if page:  # the chat page, with its model picker fed by /models (before the catch-all)
        app.include_router(webui.make_router(page))
    app.include_router(stream_routes.router)  # before the catch-all of ``router``
    app.include_router(router)
    app.add_middleware(BodyLimit, max_bytes=int(s.max_body_mb * 1024 * 1024))
    app.add_middleware(ApiKeyAuth, keys=keys, public=webui.page_paths(page))
    policy = CorsPolicy(origins, s.cors_methods, s.cors_headers, s.cors_credentials)
    app.add_middleware(
        RequestGuard,
        cors_origins=csv_list(policy.origins),
        allowed_hosts=csv_list(s.allowed_hosts or ""),
    )
    app.add_middleware(Cors, policy=policy)
    if s.api_prefix:  # outermost: the routes and the forward see paths without it
        app.add_middleware(ApiPrefix, prefix=s.api_prefix)
    return app


class UvicornOptions(TypedDict):
    """uvicorn.Config's settings the CLI derives from the flags (server.cli.main), for a
    server and a router alike."""

    log_level: str
    timeout_graceful_shutdown: int
    ssl_keyfile: str | None
    ssl_certfile: str | None


def serve(
    s: Settings,
    argv: list[str],
    uvicorn_options: UvicornOptions,
    template: tuple[int, int] | None = None,
) -> None:
    """Run the router until SIGTERM/SIGINT (then every instance is stopped)."""
    try:
        app = create_router_app(s, argv, template)
    except (PresetError, OSError) as e:
        print(f"error: router mode: {e}", file=sys.stderr)
        sys.exit(2)
    server = uvicorn.Server(uvicorn.Config(app, host=s.host, port=s.port, **uvicorn_options))
    handle_exit = server.handle_exit

    def on_exit(sig: int, frame: FrameType | None) -> None:
        app.state.router.manager.events.closed = True  # /models/sse streams end
        handle_exit(sig, frame)

    server.handle_exit = on_exit  # type: ignore[method-assign]
    settle_heap()
    server.run(sockets=bind(csv_list(s.host), s.port, True) if s.reuse_port else None)
