"""Router mode's template process (server.cli.zygote, server.router.forked): instances are
forked from a process that imported the server once, become the router's children, keep
their own environment, die with the router, outlive the template; without it, they start
the plain way. A switch under --models-max 1 kills the idle instance instead of draining it.
Real router, real models, real HTTP; nothing here asserts generated text or wall time."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

import httpx

from . import test_router_e2e as base
from .test_router_e2e import complete, instance_pid, statuses, wait_status

# the router tests' fixtures: a models directory with both models, routers stopped after
models_dir = base.models_dir
make_router = base.make_router


def children(pid: int) -> set[int]:
    out: set[int] = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        out.update(int(p) for p in (task / "children").read_text().split())
    return out


def proc_field(pid: int, name: str) -> str:
    return Path(f"/proc/{pid}/{name}").read_text().strip()


def ppid(pid: int) -> int:
    stat = proc_field(pid, "stat")
    return int(stat[stat.rfind(")") + 2 :].split()[1])


def zygote_pid(router: int, timeout: float = 120) -> int:
    """The router's template process: its child that is no instance (forked from the
    router, it has the router's command line and name)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        for pid in children(router):
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
                if b"--alias" not in cmd and not proc_field(pid, "comm").startswith("inst:"):
                    return pid
            except OSError:
                continue
        time.sleep(0.1)
    raise AssertionError("no template process")


def gone(pid: int) -> bool:
    """Whether ``pid`` has exited (a zombie counts as exited)."""
    try:
        stat = proc_field(pid, "stat")
    except OSError:
        return True
    return stat[stat.rfind(")") + 2 :].startswith("Z")


def wait_gone(pid: int, timeout: float = 60) -> None:
    deadline = time.time() + timeout
    while not gone(pid) and time.time() < deadline:
        time.sleep(0.05)
    assert gone(pid), f"process {pid} still runs"


def test_forked_instances_serve_with_their_own_key_and_no_thread_before_the_fork(make_router):
    r = make_router("--api-key", "sk-router")
    key = {"Authorization": "Bearer sk-router"}
    zyg = zygote_pid(r.proc.pid)
    assert complete(r, "gemma", headers=key).status_code == 200
    st = statuses(r, key)["gemma"]
    pid = instance_pid(st)
    # forked by the template (the router's command line), adopted by the router, named
    assert b"--alias" not in Path(f"/proc/{pid}/cmdline").read_bytes()
    assert ppid(pid) == r.proc.pid and proc_field(pid, "comm") == "inst:gemma"
    # the template holds one thread (none before a fork): llama.cpp's start in the instance
    assert len(os.listdir(f"/proc/{zyg}/task")) == 1
    assert len(os.listdir(f"/proc/{pid}/task")) > 1
    # its own environment (LLAMA_API_KEY: the router's keys and its internal one; the
    # router took --api-key as a flag, so only that variable gives the instance this key)
    port = int(st["args"][st["args"].index("--port") + 1])
    url = f"http://127.0.0.1:{port}/completion"
    body = {"prompt": "Hi", "n_predict": 2}
    assert httpx.post(url, json=body, timeout=120).status_code == 401
    wrong = {"Authorization": "Bearer sk-other"}
    assert httpx.post(url, json=body, headers=wrong, timeout=120).status_code == 401
    ok = httpx.post(url, json=body, headers=key, timeout=120)
    assert ok.status_code == 200 and ok.json()["tokens_predicted"] == 2


def test_crash_and_a_lost_template_leave_the_others_serving(make_router):
    r = make_router()
    zyg = zygote_pid(r.proc.pid)
    assert complete(r, "gemma").status_code == 200
    assert complete(r, "smollm2").status_code == 200
    gemma, small = instance_pid(statuses(r)["gemma"]), instance_pid(statuses(r)["smollm2"])
    os.kill(gemma, signal.SIGKILL)
    st = wait_status(r, "gemma", "unloaded")
    assert st["failed"] is True and st["exit_code"] == -signal.SIGKILL  # the router reaped it
    assert complete(r, "smollm2").status_code == 200
    # the template dies: running instances stay (they are the router's children) and the
    # next instance starts the plain way
    os.kill(zyg, signal.SIGKILL)
    wait_gone(zyg)
    assert complete(r, "smollm2").status_code == 200
    assert instance_pid(statuses(r)["smollm2"]) == small
    assert complete(r, "gemma").status_code == 200
    pid = instance_pid(statuses(r)["gemma"])
    cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    assert cmd[1:3] == [b"-m", b"server"] and b"--alias" in cmd and ppid(pid) == r.proc.pid
    assert not proc_field(pid, "comm").startswith("inst:")
    assert "template process lost" in r.log_path.read_text()


def test_instances_and_the_template_die_with_the_router(make_router):
    r = make_router()
    zyg = zygote_pid(r.proc.pid)
    assert complete(r, "smollm2").status_code == 200
    pid = instance_pid(statuses(r)["smollm2"])
    r.proc.kill()  # no shutdown: only PR_SET_PDEATHSIG stops them
    r.proc.wait()
    wait_gone(pid)
    wait_gone(zyg)


def test_a_switch_kills_the_idle_instance_and_an_unload_drains(make_router):
    r = make_router("--models-max", "1")
    assert complete(r, "gemma").status_code == 200
    assert complete(r, "smollm2").status_code == 200  # the switch
    st = wait_status(r, "gemma", "unloaded")
    assert "failed" not in st  # stopped by the router, not a crash
    log = r.log_path.read_text()
    assert "stopping model gemma to make room for smollm2" in log
    # the idle instance got SIGKILL: it never began a graceful shutdown
    assert not [ln for ln in log.splitlines() if ln.startswith("[gemma]") and "draining" in ln]
    # an unload by hand still drains (SIGTERM: running requests may finish)
    res = r.client.post("/models/unload", json={"model": "smollm2"})
    assert res.status_code == 200, res.text
    wait_status(r, "smollm2", "unloaded")
    deadline = time.time() + 30
    while time.time() < deadline:
        lines = r.log_path.read_text().splitlines()
        if [ln for ln in lines if ln.startswith("[smollm2]") and "draining" in ln]:
            break
        time.sleep(0.1)
    else:
        raise AssertionError("the unloaded instance did not drain")


def test_a_stopped_template_falls_back_to_a_plain_start(make_router):
    """Issue 56, 9: a template process that never answers (SIGSTOP) made every model start
    wait forever. The fork gives up after 5 s (FORK_TIMEOUT_S), says why in the log, kills the
    template, and the instance starts the plain way (its own interpreter)."""
    r = make_router()
    zyg = zygote_pid(r.proc.pid)
    os.kill(zyg, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        # before: no answer, ever (the client's own timeout is 120 s)
        assert complete(r, "smollm2").status_code == 200
        # generous: the bound (5 s), then a plain start on a loaded machine
        assert time.monotonic() - t0 < 100
        pid = instance_pid(statuses(r)["smollm2"])
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        assert cmd[1:3] == [b"-m", b"server"] and b"--alias" in cmd
        assert "no answer to a fork" in r.log_path.read_text()
        wait_gone(zyg)  # killed: a late answer forks nothing
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(zyg, signal.SIGCONT)
