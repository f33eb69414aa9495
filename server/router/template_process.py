"""The router's template process: forked from the router before it starts a thread
(``fork_template``), or started as ``python -m server.cli.zygote FD``. It imports the
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
import logging
import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

from .forked import MAX_MESSAGE

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


def run_instance(job: Job, server_main: Callable[[list[str]], None]) -> None:
    """Run the server's main as ``python -m server`` would; exits like it (SystemExit: the
    interpreter's normal exit, threads joined, atexit, buffers flushed). An error is no
    caller's business (these frames are the template's): traceback and status 1."""
    become_instance(job)
    try:
        server_main(job.argv[3:])
    except SystemExit:
        raise
    except BaseException:
        traceback.print_exc()
        sys.exit(1)
    sys.exit(0)


def reset_logging() -> None:
    """A template forked from the router: its logging (handlers, a --log-file) is the
    router's; an instance sets up its own from its flags."""
    logging.disable(logging.NOTSET)
    for h in list(logging.root.handlers):
        logging.root.removeHandler(h)
        h.close()
    for name in ("httpx", "server", "server.router"):
        logging.getLogger(name).setLevel(logging.NOTSET)


def template(sock: socket.socket, preload: Callable[[], None]) -> Job | None:
    """The template's life: ``preload`` (the imports: no thread, no model, no socket), the
    ready message, then requests (see ``serve``)."""
    prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's ^C: the router stops it
    preload()
    settle_threads()
    sock.send(json.dumps({"ready": os.getpid(), "threads": native_threads()}).encode())
    return serve(sock)


def fork_template(
    preload: Callable[[], None], server_main: Callable[[list[str]], None]
) -> tuple[int, int] | None:
    """Fork the template from the router itself, before the router starts a thread: it
    has imported the server already, so the template is ready at once. Returns its pid and
    the router's end of the control socket; None where a thread runs already (then the
    router starts ``python -m server.cli.zygote``). Never returns in the template."""
    if threading.active_count() != 1 or not sys.platform.startswith("linux"):
        return None
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        theirs.close()
        return pid, mine.detach()
    mine.close()
    try:
        reset_logging()
        job = template(theirs, preload)
    except BaseException:
        traceback.print_exc()
        os._exit(1)
    if job is None:
        os._exit(0)  # never back into the router's frames
    run_instance(job, server_main)
    os._exit(0)
