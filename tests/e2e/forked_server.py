"""Test servers forked from a template process, as the router forks its instances.

Each pytest worker starts ``python -m server.cli.zygote`` once (the router's template
process, ``server.router.template_process``): it imports the server (~1.4 s of a ~2.8 s start on
a quiet machine, more under load) and loads no model; every test server after that is
forked from it and goes straight to parsing its flags and loading its model. The forked
server is the same ``server.cli.main.main`` as ``python -m server`` runs, in its own
process (its own llama.cpp, HTTP socket, signals and exit status); the worker becomes a
child subreaper so that it is the server's parent, waits for it and reads its exit status
(``Adopted``, a ``subprocess.Popen`` look-alike for what the tests use of one).

A server started with extra environment variables (read at import by some libraries) is
started the plain way, as is every server when the template cannot start
(``E2E_ZYGOTE=0`` asks for that too)."""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from server.router.forked import MAX_MESSAGE, become_subreaper

READY_TIMEOUT_S = 120.0


class Adopted:
    """A forked server: a child of this process (the subreaper), with ``Popen``'s
    ``pid``, ``returncode``, ``poll``, ``wait``, ``send_signal``, ``terminate`` and
    ``kill``. Signals go through a pidfd, so a recycled pid is never signalled."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._pidfd = os.pidfd_open(pid)

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere: its status is lost
                pid, status = self.pid, -1
            if pid:
                self._exited(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.poll() is not None:
            return self.returncode  # type: ignore[return-value]
        ready, _, _ = select.select([self._pidfd], [], [], timeout)
        if not ready:
            raise subprocess.TimeoutExpired(["server"], timeout or 0)
        while self.poll() is None:  # the pidfd is readable at exit: the status follows
            time.sleep(0.001)
        return self.returncode  # type: ignore[return-value]

    def _exited(self, status: int) -> None:
        self.returncode = os.waitstatus_to_exitcode(status) if status != -1 else -1
        os.close(self._pidfd)

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            signal.pidfd_send_signal(self._pidfd, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Template:
    """This worker's template process (started on first use) and its control socket."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.sock: socket.socket | None = None
        self.proc: subprocess.Popen | None = None
        self.failed = os.environ.get("E2E_ZYGOTE") == "0"
        self.lock = threading.Lock()

    def fork(self, flags: list[str], log_fd: int) -> Adopted | None:
        """A server running ``python -m server *flags`` with its output on ``log_fd``;
        None when there is no template (the caller starts it the plain way)."""
        with self.lock:
            if self.failed or (self.sock is None and not self._start()):
                return None
            assert self.sock is not None
            argv = [sys.executable, "-m", "server", *flags]
            body = {"argv": argv, "env": dict(os.environ), "router": os.getpid(), "name": "e2e"}
            try:
                socket.send_fds(self.sock, [json.dumps(body).encode()], [log_fd])
                msg = json.loads(self.sock.recv(MAX_MESSAGE) or b"{}")
            except OSError:
                msg = {}
            if "pid" not in msg:
                self.failed = True
                return None
            return Adopted(int(msg["pid"]))

    def _start(self) -> bool:
        if not hasattr(os, "pidfd_open") or not become_subreaper():
            self.failed = True
            return False
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "server.cli.zygote", str(theirs.fileno())],
                cwd=self.root,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                pass_fds=(theirs.fileno(),),
            )
        finally:
            theirs.close()
        mine.settimeout(READY_TIMEOUT_S)
        try:
            ready = json.loads(mine.recv(4096) or b"{}")
        except (OSError, ValueError):
            ready = {}
        mine.settimeout(None)
        if "ready" not in ready:
            self.failed = True
            mine.close()
            return False
        self.sock = mine
        return True

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()  # the template exits once its socket is closed
        if self.proc is not None:
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
