"""Compiling clients' schemas and grammars in child processes, so that no body can crash,
freeze or exhaust the server.

llguidance compiles in native code: a pathological schema can overflow its stack (the
process dies: there is no exception to catch), run for minutes, or take gigabytes. Each
check therefore runs in a child process (``python -m server.constrained.child``) with a fixed
thread stack and an address-space limit, under a wall-clock deadline. A child that crashes or
overruns is killed and replaced; its request gets a ``ConstraintError`` that says why. The
server's own compile that binds a checked grammar to the vocabulary (``matcher``) runs on a
thread with a stack several times the child's, so what passed here cannot overflow there.

The pool is process-wide (``pool()``), set up by ``configure`` from the server's flags; a
call blocks its (worker) thread until a child is free and has answered, never the event loop
or the engine thread."""

from __future__ import annotations

import json
import logging
import os
import queue
import select
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypedDict

from .limits import ConstraintLimits

log = logging.getLogger("server")

CHILD_STACK = 8 << 20  # bytes of stack for the child's compiling thread
CHILD_MEMORY = 4 << 30  # address space of a child, bytes
WALL_FACTOR = 6  # a compile may take this many times its CPU-time limit in wall-clock time
START_TIMEOUT = 60.0  # seconds a new child may take to import and say it is ready
_CLK_TCK = os.sysconf("SC_CLK_TCK")


# one request to a compile child: {"op": "schema", "canon", "prefix", "suffix"},
# {"op": "grammar", "kind", "text"}, or {"op": "ping"}; every value a string
CompileRequest = dict[str, str]


class CompileAnswer(TypedDict, total=False):
    """A compile child's answer: ``grammar``, or ``where`` and ``reason`` (a failure), or
    ``pong`` (to a ping)."""

    grammar: str
    where: str
    reason: str
    pong: bool


@dataclass(frozen=True)
class Lost:
    """A child that did not answer: ``overran`` its time, or died (a crash, a signal)."""

    overran: bool


