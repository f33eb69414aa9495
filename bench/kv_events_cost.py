"""What the KV-cache events cost a decode step (--kv-events-endpoint).

The engine runs on bench/step_cost.py's free backend (decode and sampling cost nothing), with
N slots generating, once without events and once with them published for real: the slot
watcher after every step, block hashing, the ledger, and the publisher thread encoding
msgpack and sending on a bound ZMQ PUB socket (no subscriber). The added CPU time per step
(all threads: ``process_time``) is set against a real decode step of the default model on
this machine (ARCHITECTURE §10: 24 ms for 1 sequence, 39 ms for 4).

    python -m bench.kv_events_cost           # 1, 4 and 16 slots
"""

from __future__ import annotations

import sys
import time

from server.kv_events.kv_blocks import BlockHasher
from server.kv_events.kv_events import KVEvents
from server.kv_events.kv_publisher import KVPublisher
from server.kv_events.kv_watch import watch_slots

from .step_cost import busy_engine

REAL_STEP_MS = {1: 24.0, 4: 39.0}


def per_step_us(n_slots: int, events: bool, steps: int = 2000, prompt_len: int = 1024) -> float:
    """CPU microseconds per generating step (prefill of ``prompt_len`` excluded)."""
    e, b = busy_engine(n_slots, prompt_len, steps + 10)
    pub = None
    if events:
        pub = KVPublisher("tcp://127.0.0.1:*", "kv@bench@m", settle_s=0)
        pub.start()
        ev = KVEvents(BlockHasher(16, "m"), pub.publish)
        e.kv_watch = watch_slots(ev, e.store.blocks, e.slots)
    for _ in range(4):  # admission and prefill (its blocks published), then warm up
        e.step()
    t0 = time.process_time()
    for _ in range(steps):
        e.step()
    if pub is not None:
        pub.close(5)  # the sender's share counted too
    dt = time.process_time() - t0
    b.batch.free()
    return dt / steps * 1e6


def main(argv: list[str]) -> None:
    for n in [int(a) for a in argv] or [1, 4, 16]:
        base = min(per_step_us(n, False) for _ in range(3))
        with_ev = min(per_step_us(n, True) for _ in range(3))
        added = with_ev - base
        real = REAL_STEP_MS.get(n)
        share = f"{added / (real * 1e3) * 100:.3f} % of a real {real:.0f} ms step" if real else ""
        print(f"{n:3d} slots: {base:7.1f} -> {with_ev:7.1f} us/step (+{added:.1f} us) {share}")


if __name__ == "__main__":
    main(sys.argv[1:])
