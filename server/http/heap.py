"""The garbage collector's settings for a serving process.

CPython's cyclic collector runs after every 700 net allocations of container objects and
scans every object of a generation it collects. A server allocates a few objects per token
(events, chunks, frames) and holds the whole framework's objects (FastAPI, pydantic,
Jinja, the routes) for its lifetime, so under load the defaults run a young collection
every few tokens and a full one (80 ms on the 2-core machine: a stall of every stream) every
few seconds: about a fifth of the server's CPU per streamed token (``bench/ceiling.py``).

Per-request objects are freed by reference counting as soon as a request ends (a request's
TaskGroup holds no reference cycle: ``service.tasks``), so collecting less often costs
little memory.
"""

from __future__ import annotations

import gc
import sys

# How long a thread may hold the GIL while another waits for it (CPython: 5 ms). The engine
# thread re-takes the GIL after every llama.cpp call (ctypes lets it go during each); while
# request preparation runs Python on the worker pools, each re-take waited up to 5 ms, so a
# step of a few dozen calls stalled every stream for a good part of a second.
GIL_SWITCH_S = 0.001

# Young collections after this many net allocations (CPython: 700); older generations
# after this many younger collections (CPython: 10 and 10).
GEN0_THRESHOLD = 50_000
GEN1_THRESHOLD = 20
GEN2_THRESHOLD = 100


def settle_heap() -> None:
    """Collect once, freeze what is left (the imports, the app and its routes: never garbage,
    now never scanned again) and collect less often from here on; hand the GIL over within
    ``GIL_SWITCH_S``. Call once, in the serving process, after the app is built and before
    it serves (not in test processes that build many apps: a frozen object is never
    collected)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(GEN0_THRESHOLD, GEN1_THRESHOLD, GEN2_THRESHOLD)
    # not the collector's, but the same moment and the same processes: the serving ones
    sys.setswitchinterval(GIL_SWITCH_S)
