"""The router's instances: starting them (one start for many waiters), stopping the least
recently used idle one to make room under ``--models-max``, a FIFO queue of starts waiting
for room, watching each process until it exits, and status events for ``/models/sse``.

Everything here runs on the router's event loop (no locks: state changes between awaits).
Starts are served by one dispatcher task, in arrival order; a start whose every waiter left
before it began is dropped, so it never costs a running model its place. The dispatcher
wakes (``kick``) on everything that can make room or change the queue: a start queued or
dropped, an instance ready (a loading one may not be stopped; a loaded one may), a process
exited (unload, crash, stop), a request's end (its client finished or left)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import time
from collections import deque
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass, field

import httpx

from ..json_value import JsonObject
from ..schemas.errors import APIError
from . import process
from .forked import Zygote, zygote_enabled
from .instances import LOADED, LOADING, READY, SLEEPING, UNLOADED, Instance, has_room, pick_victim
from .presets import FlagTable, ModelSpec, to_argv

log = logging.getLogger("server.router")

SLEEP_POLL_S = 0.5  # how often a sleeping-capable instance's /props is read


@dataclass
class StartRequest:
    """A queued start: ``waiters`` requests wait on it; ``held`` (an explicit load) keeps
    it queued when they all leave. ``begun`` is set when the dispatcher launches it."""

    inst: Instance
    waiters: int = 0
    held: bool = False
    begun: asyncio.Future[None] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


class Events:
    """``/models/sse`` subscribers: each gets every event published after it subscribed."""

    def __init__(self) -> None:
        self.queues: set[asyncio.Queue[JsonObject]] = set()
        self.closed = False  # set on shutdown: open streams end (uvicorn waits for them)

    def publish(self, model: str, event: str, data: JsonObject | None = None) -> None:
        msg: JsonObject = {"model": model, "event": event}
        if data is not None:
            msg["data"] = data
        for q in self.queues:
            q.put_nowait(msg)

    @contextlib.contextmanager
    def subscribe(self) -> Iterator[asyncio.Queue[JsonObject]]:
        q: asyncio.Queue[JsonObject] = asyncio.Queue()
        self.queues.add(q)
        try:
            yield q
        finally:
            self.queues.discard(q)


@dataclass
class RouterConfig:
    """What the manager needs from the router's settings."""

    models_max: int
    table: FlagTable
    child_keys: list[str]  # the keys an instance accepts (the router's and its own)
    threads_env: dict[str, str] = field(default_factory=dict)
    # the router's effective --cors-origins: each instance judges the Origin, Referer and
    # Sec-Fetch-* the router passes on by the same rule (never as a local request's)
    cors_origins: str = "*"
    # fork instances from a template process (server.router.forked); off: spawn each
    zygote: bool = field(default_factory=zygote_enabled)
    # (pid, socket fd) of the template forked from the router before it began (else the
    # router starts one)
    template: tuple[int, int] | None = None


