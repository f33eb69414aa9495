"""``--sleep-idle-seconds N``: after N seconds without a task the model, its context and the
KV cache are freed (``go_to_sleep``); the next task reloads them (``wake_up``) and waits.
``POST /sleep?level=1|2`` (vLLM's) sleeps by hand (server.protocols.sleep): level 1 frees the
context and KV but keeps the model; level 2, which the idle sleep uses, frees everything.

A task is any request but the read-only ones (``READ_ONLY``: health, props, model list,
metrics), which neither wake the server nor reset its timer, as in llama-server. The gate
is a pure ASGI middleware, so streaming answers count as busy until their last byte.
Transitions run on a worker thread (loading takes seconds), one at a time."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import time
from collections.abc import Callable
from typing import Literal

from starlette.types import ASGIApp, Receive, Scope, Send

log = logging.getLogger("server")

READ_ONLY = frozenset(
    {
        ("GET", "/health"),
        ("GET", "/v1/health"),
        ("GET", "/props"),
        ("GET", "/models"),
        ("GET", "/v1/models"),
        ("GET", "/metrics"),
        ("HEAD", "/health"),
        ("GET", "/is_sleeping"),
        # sleeping is no task: it must not wake a sleeping server, nor count as one running
        ("POST", "/sleep"),
    }
)


# What ``SleepController.sleep_now`` did.
SleepOutcome = Literal["asleep", "busy", "unloaded"]


def is_task(scope: Scope) -> bool:
    """Whether a request is a task (wakes the server, resets the idle timer)."""
    method = scope.get("method", "")
    return method != "OPTIONS" and (method, scope.get("path", "")) not in READ_ONLY


def release_memory() -> None:
    """Hand freed heap pages back to the system (glibc keeps them otherwise)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


class SleepController:
    """Counts running tasks and idle time; puts the server to sleep and wakes it.

    ``can_sleep()`` says whether there is a loaded model to free; ``go_to_sleep(level)``,
    ``wake_up`` and ``deepen`` (level 1 -> 2 while asleep) run on a worker thread, never
    two at once. ``idle_s <= 0``: no idle watcher, only sleep by hand."""

    def __init__(
        self,
        idle_s: float,
        can_sleep: Callable[[], bool],
        go_to_sleep: Callable[[int], None],
        wake_up: Callable[[], None],
        deepen: Callable[[], None] = lambda: None,
    ) -> None:
        self.idle_s = idle_s
        self.can_sleep = can_sleep
        self.go_to_sleep = go_to_sleep
        self.wake_up = wake_up
        self.deepen = deepen
        self.active = 0
        self.last = time.monotonic()
        self.sleeping = False
        self.level = 0  # while sleeping: 1 or 2
        self._lock: asyncio.Lock | None = None

    @property
    def lock(self) -> asyncio.Lock:
        if self._lock is None:
            self._lock = asyncio.Lock()
        return self._lock

    async def enter(self) -> None:
        """A task begins: wake the server first if it sleeps (or is falling asleep)."""
        self.active += 1
        self.last = time.monotonic()
        await self.wake()

    def enter_running(self) -> None:
        """A task begins that the server, awake, already runs (a resumable stream's
        generation, which outlives its request)."""
        self.active += 1
        self.last = time.monotonic()

    async def wake(self) -> None:
        """Wake the server if it sleeps (or is falling asleep); returns once it is awake."""
        if self.sleeping or self.lock.locked():
            async with self.lock:
                if self.sleeping:
                    t0 = time.monotonic()
                    await asyncio.to_thread(self.wake_up)
                    self.sleeping, self.level = False, 0
                    log.info("woke up in %.2f s", time.monotonic() - t0)

    async def sleep_now(self, level: int) -> SleepOutcome:
        """Sleep by hand at ``level`` (1 or 2). Refused while tasks run (``busy``) or while
        no model is loaded (``unloaded``). Asleep at level 1, level 2 deepens the sleep."""
        async with self.lock:
            if self.sleeping:
                if level > self.level:
                    await asyncio.to_thread(self.deepen)
                    self.level = level
                return "asleep"
            if self.active > 0:
                return "busy"
            if not self.can_sleep():
                return "unloaded"
            t0 = time.monotonic()
            self.sleeping, self.level = True, level
            await asyncio.to_thread(self.go_to_sleep, level)
            log.info(
                "sleeping at level %d by request (freed in %.2f s)", level, time.monotonic() - t0
            )
            return "asleep"

    def leave(self) -> None:
        """A task ended (its answer is sent): the idle timer starts again from now."""
        self.active -= 1
        self.last = time.monotonic()

    def due(self) -> bool:
        """Whether the server should fall asleep now. While there is nothing to free (the
        model still loading) the idle time does not run."""
        if self.sleeping or not self.can_sleep():
            if not self.sleeping:
                self.last = time.monotonic()
            return False
        return self.active == 0 and time.monotonic() - self.last >= self.idle_s

    async def run(self) -> None:
        """The watcher: checks a few times per idle period (at most every 0.25 s)."""
        period = min(0.25, self.idle_s / 4)
        while True:
            await asyncio.sleep(period)
            if not self.due():
                continue
            async with self.lock:
                if not self.due():
                    continue
                t0 = time.monotonic()
                self.sleeping, self.level = True, 2
                await asyncio.to_thread(self.go_to_sleep, 2)
                log.info(
                    "sleeping after %.0f s idle (freed in %.2f s)",
                    self.idle_s,
                    time.monotonic() - t0,
                )


class SleepGate:
    """The middleware: every task passes ``SleepController.enter`` / ``leave``."""

    def __init__(self, app: ASGIApp, controller: SleepController) -> None:
        self.app = app
        self.ctl = controller

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not is_task(scope):
            await self.app(scope, receive, send)
            return
        await self.ctl.enter()
        try:
            await self.app(scope, receive, send)
        finally:
            self.ctl.leave()
