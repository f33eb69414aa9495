"""The compile children (server.constrained.worker) end with the server (issue 56, item 12).

A supervisor sends SIGTERM, then SIGKILL after its grace period (llama.cpp's test harness:
5 s). Killed, the server cannot end its children: each must notice by itself, at once,
whether or not its stdin pipe reports an end (a compile in progress reads none, and a copy
of the pipe's other end held by any other process keeps the end from coming: the test
holds one). Terminated, the server kills and reaps them itself, so none is left behind as
a zombie of whoever adopts it (this pytest process, a child subreaper, adopts orphans)."""

from __future__ import annotations

import os
import signal
import time

import pytest

from server.router.forked import become_subreaper

from .conftest import ServerProc

CHILD = "server.constrained.child"


def compile_children(parent: int) -> list[int]:
    """The pids of ``parent``'s compile children, from /proc."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmd = f.read().decode(errors="replace")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == parent and CHILD in cmd:
            out.append(int(name))
    return out


def state(pid: int) -> str | None:
    """The process's state letter (``Z``: exited, not reaped yet); None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0].decode()
    except (OSError, IndexError):
        return None


def reap(pids: list[int]) -> None:
    """Reap those of ``pids`` that this process adopted and that have exited."""
    for pid in pids:
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:  # not ours (or reaped already)
            pass


def with_children(s: ServerProc) -> list[int]:
    """A request with a JSON schema (compiled in a child), then the server's children."""
    body = {"prompt": "A number:", "n_predict": 2, "json_schema": {"type": "integer"}}
    r = s.client.post("/completion", json=body)
    assert r.status_code == 200, r.text
    kids = compile_children(s.proc.pid)
    assert kids, "no compile child runs"
    return kids


@pytest.mark.serial  # kills its server: runs alone
def test_a_killed_server_takes_its_compile_children_along(make_server):
    s = make_server("-np", "1")
    kids = with_children(s)
    # a copy of each child's stdin pipe, open for writing: the children see no end of it
    held = [os.open(f"/proc/{pid}/fd/0", os.O_WRONLY | os.O_NONBLOCK) for pid in kids]
    try:
        s.proc.kill()
        s.proc.wait(30)
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline and any(state(p) not in (None, "Z") for p in kids):
            time.sleep(0.05)
        assert {p: state(p) for p in kids if state(p) not in (None, "Z")} == {}
    finally:
        for fd in held:
            os.close(fd)
        reap(kids)


@pytest.mark.serial  # signals its server: runs alone
def test_a_terminated_server_reaps_its_compile_children(make_server):
    assert become_subreaper()  # orphans (children the server left) come to this process
    s = make_server("-np", "1")
    kids = with_children(s)
    s.proc.send_signal(signal.SIGTERM)
    assert s.proc.wait(30) == 0
    try:
        # gone, not even a zombie: the server waited for each before it exited
        assert {p: state(p) for p in kids if state(p) is not None} == {}
    finally:
        reap(kids)


def test_the_drain_fits_a_supervisors_grace_period():
    """Requests may finish for DRAIN_S after SIGTERM, connections close within GRACE_S: both
    before a supervisor's SIGKILL (5 s in llama.cpp's test harness), so the server still
    ends its children itself."""
    from server.cli.main import DRAIN_S, GRACE_S

    assert DRAIN_S < GRACE_S <= 5