class _Child:
    """One child process and its pipes; one request at a time."""

    def __init__(self) -> None:
        env = {**os.environ, "SERVER_CONSTRAINT_STACK": str(CHILD_STACK)}
        env["SERVER_CONSTRAINT_MEMORY"] = str(CHILD_MEMORY)
        env["SERVER_CONSTRAINT_PARENT"] = str(os.getpid())  # the child dies with this process
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "server.constrained.child"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )
        self._buf = b""
        # its imports are not a request's CPU time: wait for its first line ("ready")
        if not isinstance(self._line(time.monotonic() + START_TIMEOUT, lambda: False), bytes):
            raise OSError("the constraint compile child did not start")

    def cpu_seconds(self) -> float:
        """CPU time the child has used (user + system), from /proc; 0 where unreadable."""
        try:
            with open(f"/proc/{self.proc.pid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / _CLK_TCK
        except (OSError, IndexError, ValueError):
            return 0.0

    def ask(self, request: CompileRequest, timeout: float) -> CompileAnswer | Lost:
        """The child's answer, or Lost when it died or overran (then it is killed): more than
        ``timeout`` seconds of CPU time, or ``WALL_FACTOR`` times that of wall-clock time.
        CPU time, so that a compile slowed down by generation (the child runs at the lowest
        priority) is not cut short for it."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write(json.dumps(request).encode() + b"\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            self.kill()
            return Lost(overran=False)
        cpu0 = self.cpu_seconds()
        line = self._line(
            time.monotonic() + WALL_FACTOR * timeout, lambda: self.cpu_seconds() - cpu0 > timeout
        )
        if not isinstance(line, bytes):
            return line
        try:
            return json.loads(line)
        except ValueError:  # not our protocol: the child cannot be trusted any more
            self.kill()
            return Lost(overran=False)

    def _line(self, wall_end: float, overran: Callable[[], bool]) -> bytes | Lost:
        """The child's next line; Lost (the child killed) when it dies, passes ``wall_end`` or
        ``overran()`` says so (checked every 0.1 s)."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            if not select.select([fd], [], [], 0.1)[0]:
                if overran() or time.monotonic() > wall_end:
                    self.kill()
                    return Lost(overran=True)
                continue
            chunk = os.read(fd, 1 << 20)
            if not chunk:  # died: a stack overflow, the memory limit, a signal
                self.kill()
                return Lost(overran=False)
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return line

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


class CompilePool:
    """``workers`` children; ``run`` hands a request to a free one and waits for its answer
    (``{"grammar": text}`` or ``{"where": ..., "reason": ...}``) at most ``timeout`` seconds
    once it is running. Thread-safe. ``n_runs`` counts requests, ``n_crashed`` and
    ``n_timed_out`` the children lost, for tests and logs. After ``shutdown`` no child runs
    and none starts."""

    def __init__(self, workers: int = 2, timeout: float = 10.0) -> None:
        self.timeout = timeout
        self.n_runs = 0
        self.n_crashed = 0
        self.n_timed_out = 0
        self._idle: queue.Queue[_Child | None] = queue.Queue()
        for _ in range(max(1, workers)):
            self._idle.put(None)  # started on first use
        self._started: list[_Child] = []  # every child started, busy or idle (shutdown)
        self._lock = threading.Lock()
        self._shut = False

    def _start(self) -> _Child:
        """A new child, remembered for ``shutdown``; OSError after it (or if none starts)."""
        if self._shut:
            raise OSError("the server is shutting down")
        child = _Child()
        with self._lock:
            self._started = [c for c in self._started if c.alive()]
            self._started.append(child)
            shut = self._shut
        if shut:  # shut down while it started: it must not outlive the server either
            child.kill()
            raise OSError("the server is shutting down")
        return child

    def run(self, request: CompileRequest) -> CompileAnswer:
        child = self._idle.get()
        self.n_runs += 1
        try:
            if child is None or not child.alive():
                child = None
                child = self._start()
            answer = child.ask(request, self.timeout)
            return self._lost(child, answer) if isinstance(answer, Lost) else answer
        except OSError as e:  # no child could be started: the request fails, not the server
            log.error("constraint compile child: %s", e)
            return {"where": "", "reason": "the constraint compiler is unavailable"}
        finally:
            self._idle.put(child if child is not None and child.alive() else None)

    def _lost(self, child: _Child, lost: Lost) -> CompileAnswer:
        """The answer for a request whose child died or overran (it is dead by now)."""
        if lost.overran:
            self.n_timed_out += 1
            why = f"compiling it took longer than {self.timeout:g} s (--constraint-timeout)"
        else:
            self.n_crashed += 1
            why = (
                "the compiler failed on it (too deeply nested or too large: see "
                "--constraint-max-depth and --constraint-max-bytes)"
            )
        log.warning("constraint compile child lost (exit %s): %s", child.proc.returncode, why)
        return {"where": "", "reason": why}

    def close(self) -> None:
        """Kill the idle children (busy ones are killed by their own deadline)."""
        while True:
            try:
                child = self._idle.get_nowait()
            except queue.Empty:
                return
            if child is not None:
                child.kill()

    def shutdown(self) -> None:
        """Kill every child, busy ones too (their requests fail), and reap each (no zombie
        outlives the server); no child starts after this."""
        with self._lock:
            self._shut = True
            children, self._started = self._started, []
        for child in children:
            child.kill()

    def warm(self) -> None:
        """Start one child now (it takes a few hundred milliseconds), so the first request
        with a schema does not wait for it."""
        self.run({"op": "ping"})


_lock = threading.Lock()
_limits = ConstraintLimits()
_pool: CompilePool | None = None


def configure(limits: ConstraintLimits) -> None:
    """Use ``limits`` from now on (the server calls this once, from its flags)."""
    global _limits, _pool
    with _lock:
        old, _limits, _pool = _pool, limits, None
    if old is not None:
        old.close()


def shutdown() -> None:
    """The server is exiting: every compile child killed and reaped (``CompilePool.shutdown``)."""
    with _lock:
        current = _pool
    if current is not None:
        current.shutdown()


def limits() -> ConstraintLimits:
    return _limits


def pool() -> CompilePool:
    """The process's compile pool, made on first use with the configured limits."""
    global _pool
    with _lock:
        if _pool is None:
            _pool = CompilePool(_limits.workers, _limits.timeout)
        return _pool
