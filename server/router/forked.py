"""The router's side of the template process (``server.cli.zygote``): start it once,
ask it for an instance, and a handle on the forked instance that the manager uses as it
uses an ``asyncio.subprocess.Process`` (``pid``, ``returncode``, ``stdout``, ``wait``,
``terminate``, ``kill``).

The router becomes a child subreaper, so that every forked instance is its child: it waits
for it through a pidfd (no other waiter can take its exit status) and the instance outlives
the template process. When the template process is gone (it crashed, was killed, never got
ready, or did not answer a fork within ``FORK_TIMEOUT_S``: stopped, stuck) ``fork``
answers None and the caller starts the instance the plain way; a request whose argv or
environment is not the template's also gets None (the template imported the server under
its environment: variables read at import, OpenMP's, must match)."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import logging
import os
import signal
import socket
import sys
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("server.router")

PR_SET_CHILD_SUBREAPER = 36
READY_TIMEOUT_S = 120.0  # importing on a loaded machine
# A fork's answer: two fork() calls of an idle process (milliseconds, even loaded). A
# template that has not answered by then is stopped or stuck: the instance starts the
# plain way, and the template is killed (a late answer would fork a second instance).
FORK_TIMEOUT_S = 5.0
STREAM_LIMIT = 2**16  # asyncio.subprocess's line limit
REAP_PERIOD_S = 2.0
MAX_MESSAGE = 1 << 20  # a request to the template process: argv and environment


def zygote_enabled() -> bool:
    """Whether instances are forked from a template process (``LLAMA_ROUTER_ZYGOTE=0``:
    each is spawned as a new interpreter)."""
    return os.environ.get("LLAMA_ROUTER_ZYGOTE") != "0"


def become_subreaper() -> bool:
    """Adopt orphaned descendants (Linux); False where that is not possible."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return bool(libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0)


