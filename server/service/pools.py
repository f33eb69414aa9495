"""The worker pools a request's preparation runs on, and how long it may take.

Rendering a chat template, tokenizing, mapping an Anthropic or Responses body, checking
tools and compiling a schema run in worker threads so that the event loop keeps serving
streams. They run here, not on asyncio's default executor, which sleep/wake, slot files and
the server's own housekeeping share: whatever clients send cannot starve those.

Three lanes, each a bounded pool of its own: requests whose body is over ``HEAVY_BYTES``
(or of unknown size) take the heavy lane (``HEAVY_WORKERS`` threads), the rest the light
lane (``LIGHT_WORKERS``). However many huge bodies arrive, a small chat's preparation never
waits behind them. A request whose images are to be decoded moves to the media lane
(``MEDIA_WORKERS``) when it gets there (server.media.media_scope: ``NeedsMediaLane``, raised
before any image is decoded), so a small body holding images that are slow to decode (a
35-byte GIF may declare 8192x4096 pixels) never holds a light worker while it decodes.

``prepare(request, timeout, fn, *args)`` runs ``fn(*args)`` on the request's lane and
returns its result, with three guarantees:

- the client leaving (polled every ``POLL_S`` once the work has run ``WATCH_AFTER_S``)
  abandons the work: queued work is dropped without running, running work stops at its
  next ``server.cancel.checkpoint`` (between messages, items, tokenizer chunks);
- ``timeout`` seconds (--request-prep-timeout) after the request's first ``prepare`` (the
  wait in the queue and every later hand-off of the same request count) the work is
  abandoned the same way and the request is answered 408 ``timeout_error``;
- the coroutine being cancelled (server shutdown, a middleware) abandons it too.

``prepare_in(scope, ...)`` does the same inside a ``MediaScope`` (the request's tenant and
image budgets): the move to the media lane holds the request's image pixels against its
API key's budget (429 past it) until the work ends or is dropped unrun.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
from collections.abc import Callable
from functools import partial
from typing import ParamSpec, TypeVar

from starlette.requests import Request

from ..cancel import CancelFlag, run_with
from ..media.media_scope import MediaScope, NeedsMediaLane, run_in
from ..schemas.errors import APIError

T = TypeVar("T")
P = ParamSpec("P")

HEAVY_BYTES = 256 * 1024  # a body over this (or of unknown length) takes the heavy lane
_CPUS = os.cpu_count() or 2
# Threads mostly wait on the GIL or in C (the tokenizer releases it); more light workers
# than cores keep short requests from queueing behind each other's constraint compiles.
LIGHT_WORKERS = max(4, min(16, _CPUS + 2))
HEAVY_WORKERS = max(2, min(8, _CPUS // 2))
# image decoding takes one projector at a time (its lock): more workers would only wait,
# while rendering and tokenizing the rest of a media request keep a second one busy
MEDIA_WORKERS = max(2, min(4, _CPUS // 2))
_WORKERS = {"light": LIGHT_WORKERS, "heavy": HEAVY_WORKERS, "media": MEDIA_WORKERS}
WATCH_AFTER_S = 0.1  # most preparations end before: they cost no watcher
POLL_S = 0.25  # how often a waiting client is checked for having left

_pools: dict[str, concurrent.futures.ThreadPoolExecutor] = {}
_lock = threading.Lock()


def pool(lane: str) -> concurrent.futures.ThreadPoolExecutor:
    """The pool of ``lane`` ("light", "heavy" or "media"), made at first use (one per
    process)."""
    with _lock:
        p = _pools.get(lane)
        if p is None:
            n = _WORKERS[lane]
            p = _pools[lane] = concurrent.futures.ThreadPoolExecutor(n, f"prep-{lane}")
        return p


def lane_of(request: Request | None) -> str:
    """ "heavy" for a body over HEAVY_BYTES or without a length; "light" otherwise (no
    request, or one without a body: light)."""
    if request is None:
        return "light"
    length = request.headers.get("content-length")
    if length is None:
        return "heavy" if request.method in ("POST", "PUT", "PATCH") else "light"
    return "heavy" if not length.isdigit() or int(length) > HEAVY_BYTES else "light"


async def _until_gone(request: Request, gone: asyncio.Future[None]) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(POLL_S)
    if not gone.done():
        gone.set_result(None)


def _retrieve(f: asyncio.Future[T]) -> None:
    # an abandoned work's outcome (often Cancelled) is read by nobody: read it here so
    # asyncio does not log "exception was never retrieved"
    if not f.cancelled():
        f.exception()


def _deadline(request: Request | None, loop: asyncio.AbstractEventLoop, timeout: float) -> float:
    """The request's deadline (loop time): set by its first ``prepare``, so the limit holds
    for the request's whole preparation, not for each hand-off."""
    state = getattr(request, "state", None)
    if state is None:
        return loop.time() + timeout
    deadline = getattr(state, "prep_deadline", None)
    if deadline is None:
        deadline = state.prep_deadline = loop.time() + timeout
    return float(deadline)