class Manager:
    """The model list and its instances (see the module doc)."""

    def __init__(self, specs: dict[str, ModelSpec], cfg: RouterConfig) -> None:
        self.cfg = cfg
        self.instances = {name: Instance(spec) for name, spec in specs.items()}
        self.queue: deque[StartRequest] = deque()
        self.events = Events()
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(5.0))
        # answers may take as long as the instance's own --timeout allows
        self.client_for_proxy = httpx.AsyncClient(
            timeout=httpx.Timeout(None, connect=10.0),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=32),
        )
        self._kick = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self._dispatcher: asyncio.Task[None] | None = None
        # every instance's environment (the same for all: the keys are the router's)
        self.env = process.child_env({**os.environ, **cfg.threads_env}, cfg.child_keys)
        # instances are forked from a template process that has imported the server
        preexec = process.die_with_parent if sys.platform.startswith("linux") else None
        self.zygote = Zygote(self.env, preexec, cfg.template) if cfg.zygote else None

    # ---- life of the manager ----------------------------------------------------------

    async def start(self) -> None:
        """Start the dispatcher, then the models marked ``load-on-startup``."""
        self._dispatcher = asyncio.create_task(self._dispatch(), name="router-dispatch")
        if self.zygote is not None:
            self._spawn_task(self.zygote.start(), "router-zygote")
        for inst in self.instances.values():
            if inst.spec.load_on_startup:
                self.load(inst.name)

    async def close(self) -> None:
        """Stop every instance (concurrently) and the dispatcher."""
        if self._dispatcher is not None:
            self._dispatcher.cancel()
        running = [i for i in self.instances.values() if i.proc is not None]
        await asyncio.gather(*(self._stop(i) for i in running), return_exceptions=True)
        if self.zygote is not None:
            await self.zygote.close()
        await self.client.aclose()
        await self.client_for_proxy.aclose()

    async def replace_specs(self, specs: dict[str, ModelSpec]) -> None:
        """``?reload=1``: models gone from the sources are stopped and dropped, new ones
        added; a changed model keeps running with its old arguments until it stops."""
        for name in [n for n in self.instances if n not in specs]:
            await self._stop(self.instances[name])
            del self.instances[name]
            self.events.publish(name, "model_remove")
        for name, spec in specs.items():
            inst = self.instances.get(name)
            if inst is None:
                self.instances[name] = Instance(spec)
            elif inst.proc is None:
                inst.spec = spec
        self.events.publish("*", "models_reload")

    def _spawn_task(self, coro: Coroutine[object, object, None], name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def kick(self) -> None:
        """Wake the dispatcher (something changed: a request left, a process exited)."""
        self._kick.set()

    # ---- lookup -------------------------------------------------------------------------

    def get(self, name: str) -> Instance | None:
        return self.instances.get(name)

    def require(self, name: str | None, autoload: bool) -> Instance:
        """The instance a request names; a 400 for a missing or unknown name, or for a model
        that is not running when autoload is off (llama-server's messages)."""
        if not name:
            raise APIError(400, "model name is missing from the request")
        inst = self.instances.get(name)
        if inst is None:
            raise APIError(400, f"model '{name}' not found")
        if not autoload and inst.status not in READY and inst.status != LOADING:
            raise APIError(400, "model is not loaded")
        return inst

    # ---- requests -----------------------------------------------------------------------

    def hold(self, inst: Instance) -> Callable[[], None]:
        """Pin ``inst`` now; the returned function releases it (once)."""
        inst.pins += 1
        done = False

        def release() -> None:
            nonlocal done
            if not done:
                done = True
                inst.pins -= 1
                inst.last_used = time.monotonic()
                self.kick()

        return release

    async def ready(self, inst: Instance) -> None:
        """Return once ``inst`` is ready, starting it if needed (queued for room, one start
        for every request waiting on it); a 503 if its start failed. The caller holds it."""
        while inst.status not in READY:
            if inst.status == LOADING and inst.ready is not None:
                if not await asyncio.shield(inst.ready):
                    raise APIError(
                        503,
                        f"model '{inst.name}' failed to load (exit code {inst.exit_code})",
                        "unavailable_error",
                    )
                continue
            req = self._enqueue(inst)
            req.waiters += 1
            try:
                await asyncio.shield(req.begun)
            finally:
                req.waiters -= 1
                if not req.begun.done() and req.waiters == 0 and not req.held:
                    self.queue.remove(req)  # nobody wants it any more
                    self.kick()

    def _enqueue(self, inst: Instance) -> StartRequest:
        """The queued start of ``inst``, queued now if there is none (one per model)."""
        for req in self.queue:
            if req.inst is inst:
                return req
        req = StartRequest(inst)
        self.queue.append(req)
        self.kick()
        return req

    def load(self, name: str) -> None:
        """``POST /models/load``: queue a start that stays queued until it begins."""
        inst = self.instances[name]
        if inst.status == UNLOADED:
            self._enqueue(inst).held = True

    async def unload(self, name: str) -> None:
        """``POST /models/unload``: stop the instance (its requests end)."""
        await self._stop(self.instances[name])

    # ---- the dispatcher -----------------------------------------------------------------

    async def _dispatch(self) -> None:
        while True:
            await self._kick.wait()
            self._kick.clear()
            while self.queue:
                req = self.queue[0]
                if req.inst.holds_process and not req.inst.stopping:
                    self.queue.popleft()  # it started meanwhile (or never stopped)
                    req.begun.set_result(None)
                    continue
                if not has_room(self.instances.values(), self.cfg.models_max):
                    victim = pick_victim(self.instances.values())
                    if victim is None:
                        break  # wait for a request to end or a process to exit
                    log.info("stopping model %s to make room for %s", victim.name, req.inst.name)
                    await self._stop(victim, at_once=not self._spills(victim))
                    continue
                self.queue.popleft()
                self._launch(req.inst)
                req.begun.set_result(None)

    def _launch(self, inst: Instance) -> None:
        inst.status = LOADING
        inst.last_used = time.monotonic()
        inst.failed = False
        inst.exit_code = None
        inst.exited = asyncio.Event()
        inst.ready = asyncio.get_running_loop().create_future()
        inst.port = process.free_port()
        inst.argv = self._argv(inst)
        self.events.publish(inst.name, "model_status", {"status": LOADING})
        self._spawn_task(self._lifecycle(inst), f"instance-{inst.name}")

    def _argv(self, inst: Instance) -> list[str]:
        args = to_argv(inst.spec.args, self.cfg.table)
        local = ["--host", "127.0.0.1", "--port", str(inst.port), "--alias", inst.name]
        local += ["--cors-origins", self.cfg.cors_origins]
        return [sys.executable, "-m", "server", *args, *local]

    # ---- one instance's process ---------------------------------------------------------

    async def _lifecycle(self, inst: Instance) -> None:
        """Run ``inst``'s process from start to exit, keeping its status."""
        ready = inst.ready
        assert ready is not None
        ok, code = False, None
        watch: asyncio.Task[None] | None = None
        try:
            if not inst.spec.path:
                raise RuntimeError("no model file (set 'model' in its preset section)")
            proc = inst.proc = await self._start_process(inst)
            pump = asyncio.create_task(process.pump_output(proc, inst.name))
            ok = await process.wait_healthy(proc, inst.port, self.client)
            if ok and inst.status == LOADING:
                inst.status = LOADED
                self.events.publish(inst.name, "model_status", {"status": LOADED})
                ready.set_result(True)
                self.kick()  # a start waiting for room may now stop this one
                watch = asyncio.create_task(self._watch_sleep(inst))
            code = await proc.wait()
            await pump
            if watch is not None:
                watch.cancel()
        except Exception as e:  # a start that could not even begin
            log.error("model %s: could not start: %s", inst.name, e)
            code = -1 if code is None else code
        finally:
            self._exited(inst, ok, code)

    async def _start_process(self, inst: Instance) -> process.InstanceProcess:
        """Fork the instance from the template process; spawn it the plain way where the
        template is gone or cannot serve it."""
        if self.zygote is not None:
            forked = await self.zygote.fork(inst.argv, self.env, inst.name)
            if forked is not None:
                return forked
        return await process.spawn(inst.argv, self.env)

    def _spills(self, inst: Instance) -> bool:
        """Whether ``inst``'s graceful shutdown writes something worth its time: with a disk
        tier its idle slots and RAM cache go there (conversations resume from it)."""
        return bool(inst.spec.args.get("cache_disk") or self.env.get("LLAMA_ARG_CACHE_DISK"))

    def _exited(self, inst: Instance, was_ready: bool, code: int | None) -> None:
        crashed = not inst.stopping
        inst.proc = None
        inst.status = UNLOADED
        inst.stopping = False
        inst.exit_code = code
        inst.failed = crashed and (code != 0 or not was_ready)
        if inst.ready is not None and not inst.ready.done():
            inst.ready.set_result(False)
        inst.exited.set()
        if crashed:
            log.warning("model %s: instance exited with status %s", inst.name, code)
        data: JsonObject = {"status": UNLOADED}
        if inst.failed:
            data.update(failed=True, exit_code=code)
        self.events.publish(inst.name, "model_status", data)
        self.kick()

    async def _stop(self, inst: Instance, at_once: bool = False) -> None:
        """Stop ``inst``'s process and wait until it has exited. ``at_once`` (an idle
        instance stopped to make room, with nothing to spill): SIGKILL, no drain; else
        SIGTERM, its running requests drain, then SIGKILL after its stop timeout."""
        proc = inst.proc
        if proc is None or inst.stopping:
            if inst.stopping:
                await inst.exited.wait()
            return
        inst.stopping = True
        inst.status = UNLOADED
        await process.terminate(proc, inst.exited, inst.spec.stop_timeout, at_once)

    async def _watch_sleep(self, inst: Instance) -> None:
        """With ``--sleep-idle-seconds``, follow the instance's ``/props`` ``is_sleeping``
        (a read that neither wakes it nor resets its timer) into its status."""
        if int(inst.spec.args.get("sleep_idle_seconds", "-1")) <= 0:
            return
        url = f"http://127.0.0.1:{inst.port}/props"
        headers = {"Authorization": f"Bearer {self.cfg.child_keys[-1]}"}
        while inst.status in READY:
            with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
                r = await self.client.get(url, headers=headers)
                status = SLEEPING if r.json().get("is_sleeping") else LOADED
                if inst.status in READY and status != inst.status:
                    inst.status = status
                    self.events.publish(inst.name, "model_status", {"status": status})
            await asyncio.sleep(SLEEP_POLL_S)
