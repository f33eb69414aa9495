"""The disk tier against other writers sharing its directory (issue 25, section 5), on a real
server and the default model.

- An entry truncated while the server loads it: the server used to map entry files, and a
  truncated mapping is a SIGBUS on the next access past the new end (the process dies).
  The test watches the server's open files and mappings (/proc) and truncates the entry the
  moment the server holds it; the request must answer 200, recomputed, with honest counts.
- 20,000 junk files in the directory: every miss used to rescan them all on the engine
  thread (~0.4 s; over a second the first time), stalling every slot. A canary stream's
  largest gap between tokens must stay under 0.5 s while misses happen.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from pathlib import Path

import httpx

from server.tiers.disk_files import READ_DELAY_ENV
from server.types import lcp

from .conftest import ServerProc, assert_agrees_with_cold, first_token, long_text
from .test_disk_cache_e2e import complete, conv, disk_info, entries, wait_for


class Truncator(threading.Thread):
    """Truncates ``path`` to half the moment process ``pid`` has it open or mapped."""

    def __init__(self, pid: int, path: Path, timeout: float = 60) -> None:
        super().__init__(daemon=True)
        self.pid, self.path, self.timeout = pid, path, timeout
        self.size = path.stat().st_size
        self.done = threading.Event()
        self.stop = threading.Event()

    def _held(self) -> bool:
        target = str(self.path)
        fd_dir = f"/proc/{self.pid}/fd"
        try:
            for fd in os.listdir(fd_dir):
                try:
                    if os.readlink(f"{fd_dir}/{fd}") == target:
                        return True
                except OSError:
                    continue
            with open(f"/proc/{self.pid}/maps") as f:
                return target in f.read()
        except OSError:
            return False

    def run(self) -> None:
        deadline = time.time() + self.timeout
        while not self.stop.is_set() and time.time() < deadline:
            if self._held():
                os.truncate(self.path, self.size // 2)
                self.done.set()
                return


def test_an_entry_truncated_while_it_loads_is_recomputed_and_the_server_lives(
    make_server, tmp_path
):
    # 1 MiB of RAM holds nothing: the displaced slot goes straight to the disk tier. The
    # test-only read delay holds the file open long enough for the truncation to land
    # mid-load every time (a mapping, as before, is caught by /proc/<pid>/maps at once).
    s = make_server(
        "-np", "1", "--cache-ram", "1", "--cache-disk", str(tmp_path), env={READ_DELAY_ENV: "1.5"}
    )
    long = conv(20, 1400)  # ~1,600 tokens: three sliding windows
    first = complete(s, long)
    other = "Other things. " + long_text(40, seed=3)
    complete(s, other, n=1)  # displaces the long conversation: written to disk
    wait_for(lambda: disk_info(s)["counters"]["writes"] >= 1, "the displaced entry's file")
    (name,) = entries(tmp_path)
    follow = long + first["content"] + " And then?"
    follow_tokens = s.tokenize(follow)
    assert len(follow_tokens) > 1500
    t = Truncator(s.proc.pid, tmp_path / name)
    t.start()
    try:
        r = first_token(s, follow)
    except httpx.TransportError:
        s.proc.wait(10)  # -7: SIGBUS, a truncated mapping
        raise AssertionError(f"the server died, exit code {s.proc.returncode}") from None
    finally:
        t.stop.set()
    assert t.done.is_set(), "the server never opened the entry"
    assert s.proc.poll() is None, "the server died"
    # recomputed: nothing from the file; at most what the slot itself shared with the prompt
    shared = lcp(s.tokenize(other), follow_tokens)
    assert r["tokens_cached"] <= shared < 10, (r["tokens_cached"], shared)
    assert r["tokens_cached"] + r["timings"]["prompt_n"] == len(follow_tokens)
    c = disk_info(s)["counters"]
    assert (c["changed_files"], c["load_failures"], c["hits"]) == (1, 1, 0), c
    assert_agrees_with_cold(s, follow, r)  # the recomputed state predicts like a cold run
    s.assert_integrity()
    # the truncated file is examined afresh by a rescan: bad, never loaded
    wait_for(lambda: disk_info(s)["counters"]["bad_files"] == 1, "the rescan", timeout=10)
    assert disk_info(s)["n_entries"] == 0


N_JUNK = 20_000


def _junk(d: Path, n: int, tag: str) -> None:
    for i in range(n):
        os.close(os.open(d / f"{tag}-{i:05d}.part", os.O_CREAT | os.O_WRONLY, 0o644))


def _canary(s: ServerProc, stamps: list[float], started: threading.Event, stop: threading.Event):
    """A long greedy stream on one slot; the time each token arrives goes to ``stamps``."""
    body = {"prompt": "Count slowly: one, two, three,", "n_predict": 2000, "stream": True}
    body |= {"temperature": 0, "ignore_eos": True}
    with (
        httpx.Client(base_url=s.url, timeout=300) as c,
        c.stream("POST", "/completion", json=body) as r,
    ):
        for line in r.iter_lines():
            if line.startswith("data: ") and '"content"' in line:
                stamps.append(time.monotonic())
                started.set()
            if stop.is_set():
                return  # closing the connection cancels the stream


def _largest_gap(stamps: list[float], t0: float, t1: float) -> float:
    """The largest gap between canary tokens that overlaps [t0, t1]."""
    return max((b - a for a, b in itertools.pairwise(stamps) if b >= t0 and a <= t1), default=0)


WORDS = [
    "Apples",
    "Bridges",
    "Candles",
    "Deserts",
    "Engines",
    "Forests",
    "Glaciers",
    "Harbors",
    "Islands",
    "Jungles",
]
WORDS += ["Kettles", "Lanterns", "Meadows"]


def _miss_round(s: ServerProc, d: Path, r: int, stamps: list[float]) -> float:
    """Another writer adds 2,000 junk files, then four misses, each after the directory
    changed again. Returns the largest canary gap overlapping a miss beyond that miss's own
    prompt time (its prefill shares the canary's steps: compute, not a stall; on this
    shared machine a dozen tokens can take a second)."""
    _junk(d, 2_000, f"more{r}")
    time.sleep(0.5)  # the canary settles after this process's own file creation
    worst = 0.0
    for i in range(4):
        (d / f"late-{r}-{i}.part").write_bytes(b"x")
        t0 = time.monotonic()
        # a dozen tokens (about one step's compute) sharing nothing with the slot's last
        # prompt: the slot is not similar enough, the caches are asked and miss
        q = complete(s, f"{WORDS[4 * r + i]} {r}.{i}: why is the sky blue on a clear day?", n=1)
        t1 = time.monotonic()
        time.sleep(0.3)  # a canary token after the answer closes the gap
        own = q["timings"]["prompt_ms"] / 1e3
        worst = max(worst, _largest_gap(stamps, t0, t1) - own)
    return worst


def test_twenty_thousand_junk_files_do_not_stall_generation(make_server, tmp_path):
    _junk(tmp_path, N_JUNK, "junk")
    s = make_server("-np", "2", "--cache-disk", str(tmp_path))
    assert disk_info(s)["counters"]["bad_files"] == 0
    assert disk_info(s)["ignored_files"] == N_JUNK
    stamps: list[float] = []
    started, stop = threading.Event(), threading.Event()
    canary = threading.Thread(target=_canary, args=(s, stamps, started, stop), daemon=True)
    canary.start()
    assert started.wait(60)
    misses0 = disk_info(s)["counters"]["misses"]
    # Each miss used to rescan 22,000+ names on the engine thread (0.2-0.4 s, over a second
    # on the first after new junk). This shared 2-core test machine stalls steps by itself
    # (0.7-1.7 s gaps were measured with lookups of 9-90 ms, and 1.25 s with no disk tier
    # at all), so up to three rounds are tried and one must be clean; the engine thread's
    # own longest disk lookup (lookup_ms_max) is the strict bound.
    worst: list[float] = []
    for r in range(3):
        worst.append(_miss_round(s, tmp_path, r, stamps))
        if worst[-1] < 0.5:
            break
    stop.set()
    canary.join(60)
    c = disk_info(s)["counters"]
    print("canary stall per round (s):", [round(w, 3) for w in worst], c["lookup_ms_max"], "ms")
    assert min(worst) < 0.5, f"largest stalls between canary tokens {worst} s"
    assert c["lookup_ms_max"] < 250, c  # the engine thread's longest disk lookup
    n_junk = N_JUNK + 2_004 * len(worst)
    wait_for(lambda: disk_info(s)["ignored_files"] == n_junk, "the junk to be listed", 10)
    info = disk_info(s)
    assert info["counters"]["misses"] >= misses0 + 4 * len(worst), info["counters"]
    assert info["counters"]["bad_files"] == 0 and info["n_entries"] == 0