def _timed_out(timeout: float) -> APIError:
    return APIError(
        408,
        f"preparing the request took longer than {timeout:g} s (--request-prep-timeout)",
        "timeout_error",
    )


async def prepare(
    request: Request | None,
    timeout: float,
    fn: Callable[P, T],
    *args: P.args,
    **kwargs: P.kwargs,
) -> T:
    """``fn(*args, **kwargs)`` on the request's lane (see the module docstring). APIError
    408 after ``timeout`` seconds; APIError 499 when the client has left (nobody reads it)."""
    return await prepare_in(None, request, timeout, fn, *args, **kwargs)


async def prepare_in(
    scope: MediaScope | None,
    request: Request | None,
    timeout: float,
    fn: Callable[P, T],
    *args: P.args,
    **kwargs: P.kwargs,
) -> T:
    """``prepare`` inside ``scope``: where the work is about to decode images on a text lane
    (``NeedsMediaLane``), it runs again on the media lane, holding the pixels it had
    charged against its key's budget (APIError 429 past it) until it ends."""
    work = partial(fn, *args, **kwargs)
    try:
        return await _run(lane_of(request), scope, request, timeout, work)
    except NeedsMediaLane as e:
        assert scope is not None  # only a scope's ``decoding`` raises it
        scope.to_media_lane(e.pixels)
        return await _run("media", scope, request, timeout, work)


async def _run(
    lane: str,
    scope: MediaScope | None,
    request: Request | None,
    timeout: float,
    work: Callable[[], T],
) -> T:
    """``work()`` on ``lane``'s pool in ``scope``, as ``prepare`` says. The scope is given
    back by the worker when the work ends, or here when it is dropped before it ran."""
    loop = asyncio.get_running_loop()
    remaining = _deadline(request, loop, timeout) - loop.time()
    if remaining <= 0:  # an earlier hand-off of the request used up its time
        if scope is not None:
            scope.release()
        raise _timed_out(timeout)
    flag = CancelFlag()
    # the scope outermost: its release runs even when the flag stops the work unstarted
    cf = pool(lane).submit(run_in, scope, run_with, flag, work, ())
    fut = asyncio.wrap_future(cf)
    fut.add_done_callback(_retrieve)
    gone: asyncio.Future[None] = loop.create_future()
    watchers: list[asyncio.Task[None]] = []

    def watch(req: Request) -> None:
        watchers.append(asyncio.create_task(_until_gone(req, gone)))

    timer = loop.call_later(WATCH_AFTER_S, watch, request) if request is not None else None
    either: set[asyncio.Future[T] | asyncio.Future[None]] = {fut, gone}
    try:
        done, _ = await asyncio.wait(
            either, timeout=max(0.0, remaining), return_when="FIRST_COMPLETED"
        )
        if fut in done:
            return fut.result()
        if gone in done:
            flag.cancel("the client left")
            raise APIError(499, "the client closed the request")
        flag.cancel("time limit")
        raise _timed_out(timeout)
    finally:
        if timer is not None:
            timer.cancel()
        for w in watchers:
            w.cancel()
        if not fut.done():  # abandoned (or this coroutine cancelled): drop or stop it
            flag.cancel(flag.reason or "abandoned")
            if cf.cancel() and scope is not None:  # dropped unrun: no worker gives it back
                scope.release()
