"""The router's template process started as its own interpreter (``python -m
server.cli.zygote``, the path a router takes when it could not fork the template from itself):
it forks a real ``python -m server --version`` whose output comes through the pipe, whose exit
status the caller reads, and which is the caller's child (a subreaper). A request the
template cannot serve (another program) is refused with None."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time

from server.router import forked, process
from server.router.forked import Zygote


def test_a_spawned_template_forks_an_instance_the_caller_reaps():
    async def run() -> None:
        env = process.child_env(os.environ, ["sk-test"])
        z = Zygote(env, process.die_with_parent)
        await z.start()
        try:
            assert z.alive and z.last_threads == 1  # one thread before every fork
            argv = [sys.executable, "-m", "server", "--version"]
            assert await z.fork(["/bin/true"], env, "x") is None  # not the server
            assert await z.fork(argv, {**env, "X": "1"}, "x") is None  # not its environment
            proc = await z.fork(argv, env, "ver")
            assert proc is not None and proc.stdout is not None
            out = await proc.stdout.read()
            assert await proc.wait() == 0 and proc.returncode == 0
            assert b"llama-slot-server" in out
            assert z.last_threads == 1
        finally:
            await z.close()
        assert z.proc is not None and z.proc.returncode is not None

    asyncio.run(run())


def test_a_stopped_template_is_given_up_after_the_bound_and_killed():
    """A template that never answers (SIGSTOP) made every model start wait forever: the
    fork now gives up after FORK_TIMEOUT_S (the caller starts the instance the plain way),
    and the template is killed, so a late answer forks no second instance."""

    async def run() -> None:
        env = process.child_env(os.environ, ["sk-test"])
        z = Zygote(env, process.die_with_parent)
        await z.start()
        try:
            assert z.alive and z.proc is not None
            os.kill(z.proc.pid, signal.SIGSTOP)
            argv = [sys.executable, "-m", "server", "--version"]
            t0 = time.monotonic()
            # generous: the bound plus a loaded machine (before: no answer, ever)
            assert await asyncio.wait_for(z.fork(argv, env, "ver"), 60) is None
            assert time.monotonic() - t0 >= forked.FORK_TIMEOUT_S
            assert not z.alive
            assert await asyncio.wait_for(z.proc.wait(), 30) == -signal.SIGKILL
            assert await z.fork(argv, env, "ver") is None  # lost: at once, no second wait
        finally:
            if z.proc is not None and z.proc.returncode is None:
                os.kill(z.proc.pid, signal.SIGCONT)
            await z.close()

    asyncio.run(run())
