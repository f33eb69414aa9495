"""The router's template process (``python -m server.cli.zygote FD``): it imports the
server's modules once, loads no model and starts no thread, then forks one instance per
request that arrives on the control socket ``FD`` (a ``SOCK_SEQPACKET`` the router holds the
other end of). A forked instance skips the interpreter's start and the imports (about 1 s,
more on a loaded machine) and goes straight to parsing its flags and loading its model.

A request is one JSON message ``{"argv": [...], "env": {...}, "router": PID, "name": str}``
with the write end of the instance's output pipe attached (``SCM_RIGHTS``); the answer is
``{"pid": N, "threads": T}`` (``T``: this process's threads just before the fork, always 1)
or ``{"error": "..."}``. ``argv`` must be ``[python, "-m", "server", *flags]``.

Isolation: each instance is forked twice (the middle process exits at once), so that it
becomes a child of the router, which is a child subreaper (``PR_SET_CHILD_SUBREAPER``): the
router waits for it, reads its exit status, and the instance outlives this process. Only
once reparented does the instance set ``PR_SET_PDEATHSIG`` (it dies with the router). This
process exits when the router closes its end of the socket, and dies with the router too."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass

from ..router.forked import MAX_MESSAGE

PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15
REPARENT_TIMEOUT_S = 5.0


@dataclass
class Job:
    """What a forked instance runs: the server's flags, its environment and its pipe."""

    argv: list[str]
    env: dict[str, str]
    router: int
    name: str
    out_fd: int


def prctl(option: int, arg: int | bytes) -> None:
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(option, arg, 0, 0, 0)


def native_threads() -> int:
    """This process's threads as the kernel counts them (native ones included)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


def preload() -> None:
    """Import what an instance imports before it loads a model (nothing starts a thread,
    loads a model or opens a socket here)."""
    from ..llama import backend  # noqa: F401  (llama.cpp's library; no backend initialised)
    from . import main  # noqa: F401  (FastAPI, pydantic, uvicorn, NumPy, the server)


def settle_threads() -> None:
    """NumPy's OpenBLAS starts an idle thread pool at import; its own fork handler joins
    the pool before every fork and starts it again only on the next BLAS call (the server
    makes none). One throwaway fork here leaves this process with its one thread."""
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)


def receive(sock: socket.socket) -> Job | None:
    """The next request; None once the router closed its end."""
    data, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, 1)
    if not data:
        return None
    msg = json.loads(data)
    if len(fds) != 1:
        raise ValueError("a request carries exactly one descriptor (the output pipe)")
    return Job(msg["argv"], msg["env"], int(msg["router"]), str(msg["name"]), fds[0])


def serve(sock: socket.socket) -> Job | None:
    """Answer requests until the router leaves (returns None), or, in a forked instance,
    return its job (the caller runs it outside this loop and its frames)."""
    while True:
        try:
            job = receive(sock)
        except (ValueError, KeyError, TypeError) as e:
            sock.send(json.dumps({"error": f"bad request: {e}"}).encode())
            continue
        if job is None:
            return None
        threads = native_threads()
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            pid = fork_instance(job)
        except OSError as e:
            os.close(job.out_fd)
            sock.send(json.dumps({"error": f"fork failed: {e}"}).encode())
            continue
        if pid == 0:  # the instance
            sock.close()
            return job
        os.close(job.out_fd)
        sock.send(json.dumps({"pid": pid, "threads": threads}).encode())


def fork_instance(job: Job) -> int:
    """Fork the instance through a middle process that exits at once (so that the instance
    is reparented to the router); returns its pid here and 0 in the instance."""
    r, w = os.pipe()
    middle = os.fork()
    if middle == 0:
        os.close(r)
        try:
            pid = os.fork()
        except OSError:
            os._exit(1)
        if pid == 0:
            os.close(w)
            return 0
        try:
            os.write(w, str(pid).encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        data = f.read()
    os.waitpid(middle, 0)  # once it is gone, the instance's parent is the router
    if not data:
        raise OSError("the middle process could not fork")
    return int(data)


def await_router(job: Job) -> None:
    """In the instance: wait until the middle process is gone and the router adopted this
    process, then die with the router (exit now if it is already gone)."""
    deadline = time.monotonic() + REPARENT_TIMEOUT_S
    while os.getppid() != job.router and time.monotonic() < deadline:
        time.sleep(0.001)
    prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != job.router:  # the router died (or adopts no orphans): never linger
        os._exit(1)


def become_instance(job: Job) -> None:
    """In the instance: its output, signals, name, environment and argv."""
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(job.out_fd, 1)
    os.dup2(job.out_fd, 2)
    os.close(null)
    os.close(job.out_fd)
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    prctl(PR_SET_NAME, f"inst:{job.name}"[:15].encode())
    os.environ.clear()
    os.environ.update(job.env)
    sys.argv = [job.argv[0], *job.argv[3:]]
    await_router(job)


def run_instance(job: Job) -> None:
    """Run the server's main as ``python -m server`` would; exits like it (the
    interpreter's normal exit: threads joined, atexit, buffers flushed)."""
    become_instance(job)
    from .main import main as server_main

    server_main(job.argv[3:])
    sys.exit(0)


def main() -> None:
    fd = int(sys.argv[1])
    sock = socket.socket(fileno=fd)
    prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() == 1:
        return
    preload()
    settle_threads()
    sock.send(json.dumps({"ready": os.getpid(), "threads": native_threads()}).encode())
    job = serve(sock)
    if job is not None:
        run_instance(job)


if __name__ == "__main__":
    main()
