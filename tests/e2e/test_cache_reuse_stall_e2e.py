"""--cache-reuse against adversarial prompts (issue 40), on the default model with
--swa-full (its sliding window cannot move positions otherwise): while slot 1 streams,
slot 0 takes a prompt that matches its cached tokens in 1-token chunks (every other token
substituted, ``n_cache_reuse`` 1) or in many short chunks (an insertion every 41 tokens):
the stream never waits more than STALL_S between two tokens, the moved chunks are bounded,
and a client that leaves stops its work within LEAVE_S. The many-chunk case runs on
SmolLM2 (full attention): with a window cache one run of chunks moves (cache_reuse.py). The batch is small (-b 256) so that
an ordinary prompt step is short on a loaded CPU; before the fix the placement decoded one
gap per llama_decode, up to n_batch of them, in one engine step (~25 ms each here)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import httpx
import pytest

from server.engine.cache_reuse import MOST_CHUNKS
from tests.e2e.conftest import ServerProc, assert_agrees_with_cold, gemma_path, smollm2_path
from tests.e2e.test_cache_reuse_e2e import MOVED_TOL, text

# both tests time the longest wait of another slot against a cold prompt's: on a machine
# whose other core runs another test file, a step can take twice as long for that alone
pytestmark = pytest.mark.serial

N = 1536  # three sliding windows
N_FULL = 801  # SmolLM2's prompts (its prefill is slower here): 20 chunks of 40
STALL_S = 2.0  # generous: a 256-token step takes ~0.5 s on 2 loaded cores
LEAVE_S = 3.0


ARGS = ("-c", "8192", "-np", "2", "--cache-reuse", "64", "-b", "256", "-ub", "256")
ARGS += ("--cache-ram", "0")  # the slot's own cache only


@pytest.fixture(scope="module")
def srv():
    """The default model; --swa-full gives its window layers a full-size cache."""
    s = ServerProc("-m", gemma_path(), "--swa-full", *ARGS)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def full_srv():
    """SmolLM2 (full attention): no window cache, so up to MOST_CHUNKS chunks move."""
    s = ServerProc("-m", smollm2_path(), *ARGS)
    yield s
    s.stop()


class Streamer(threading.Thread):
    """Slot 1 generating (ignore_eos) until stopped: the arrival time of every token."""

    def __init__(self, s: ServerProc) -> None:
        super().__init__(daemon=True)
        self.url = s.url
        self.times: list[float] = []
        self.halt = threading.Event()

    def run(self) -> None:
        body = {
            "prompt": "Count from one to a thousand:",
            "n_predict": 4000,
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
            "id_slot": 1,
            "cache_prompt": False,
        }
        with (
            httpx.Client(base_url=self.url, timeout=120) as c,
            c.stream("POST", "/completion", json=body) as r,
        ):
            for line in r.iter_lines():
                if line.startswith("data: "):
                    self.times.append(time.perf_counter())
                if self.halt.is_set():
                    return

    def wait_tokens(self, n: int, timeout: float = 60) -> None:
        deadline = time.time() + timeout
        while len(self.times) < n:
            assert time.time() < deadline, "slot 1 does not stream"
            time.sleep(0.02)

    def measure(self, fn: Callable[[], dict]) -> tuple[dict, float, float]:
        """``fn()``'s result, its seconds and the longest wait between two tokens meanwhile."""
        t0 = time.perf_counter()
        out = fn()
        t1 = time.perf_counter()
        self.wait_tokens(len(self.times) + 2)
        return out, t1 - t0, self.max_gap(t0, t1)

    def max_gap(self, t0: float, t1: float) -> float:
        """The longest wait between two tokens from ``t0`` to the first token after ``t1``."""
        ts = list(self.times)
        after = next((t for t in ts if t > t1), ts[-1])
        inside = [t0] + [t for t in ts if t0 < t <= t1] + [after]
        return max(b - a for a, b in zip(inside, inside[1:], strict=False))


def complete(s: ServerProc, prompt: list[int], **kw) -> dict:
    body = {"prompt": prompt, "n_predict": 1, "n_probs": 5, "temperature": 0, "id_slot": 0}
    r = s.client.post("/completion", json={**body, **kw})
    r.raise_for_status()
    return r.json()


