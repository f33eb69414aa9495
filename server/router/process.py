"""An instance's server process: ``python -m server`` on a port the router picks, with the
router's internal API key, its output prefixed with the model's name on the router's stderr.

The child runs this package's own code (``PYTHONPATH`` names the directory that holds it), on
127.0.0.1 only, and dies with the router (``PR_SET_PDEATHSIG`` on Linux)."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import socket
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol

import httpx

log = logging.getLogger("server.router")

PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])
# Variables of the router's own flags: an instance gets these from the router, never from
# the environment it inherits.
ROUTER_ENV = (
    "LLAMA_ARG_MODELS_DIR",
    "LLAMA_ARG_MODELS_PRESET",
    "LLAMA_ARG_MODELS_MAX",
    "LLAMA_ARG_MODELS_AUTOLOAD",
    "LLAMA_ARG_HOST",
    "LLAMA_ARG_PORT",
    "LLAMA_API_KEY",
    "LLAMA_ARG_API_KEY_FILE",
    "LLAMA_ARG_ALIAS",
    "LLAMA_ARG_MODEL",
    "LLAMA_ARG_ALLOWED_HOSTS",
    "LLAMA_ARG_CORS_ORIGINS",
    "LLAMA_ARG_CORS_METHODS",
    "LLAMA_ARG_CORS_HEADERS",
    "LLAMA_ARG_CORS_CREDENTIALS",
    "LLAMA_ARG_SSL_KEY_FILE",
    "LLAMA_ARG_SSL_CERT_FILE",
    "LLAMA_ARG_LOG_FILE",
)
HEALTH_POLL_S = 0.05
PR_SET_PDEATHSIG = 1


class InstanceProcess(Protocol):
    """What the router uses of an instance's process: ``asyncio.subprocess.Process`` (a
    plain spawn) and ``server.router.forked.ForkedProcess`` (forked by the template)."""

    @property
    def pid(self) -> int: ...
    @property
    def returncode(self) -> int | None: ...
    @property
    def stdout(self) -> asyncio.StreamReader | None: ...
    async def wait(self) -> int: ...
    def terminate(self) -> None: ...
    def kill(self) -> None: ...


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the child binds it a moment later)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def child_env(base: Mapping[str, str], keys: list[str]) -> dict[str, str]:
    """The instance's environment: the router's, less its own flags' variables, with the
    API keys the instance accepts and this package first on the import path."""
    env = {k: v for k, v in base.items() if k not in ROUTER_ENV}
    env["LLAMA_API_KEY"] = ",".join(keys)
    path = env.get("PYTHONPATH")
    env["PYTHONPATH"] = PACKAGE_ROOT + (os.pathsep + path if path else "")
    return env


def die_with_parent() -> None:  # runs in the child, before exec
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


async def spawn(argv: list[str], env: dict[str, str]) -> asyncio.subprocess.Process:
    """Start the child (stdout and stderr in one pipe, read by ``pump_output``)."""
    return await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env=env,
        preexec_fn=die_with_parent if sys.platform.startswith("linux") else None,
    )


async def pump_output(proc: InstanceProcess, name: str) -> None:
    """Copy the child's output to the router's stderr, each line prefixed with ``[name]``."""
    assert proc.stdout is not None
    while line := await proc.stdout.readline():
        sys.stderr.write(f"[{name}] {line.decode(errors='replace')}")
    sys.stderr.flush()


async def wait_healthy(proc: InstanceProcess, port: int, client: httpx.AsyncClient) -> bool:
    """True once the child's ``/health`` answers 200; False if the process exits first."""
    url = f"http://127.0.0.1:{port}/health"
    while proc.returncode is None:
        with contextlib.suppress(httpx.HTTPError):
            r = await client.get(url, timeout=2.0)
            if r.status_code == 200:
                return True
        await asyncio.sleep(HEALTH_POLL_S)
    return False


async def terminate(
    proc: InstanceProcess, exited: asyncio.Event, timeout: float, at_once: bool = False
) -> None:
    """SIGTERM, then SIGKILL if it has not exited within ``timeout`` seconds (``at_once``:
    SIGKILL now); returns once ``exited`` (set by whoever awaits the process) is set."""
    with contextlib.suppress(ProcessLookupError):
        proc.kill() if at_once else proc.terminate()
    try:
        await asyncio.wait_for(exited.wait(), timeout)
    except asyncio.TimeoutError:
        log.warning("instance pid %d did not stop in %.0f s: killing it", proc.pid, timeout)
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await exited.wait()
