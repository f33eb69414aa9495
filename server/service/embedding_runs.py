"""Embedding and rerank prompts run on the engine: one ``EmbedTask`` each, their events
gathered in prompt order (the routes in server/protocols/embeddings.py shape the answers).

The routes reach the engine only through the service layer: this module submits the tasks,
waits for their events on the request's event loop, and cancels what is left when the
client leaves, the time runs out or the engine stops."""

from __future__ import annotations

import asyncio
import time

from starlette.requests import Request

from ..engine.embed import EmbedEvent, EmbedTask
from ..engine.engine import EngineDead
from ..engine.event_sink import Emitter
from ..engine_api import EmbedResult
from ..schemas.errors import APIError
from ..task import TaskError
from .sink import emitter
from .state import ServerState
from .tasks import until_disconnected


# put in a request's event queue when its client disconnected
class _ClientGone:
    """The type of CLIENT_GONE (a sentinel the type checker can tell from an event)."""


CLIENT_GONE = _ClientGone()


def _emitter(
    loop: asyncio.AbstractEventLoop, q: asyncio.Queue[EmbedEvent | _ClientGone]
) -> Emitter[EmbedEvent]:
    """A task's ``emit``: thread-safe; the engine batches deliveries per loop
    (service/sink.py)."""
    return emitter(loop, q.put_nowait)


async def run_embeddings(
    st: ServerState, prompts: list[list[int]], request: Request | None = None
) -> list[EmbedResult]:
    """Embed ``prompts`` on the engine, one task each (they share decodes with every other
    request's); results in prompt order. APIError: 503 when the queue is full or the engine
    stopped, 408 after the server's --timeout, a task's error as it comes. With ``request``,
    a client that disconnects cancels the prompts not embedded yet (within ~0.25 s); the
    answer then goes nowhere."""
    engine = st.require_engine()
    loop = asyncio.get_running_loop()
    q: asyncio.Queue[EmbedEvent | _ClientGone] = asyncio.Queue()
    emit = _emitter(loop, q)
    tasks = [EmbedTask(toks, emit, index=i) for i, toks in enumerate(prompts)]
    max_queue = st.settings.max_queue
    # a request's prompts count as one request: it is refused only behind a full queue
    if engine.queue_depth() >= max_queue + engine.n_idle_slots():
        raise APIError(
            503,
            f"the server is busy: more than {max_queue} requests are waiting",
            "unavailable_error",
            headers={"Retry-After": "1"},
        )
    out: list[EmbedResult | None] = [None] * len(tasks)
    deadline = time.monotonic() + st.settings.timeout
    watcher = None
    if request is not None:  # a disconnect ends the wait below with CLIENT_GONE
        watcher = asyncio.create_task(until_disconnected(request))
        watcher.add_done_callback(lambda _: q.put_nowait(CLIENT_GONE))
    try:
        for t in tasks:
            engine.submit(t)
        for _ in tasks:
            ev = await asyncio.wait_for(q.get(), max(0.0, deadline - time.monotonic()))
            if isinstance(ev, _ClientGone):
                raise APIError(499, "the client disconnected", "cancelled_error")
            if isinstance(ev, TaskError):
                raise APIError(ev.status, ev.message, ev.type, headers=None, **ev.extra)
            out[ev.index] = ev
    except EngineDead as e:
        raise APIError(503, str(e), "unavailable_error") from e
    except asyncio.TimeoutError:
        raise APIError(
            408, f"the request timed out after {st.settings.timeout:g} s", "timeout_error"
        ) from None
    finally:
        if watcher is not None:
            watcher.cancel()
        for t in tasks:
            t.cancel()  # those still waiting are dropped; finished ones ignore it
    return [r for r in out if r is not None]
