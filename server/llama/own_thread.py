"""ggml compute outside the engine thread runs on a thread of its own, which then exits.

Why: this build's CPU backend runs each graph on OpenMP threads (libgomp). libgomp keeps a
pool of worker threads for every thread that ever started a parallel region, until that
thread exits, and counts them all as its "managed" threads. Once they outnumber the CPUs,
libgomp cuts every spin-wait to ~100 iterations, so most of the hundreds of barriers in
one llama_decode sleep on a futex and wake again. Measured on 2 cores: after one image was
encoded on a request-preparation thread (a second pool), every later token of every slot
took 20-40 % longer (15 -> 19-22 ms at the default model), and a follow-up's prompt too.
A thread that exits frees its pool, so the invariant is: only the engine thread keeps a
pool (its decodes), and an image encode or a warm-up runs through ``run_on_own_thread``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def run_on_own_thread(fn: Callable[[], T], name: str) -> T:
    """``fn()`` run on a new thread that exits when it returns; its result, or its
    exception raised here. Blocks the caller meanwhile (a thread start costs ~0.1 ms)."""
    box: list[T] = []
    err: list[BaseException] = []

    def body() -> None:
        try:
            box.append(fn())
        except BaseException as e:  # handed to the caller, raised there
            err.append(e)

    t = threading.Thread(target=body, name=name, daemon=True)
    t.start()
    t.join()
    if err:
        raise err[0]
    return box[0]
