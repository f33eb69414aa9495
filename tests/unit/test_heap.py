"""server.http.heap: the collector's settings of a serving process (run in a child process:
a frozen heap would stay frozen in the test process)."""

from __future__ import annotations

import json
import subprocess
import sys

from server.http.heap import GEN0_THRESHOLD, GEN1_THRESHOLD, GEN2_THRESHOLD, GIL_SWITCH_S

_CHILD = """
import gc, json, sys
import server.http.app  # the app's modules: what a serving process holds for its lifetime
from server.http.heap import settle_heap
before = gc.get_freeze_count()
settle_heap()
print(json.dumps({"before": before, "frozen": gc.get_freeze_count(),
                  "threshold": gc.get_threshold(), "young": gc.get_count()[0],
                  "switch": sys.getswitchinterval()}))
"""


def test_settle_heap_freezes_the_startup_heap_and_collects_less_often():
    out = subprocess.run(
        [sys.executable, "-c", _CHILD], capture_output=True, text=True, check=True, timeout=120
    )
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["before"] == 0
    assert got["frozen"] > 10_000  # the framework's objects: never scanned again
    assert got["threshold"] == [GEN0_THRESHOLD, GEN1_THRESHOLD, GEN2_THRESHOLD]
    assert got["young"] < 1_000  # collected just before the freeze
    assert got["switch"] == GIL_SWITCH_S  # the engine thread waits 1 ms for the GIL, not 5