class ForkedProcess:
    """A forked instance (a child of the router once the template's middle process is
    gone): its exit is seen through a pidfd on the event loop and reaped here."""

    def __init__(self, pid: int, stdout: asyncio.StreamReader | None) -> None:
        self.pid = pid
        self.stdout: asyncio.StreamReader | None = stdout
        self.returncode: int | None = None
        self._exited = asyncio.get_running_loop().create_future()
        self._pidfd = os.pidfd_open(pid)
        asyncio.get_running_loop().add_reader(self._pidfd, self._on_exit)

    def _on_exit(self) -> None:
        try:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:  # not our child after all: no status to read
            pid, status = self.pid, -1
        if pid == 0:
            return  # not yet (spurious wakeup)
        self.returncode = os.waitstatus_to_exitcode(status) if status != -1 else -1
        asyncio.get_running_loop().remove_reader(self._pidfd)
        os.close(self._pidfd)
        self._pidfd = -1
        if not self._exited.done():
            self._exited.set_result(self.returncode)

    async def wait(self) -> int:
        return int(await asyncio.shield(self._exited))

    def send_signal(self, sig: int) -> None:
        """Signal it through its pidfd (never a recycled pid); ProcessLookupError once it
        has exited, as asyncio's handle raises."""
        if self.returncode is not None or self._pidfd < 0:
            raise ProcessLookupError(self.pid)
        signal.pidfd_send_signal(self._pidfd, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


async def read_pipe(fd: int) -> asyncio.StreamReader:
    """An asyncio reader on the read end ``fd`` of a pipe."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=STREAM_LIMIT, loop=loop)
    protocol = asyncio.StreamReaderProtocol(reader, loop=loop)
    await loop.connect_read_pipe(lambda: protocol, os.fdopen(fd, "rb", 0))
    return reader


class Zygote:
    """The template process and its control socket (see the module doc)."""

    def __init__(
        self,
        env: dict[str, str],
        preexec: Callable[[], None] | None,
        early: tuple[int, int] | None = None,
    ) -> None:
        self.env = env
        self.preexec = preexec
        self.early = early  # (pid, socket fd) of a template forked from the router itself
        self.proc: asyncio.subprocess.Process | ForkedProcess | None = None
        self.sock: socket.socket | None = None
        self.ready: asyncio.Future[bool] | None = None
        self.alive = False
        self.forked: set[int] = set()  # pids of instances it forked that still run
        self.last_threads = 0  # the template's threads just before its last fork
        self._lock = asyncio.Lock()
        self._reaper: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Start the template process; ``ready`` resolves once it has imported (False if it
        could not start)."""
        self.ready = asyncio.get_running_loop().create_future()
        ok = False
        try:
            ok = await self._start()
        except Exception as e:
            log.warning("router: no template process (%s): instances start the plain way", e)
        finally:
            self.alive = ok
            self.ready.set_result(ok)

    async def _start(self) -> bool:
        if not hasattr(os, "pidfd_open") or not become_subreaper():
            raise OSError("needs Linux (pidfd, PR_SET_CHILD_SUBREAPER)")
        self._reaper = asyncio.create_task(self._reap_orphans(), name="router-reaper")
        if self.early is not None:
            pid, fd = self.early
            self.early = None
            self.proc, mine = ForkedProcess(pid, None), socket.socket(fileno=fd)
        else:
            mine = await self._spawn()
        mine.setblocking(False)
        self.sock = mine
        loop = asyncio.get_running_loop()
        msg = json.loads(await asyncio.wait_for(loop.sock_recv(mine, 4096), READY_TIMEOUT_S))
        self.last_threads = int(msg["threads"])
        log.info("router: template process %d ready (%d thread)", msg["ready"], msg["threads"])
        return True

    async def _spawn(self) -> socket.socket:
        """``python -m server.cli.zygote``; returns the router's end of its socket."""
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.proc = await asyncio.create_subprocess_exec(
                *[sys.executable, "-m", "server.cli.zygote", str(theirs.fileno())],
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL,
                env=self.env,
                pass_fds=(theirs.fileno(),),
                preexec_fn=self.preexec,
            )
        finally:
            theirs.close()
        return mine

    async def fork(self, argv: list[str], env: dict[str, str], name: str) -> ForkedProcess | None:
        """A forked instance running ``argv`` under ``env``, or None where the template
        cannot serve it (the caller then spawns it the plain way)."""
        if self.ready is None or argv[:3] != [sys.executable, "-m", "server"] or env != self.env:
            return None
        if not await asyncio.shield(self.ready) or not self.alive:
            return None
        async with self._lock:
            if not self.alive:  # lost while this request waited for the one before
                return None
            return await self._fork(argv, env, name)

    async def _fork(self, argv: list[str], env: dict[str, str], name: str) -> ForkedProcess | None:
        assert self.sock is not None
        loop = asyncio.get_running_loop()
        r, w = os.pipe()
        try:
            body = json.dumps({"argv": argv, "env": env, "router": os.getpid(), "name": name})
            socket.send_fds(self.sock, [body.encode()], [w])
            reply = await asyncio.wait_for(loop.sock_recv(self.sock, MAX_MESSAGE), FORK_TIMEOUT_S)
        except asyncio.TimeoutError:
            reply = b""
            self._give_up(f"no answer to a fork in {FORK_TIMEOUT_S:g} s (stopped or stuck)")
        except asyncio.CancelledError:  # its answer would be read by the next request
            self._lost("a request was cancelled")
            raise
        except OSError as e:
            reply = b""
            log.warning("router: template process unreachable: %s", e)
        finally:
            os.close(w)  # the instance holds its own copy now
        msg = json.loads(reply) if reply else {"error": "the template process is gone"}
        if "pid" not in msg:
            os.close(r)
            self._lost(str(msg.get("error")))
            return None
        self.last_threads = int(msg["threads"])
        proc = ForkedProcess(int(msg["pid"]), await read_pipe(r))
        self.forked.add(proc.pid)
        proc_done = asyncio.ensure_future(proc.wait())
        proc_done.add_done_callback(lambda _: self.forked.discard(proc.pid))
        return proc

    def _give_up(self, why: str) -> None:
        """Lose the template and kill it: one that answers late would fork an instance
        nobody waits for (the plain start took its place and port)."""
        self._lost(why)
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()  # SIGKILL ends a stopped process too

    def _lost(self, why: str) -> None:
        if self.alive:
            log.warning("router: template process lost (%s): instances start the plain way", why)
        self.alive = False

    async def close(self) -> None:
        """Close the control socket (the template process exits) and wait for it."""
        if self._reaper is not None:
            self._reaper.cancel()
        if self.sock is not None:
            self.sock.close()
        if self.proc is not None and self.proc.returncode is None:
            try:
                await asyncio.wait_for(self.proc.wait(), 5.0)
            except asyncio.TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    self.proc.kill()
                await self.proc.wait()

    async def _reap_orphans(self) -> None:
        """As a subreaper the router adopts what its instances leave behind (their own
        children, once an instance died): reap those that stay zombies for a whole period
        and are no instance's (asyncio's own children are reaped at once by its watcher)."""
        seen: set[int] = set()
        while True:
            await asyncio.sleep(REAP_PERIOD_S)
            zombies = {p for p in child_pids() if is_zombie(p)} - self.forked
            if self.proc is not None:
                zombies.discard(self.proc.pid)
            for pid in zombies & seen:
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, os.WNOHANG)
            seen = zombies
            if self.alive and self.proc is not None and self.proc.returncode is not None:
                self._lost(f"exit status {self.proc.returncode}")


def child_pids() -> set[int]:
    """This process's children (every thread's, from /proc)."""
    out: set[int] = set()
    with contextlib.suppress(OSError):
        for task in Path("/proc/self/task").iterdir():
            with contextlib.suppress(OSError):
                out.update(int(p) for p in (task / "children").read_text().split())
    return out


def is_zombie(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2 :].startswith("Z")