@contextmanager
def streaming(s: ServerProc) -> Iterator[Streamer]:
    a = Streamer(s)
    a.start()
    try:
        a.wait_tokens(5)
        yield a
    finally:
        a.halt.set()
        a.join(30)


def tokens(s: ServerProc, seed: int, n: int = N) -> list[int]:
    ids = s.tokenize(text(1400, seed))
    assert len(ids) >= n
    return ids[:n]


def bound(cold: float) -> float:
    """The longest wait allowed: STALL_S, or twice what a cold prompt of the same length
    caused (one ordinary step; the machine may be loaded)."""
    return max(STALL_S, 2 * cold)


def test_every_other_token_substituted_neither_stalls_nor_outlives_its_client(srv):
    ids = tokens(srv, 21)
    sub, sub2 = srv.tokenize(" the", add_special=False)[0], srv.tokenize(" a", False)[0]
    adversarial = [t if i % 2 == 0 else sub for i, t in enumerate(ids)]
    with streaming(srv) as a:
        _, took0, cold = a.measure(lambda: complete(srv, ids))
        r, took, gap = a.measure(lambda: complete(srv, adversarial, n_cache_reuse=1))
    t = r["timings"]
    print(f"\ncold: {took0:.2f} s, slot 1's longest wait {cold:.2f} s")
    print(f"adversarial reuse: {took:.2f} s, slot 1's longest wait {gap:.2f} s, {t}")
    assert gap <= bound(cold)  # before: ~256 one-token decodes in one step
    assert "cache_reuse_n" not in t  # no chunk is worth a step of its own
    assert t["cache_n"] + t["prompt_n"] == N
    srv.assert_integrity()

    # the same pattern again (other substitutes), streamed; the client leaves at once
    again = [t if i % 2 == 0 else sub2 for i, t in enumerate(ids)]
    body = {"prompt": again, "n_predict": 4000, "ignore_eos": True, "stream": True}
    body |= {"id_slot": 0, "n_cache_reuse": 1}
    with (
        httpx.Client(base_url=srv.url, timeout=60) as c,
        c.stream("POST", "/completion", json=body) as resp,
    ):
        assert resp.status_code == 200
        time.sleep(0.7)
    left = time.perf_counter()
    srv.wait_idle(timeout=60)
    stopped = time.perf_counter() - left
    print(f"stopped {stopped:.2f} s after the client left")
    assert stopped <= LEAVE_S  # before: the placement's decodes went on (~6 s)
    srv.assert_integrity()


# On the default model, --swa-full's window cache moves one run of adjacent chunks only
# (cache_reuse.py; tests/unit/test_cache_reuse_bounds.py): the many chunks need SmolLM2.
def test_many_short_chunks_are_capped_and_move_in_between_other_tokens(full_srv):
    srv = full_srv
    ids = tokens(srv, 22, N_FULL)
    mark = srv.tokenize(" the", add_special=False)[0]
    prompt = ids[:1]
    for i in range(1, N_FULL, 40):
        prompt += [mark] + ids[i : i + 40]  # an insertion every 41 tokens: 20 chunks
    problems: list[dict] = []

    def reuse() -> dict:
        done = threading.Event()

        def audit() -> None:  # the scratch sequence's parked chunks, between steps
            while not done.is_set():
                problems.append(srv.client.get("/debug/integrity").json())
                time.sleep(0.5)  # each reads the whole KV cache on the engine thread

        w = threading.Thread(target=audit, daemon=True)
        w.start()
        try:
            return complete(srv, prompt, n_cache_reuse=16)
        finally:
            done.set()
            w.join(10)

    with streaming(srv) as a:
        _, took0, cold = a.measure(lambda: complete(srv, ids))
        r, took, gap = a.measure(reuse)
    t = r["timings"]
    print(f"\ncold: {took0:.2f} s, slot 1's longest wait {cold:.2f} s")
    print(f"short chunks: {took:.2f} s, slot 1's longest wait {gap:.2f} s, {t}")
    assert gap <= bound(cold)
    assert t["cache_reuse_chunks"] == MOST_CHUNKS  # before: all 20, each gap decoded alone
    assert t["cache_reuse_n"] == 40 * MOST_CHUNKS
    assert t["cache_n"] + t["prompt_n"] == len(prompt)
    assert problems and all(p == {"ok": True, "problems": []} for p in problems), problems
    srv.assert_integrity()
    assert_agrees_with_cold(srv, prompt, r, MOVED_TOL)
