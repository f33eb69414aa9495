"""A model instance's state (pure data) and the choice of which one to stop for room.

States, as llama-server names them in ``GET /models``: ``unloaded`` -> ``loading`` ->
``loaded`` <-> ``sleeping`` (the instance's own ``--sleep-idle-seconds``) -> ``unloaded``.
An instance that exits on its own (a crash, a failed start) is ``unloaded`` with
``failed`` and its ``exit_code``; the next request starts it again."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass, field

from .presets import ModelSpec
from .process import InstanceProcess

UNLOADED = "unloaded"
LOADING = "loading"
LOADED = "loaded"
SLEEPING = "sleeping"
# a process exists for these (they count toward --models-max)
RUNNING = frozenset({LOADING, LOADED, SLEEPING})
READY = frozenset({LOADED, SLEEPING})  # requests go through (a sleeping one wakes itself)


@dataclass
class Instance:
    """One model and, while it runs, its server process.

    ``pins`` counts the requests that hold it (waiting for it or being served): a pinned
    instance is never stopped to make room. ``last_used`` (monotonic) orders the idle ones.
    ``stopping`` is set from the stop request until the process has exited (it still holds
    its memory, so it still counts toward the limit)."""

    spec: ModelSpec
    status: str = UNLOADED
    port: int = 0
    pins: int = 0
    last_used: float = 0.0
    stopping: bool = False
    failed: bool = False
    exit_code: int | None = None
    argv: list[str] = field(default_factory=list)
    proc: InstanceProcess | None = None  # while running (spawned or forked)
    ready: asyncio.Future[bool] | None = None  # the current start's outcome
    exited: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def holds_process(self) -> bool:
        """Whether a process runs (or is being stopped) for this model."""
        return self.status in RUNNING or self.stopping

    def status_json(self) -> dict[str, object]:
        """``GET /models``'s ``status`` object."""
        out: dict[str, object] = {"value": self.status}
        if self.argv:
            out["args"] = self.argv
        if self.failed:
            out["failed"] = True
            out["exit_code"] = self.exit_code
        return out


def pick_victim(instances: Iterable[Instance]) -> Instance | None:
    """The least recently used instance that may be stopped to make room: running and
    ready (never one still loading), held by no request, not already stopping."""
    idle = [i for i in instances if i.status in READY and i.pins == 0 and not i.stopping]
    return min(idle, key=lambda i: i.last_used, default=None)


def has_room(instances: Iterable[Instance], models_max: int) -> bool:
    """Whether one more instance may start (``models_max`` 0: no limit)."""
    return models_max <= 0 or sum(i.holds_process for i in instances) < models_max
