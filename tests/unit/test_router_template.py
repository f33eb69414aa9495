"""The router's template process started as its own interpreter (``python -m
server.cli.zygote``, the path a router takes when it could not fork the template from itself):
it forks a real ``python -m server --version`` whose output comes through the pipe, whose exit
status the caller reads, and which is the caller's child (a subreaper). A request the
template cannot serve (another program) is refused with None."""

from __future__ import annotations

import asyncio
import os
import sys

from server.router import process
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
