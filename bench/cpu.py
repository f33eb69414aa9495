"""Foreign CPU load: how much of the machine processes other than ours used during a sample.

On a small shared machine another process (a test run, a build) can slow a server down
several-fold; every sample records the cores used by everything except the benchmark and the
servers it started, and the runner can wait for the machine to go quiet before a sample.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

NOISY_CORES = 0.25  # foreign load above this during a sample marks it as disturbed
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _machine_busy() -> int | None:
    """Busy jiffies of the whole machine (all CPUs), from /proc/stat."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    # user nice system idle iowait irq softirq steal ...
    vals = [int(x) for x in fields[1:9]]
    return sum(vals) - vals[3] - vals[4]


def _proc_jiffies(pid: int) -> int:
    """utime + stime of a process, all threads (0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            tail = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0
    return int(tail[11]) + int(tail[12])


@dataclass
class _Snapshot:
    t: float
    busy: int
    own: int


class ForeignCpu:
    """Measures cores used by processes outside `pids` (plus this process) between marks."""

    def __init__(self, pids: Callable[[], Iterable[int]]) -> None:
        self.pids = pids  # asked at each mark: a restarted server has a new pid
        self._start: _Snapshot | None = None

    def _snap(self) -> _Snapshot | None:
        busy = _machine_busy()
        if busy is None:
            return None
        own = sum(_proc_jiffies(p) for p in [os.getpid(), *self.pids()])
        return _Snapshot(time.monotonic(), busy, own)

    def start(self) -> None:
        self._start = self._snap()

    def stop(self) -> float | None:
        """Average cores used by foreign processes since start(); None where /proc is missing."""
        end = self._snap()
        if self._start is None or end is None:
            return None
        dt = end.t - self._start.t
        if dt <= 0:
            return None
        foreign = (end.busy - self._start.busy) - (end.own - self._start.own)
        return max(0.0, foreign / _TICK / dt)

    async def settle(self, threshold: float, max_wait_s: float, window_s: float = 1.0) -> float:
        """Wait until foreign load over a window is below `threshold` cores (or time runs out).

        Returns the seconds waited.
        """
        t0 = time.monotonic()
        while True:
            self.start()
            await asyncio.sleep(window_s)
            load = self.stop()
            waited = time.monotonic() - t0
            if load is None or load < threshold or waited >= max_wait_s:
                return waited
