"""Starting, readying and always stopping the servers under test."""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
CACHE_ROOT = Path(os.environ.get("LLAMA_SERVER_CACHE", Path.home() / ".cache/llama-slot-server"))

LLAMA_SERVER = "llama-server"
OURS = "ours"
LCP = "llama-cpp-python"


@dataclass
class ServerSpec:
    name: str  # LLAMA_SERVER, OURS or LCP
    argv: list[str]  # everything but --host/--port
    health_path: str = "/health"
    port_flags: tuple[str, str] = ("--host", "--port")
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class ServerProcess:
    spec: ServerSpec
    port: int
    proc: subprocess.Popen[bytes]
    log_path: Path

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command_line(self) -> str:
        return " ".join(self.spec.argv)

    def log_tail(self, n: int = 30) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])


_RUNNING: list[ServerProcess] = []


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(spec: ServerSpec, log_dir: Path) -> ServerProcess:
    """Start a server in its own process group (so Ctrl-C reaches only us; we stop it)."""
    port = free_port()
    host_flag, port_flag = spec.port_flags
    argv = [*spec.argv, host_flag, "127.0.0.1", port_flag, str(port)]
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{spec.name}-{port}.log"
    with open(log_path, "wb") as log:
        log.write((" ".join(argv) + "\n\n").encode())
        log.flush()
        proc = subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=ROOT,
            env={**os.environ, **spec.env},
            start_new_session=True,
        )
    sp = ServerProcess(spec, port, proc, log_path)
    _RUNNING.append(sp)
    return sp


def wait_ready(sp: ServerProcess, timeout_s: float = 600.0) -> None:
    """Poll the health endpoint until 200; fail early if the process exits."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=5.0, trust_env=False) as c:
        while time.monotonic() < deadline:
            if sp.proc.poll() is not None:
                raise RuntimeError(
                    f"{sp.name} exited with {sp.proc.returncode} while starting; log "
                    f"{sp.log_path}:\n{sp.log_tail()}"
                )
            with contextlib.suppress(httpx.HTTPError):
                if c.get(sp.url + sp.spec.health_path).status_code == 200:
                    return
            time.sleep(0.25)
    raise TimeoutError(f"{sp.name} not ready after {timeout_s:.0f}s; log {sp.log_path}")


def stop(sp: ServerProcess, grace_s: float = 10.0) -> None:
    """SIGTERM the server's process group, SIGKILL it if it lingers."""
    if sp in _RUNNING:
        _RUNNING.remove(sp)
    if sp.proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(sp.proc.pid, signal.SIGTERM)
    try:
        sp.proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(sp.proc.pid, signal.SIGKILL)
        sp.proc.wait(5.0)


def stop_all() -> None:
    for sp in list(_RUNNING):
        stop(sp)


def _on_sigterm(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def install_cleanup() -> None:
    """Stop every started server at exit, on Ctrl-C (KeyboardInterrupt) and on SIGTERM/SIGHUP."""
    atexit.register(stop_all)
    # Ctrl-C raises KeyboardInterrupt even when started with SIGINT ignored (`cmd &` in a script).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _on_sigterm)
    signal.signal(signal.SIGHUP, _on_sigterm)


# --- the three servers -------------------------------------------------------------------


def llama_version() -> str:
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        if line.startswith("llama-cpp-python=="):
            return line.split("==", 1)[1].strip()
    raise RuntimeError("no llama-cpp-python pin in requirements.txt")


def ensure_llama_server() -> str:
    """Path of the cached llama-server binary; builds it (or waits for a build) if missing."""
    script = ROOT / "bench" / "build_llama_server.sh"
    out = subprocess.run(
        ["bash", str(script)], check=True, stdout=subprocess.PIPE, text=True, cwd=ROOT
    )
    return out.stdout.strip().splitlines()[-1]


def help_text(argv: list[str]) -> str:
    try:
        r = subprocess.run([*argv, "--help"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return r.stdout + r.stderr


def common_flags(model: str, threads: int, ctx: int, parallel: int) -> list[str]:
    # Both unified: ours defaults to it, llama-server does with the default (auto) -np, and a
    # 4,000-token slot only fits a slot that may use the whole context.
    return ["-m", model, "-t", str(threads), "-c", str(ctx), "-np", str(parallel), "-kvu"]


def llama_server_spec(
    binary: str, common: list[str], save_dir: Path | None, extra: list[str]
) -> ServerSpec:
    argv = [binary, *common]
    if "--no-webui" in help_text([binary]):
        argv.append("--no-webui")
    if save_dir is not None:
        argv += ["--slot-save-path", str(save_dir)]
    return ServerSpec(LLAMA_SERVER, argv + extra)


def ours_spec(common: list[str], save_dir: Path | None, extra: list[str]) -> ServerSpec:
    argv = [sys.executable, "-m", "server", *common]
    if save_dir is not None and "--slot-save-path" in help_text([sys.executable, "-m", "server"]):
        argv += ["--slot-save-path", str(save_dir)]
    return ServerSpec(OURS, argv + extra)


def lcp_spec(python: str, model: str, threads: int, ctx: int) -> ServerSpec:
    """llama-cpp-python's own server: one request at a time, no slots (queue, don't interrupt)."""
    argv = [python, "-m", "llama_cpp.server", "--model", model, "--n_ctx", str(ctx)]
    argv += ["--n_threads", str(threads), "--n_threads_batch", str(threads)]
    argv += ["--interrupt_requests", "False"]
    return ServerSpec(LCP, argv, health_path="/v1/models")


def _wheel_variant() -> str:
    """The CPU variant name scripts/bootstrap.sh gives its cached wheel."""
    flags = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = line
                break
    return "cpu-" + hashlib.md5((flags + "\n").encode()).hexdigest()[:12]


def ensure_lcp_python() -> tuple[str | None, str]:
    """A separate venv (under the cache) with llama-cpp-python[server] from the cached wheel.

    Returns (python path, "") or (None, why it is unavailable).
    """
    version = llama_version()
    venv = CACHE_ROOT / f"lcp-server-venv-{version}"
    py = venv / "bin" / "python"
    probe = [str(py), "-c", "import llama_cpp.server.app"]
    if py.exists() and subprocess.run(probe, capture_output=True).returncode == 0:
        return str(py), ""
    wheel_dir = CACHE_ROOT / "wheels" / version
    wheels = sorted((wheel_dir / _wheel_variant()).glob("llama_cpp_python-*.whl"))
    wheels = wheels or sorted(wheel_dir.glob("*/llama_cpp_python-*.whl"))
    if not wheels:
        return (
            None,
            f"no cached llama-cpp-python wheel under {wheel_dir} (run scripts/bootstrap.sh)",
        )
    try:
        if not py.exists():
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        pip = [str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
        subprocess.run([*pip, f"{wheels[0]}[server]"], check=True)
    except (OSError, subprocess.CalledProcessError) as e:
        return None, f"could not set up {venv}: {e}"
    if subprocess.run(probe, capture_output=True).returncode != 0:
        return None, f"{venv} cannot import llama_cpp.server"
    return str(py), ""
