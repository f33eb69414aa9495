from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from fastapi import FastAPI
from starlette.testclient import TestClient

from server.engine.engine import Engine, EngineOptions
from server.prefix.prefix_index import SlotBaseline
from server.schemas import errors
from server.service.state import ServerState
from server.settings.config import Settings
from server.task import GenParams, SamplingParams, Task, TaskError, TaskResult, TextChunk
from server.types import lcp
from tests.fake_backend import FakeBackend


class Collector:
    def __init__(self) -> None:
        self.events: list = []

    def __call__(self, ev) -> None:
        self.events.append(ev)

    @property
    def result(self) -> TaskResult | None:
        return next((e for e in self.events if isinstance(e, TaskResult)), None)

    @property
    def error(self) -> TaskError | None:
        return next((e for e in self.events if isinstance(e, TaskError)), None)

    @property
    def done(self) -> bool:
        return self.result is not None or self.error is not None

    @property
    def text(self) -> str:
        return "".join(e.text for e in self.events if isinstance(e, TextChunk))


def make_engine(**kw) -> tuple[Engine, FakeBackend]:
    opts = {k: kw.pop(k) for k in list(kw) if k in EngineOptions.__dataclass_fields__}
    b = FakeBackend(**kw)
    e = Engine(b, EngineOptions(**opts))
    return e, b


def task(
    prompt,
    max_tokens=4,
    *,
    stop=None,
    id_slot=-1,
    cache_prompt=True,
    user_start=-1,
    temp=0.0,
    tenant="",
):
    c = Collector()
    t = Task(
        prompt=list(prompt),
        sampling=SamplingParams(temperature=temp),
        gen=GenParams(max_tokens=max_tokens, stop=stop or []),
        emit=c,
        id_slot=id_slot,
        cache_prompt=cache_prompt,
        user_start=user_start,
        tenant=tenant,
    )
    return t, c


def run(engine: Engine, *tasks, max_steps: int = 1000) -> int:
    for t in tasks:
        engine.waiting.append(t)
    steps = 0
    while engine._has_work() and steps < max_steps:
        engine.step()
        steps += 1
        assert engine.check_integrity() == []
    return steps


@contextmanager
def route_client(
    backend: FakeBackend, settings: Settings, routers: list[Any], **state: Any
) -> Iterator[TestClient]:
    """A TestClient over ``routers`` with the engine running on ``backend``, stopped on exit;
    ``state``: more ServerState fields (a chat template, ...). The app: ``c.app``."""
    engine = Engine(backend, EngineOptions())
    engine.start()
    app = FastAPI()
    errors.install(app)
    for r in routers:
        app.include_router(r)
    app.state.server = ServerState(
        settings=settings, backend=backend, engine=engine, loading=False, model_name="fake", **state
    )
    try:
        with TestClient(app) as c:
            yield c
    finally:
        engine.stop()


def ram_find(cache: Any, slot_tokens: list[int], prompt: list[int], tenant: str = "") -> Any:
    """``PromptCache.find`` as the runner asks it: the prompt walked down the cache's index,
    and the state of a slot of ``tenant`` holding ``slot_tokens`` (what it holds of the
    prompt: the locator's answer, computed here)."""
    held = SlotBaseline(lcp(slot_tokens, prompt), len(slot_tokens))
    return cache.find(cache.index.match(tenant, prompt), held)
