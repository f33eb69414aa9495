"""Resumable streams (llama-server's ``tools/server/server-stream.cpp``): a streamed answer
whose request named it with ``X-Conversation-Id`` is generated into a bounded replay buffer,
not into its HTTP response. Its client reads the buffer live; a client that reloads or lost
its connection reads it again (``GET /v1/stream?conv_id=&from=``), from the start or from
where it was, and then live to the end. The generation goes on while nobody reads.

Contracts:

- One session per (owner, conversation id); a new named request replaces (and stops) the
  previous one. ``owner`` is the caller's API key digest ("" without keys): no caller
  reaches another key's sessions, not even by naming their ids.
- The buffer holds whole SSE events (frames ending in a blank line) in order; the oldest go
  first when it holds more than ``max_bytes`` or ``max_events`` (the newest is always kept).
  ``from`` is a byte offset into everything the stream ever wrote (llama-server's), and
  ``from_event`` an event index: a position already dropped is lost (400).
- Expiry: a session nobody reads for ``ttl`` seconds is dropped; if it still generates,
  its generation is stopped first (so a stream whose client never came back frees its
  slot). DELETE stops and drops it at once.
- Bounded: ids (``valid_id``), sessions per owner and in all: an open beyond them first
  drops the oldest finished session; it is a 429 only when that many sessions are
  *generating*. A session generates once one of its tasks reached a slot: one still
  queued for a slot holds no quota (the engine's --max-queue bounds those), so a busy
  server queues a named request as it queues any other. The per-owner bound applies only
  where owners are told apart (``StreamLimits.keyed``: two or more API keys); without
  keys, or with one, every client is the same owner and only the bound in all applies (a
  per-owner bound would let one client's streams refuse everyone else's).

Everything here runs on the event loop: no locks.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, NoReturn

from ..json_value import JsonObject
from ..schemas.errors import APIError
from ..schemas.stream_ids import HEADER, check_id, owner_of

if TYPE_CHECKING:
    from .tasks import TaskGroup

log = logging.getLogger("server.streams")


@dataclass(frozen=True)
class StreamLimits:
    """The flags' bounds (``--stream-*``). ``max_streams`` 0 turns the feature off."""

    ttl: float = 300.0
    max_bytes: int = 4 * 1024 * 1024
    max_events: int = 32768
    max_streams: int = 64
    per_owner: int = 16
    keyed: bool = True  # owners are told apart (2+ API keys): ``per_owner`` applies


@dataclass
class StreamStats:
    """Counters for /metrics (``llamaslot_streams_*``)."""

    opened: int = 0
    replays: int = 0
    stopped: int = 0  # by DELETE or a replacing request
    expired: int = 0  # dropped unread after the ttl
    expired_running: int = 0  # of those, still generating: their generation was stopped
    refused: int = 0  # 429: every session of the owner (or in all) still generating
    events_dropped: int = 0  # left the front of a full buffer


class StreamSession:
    """One named stream: its buffer, whether it ended, who reads it."""

    def __init__(
        self,
        conv_id: str,
        owner: str,
        limits: StreamLimits,
        started: Callable[[], bool] = lambda: True,
    ) -> None:
        self.conv_id = conv_id
        self.owner = owner
        self.limits = limits
        self.reached_slot = started  # whether its generation left the queue for a slot
        self.began = False  # ``reached_slot()`` once said True (it stays so)
        self.started = time.time()
        self.completed = 0.0  # time.time() when it ended, 0 while it generates
        self.events: list[bytes] = []  # buffered frames, from index ``head`` on
        self.starts: list[int] = []  # each frame's byte offset in the whole stream
        self.head = 0  # frames of ``events`` dropped (kept in place until compaction)
        self.first_event = 0  # stream index of events[head]
        self.total_bytes = 0
        self.total_events = 0
        self.buffered = 0  # bytes held
        self.readers = 0
        self.producer: asyncio.Task[None] | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.waiters: list[asyncio.Future[None]] = []

    @property
    def done(self) -> bool:
        return self.completed > 0

    def generating(self) -> bool:
        """Whether it holds quota: not ended, and its generation left the queue."""
        if self.done:
            return False
        if not self.began:
            self.began = self.reached_slot()
        return self.began

    def append(self, text: str) -> int:
        """Buffer ``text`` (one or more whole SSE frames); returns the frames dropped."""
        data = text.encode()
        frames = data.split(b"\n\n")
        tail = frames.pop()  # b"" after a final blank line; else an unterminated piece
        for f in frames:
            self._push(f + b"\n\n")
        if tail:
            self._push(tail)
        dropped = self._trim()
        self._wake()
        return dropped

    def _push(self, frame: bytes) -> None:
        self.events.append(frame)
        self.starts.append(self.total_bytes)
        self.total_bytes += len(frame)
        self.total_events += 1
        self.buffered += len(frame)

    def _trim(self) -> int:
        lim, dropped = self.limits, 0
        while len(self.events) - self.head > 1 and (
            self.buffered > lim.max_bytes or len(self.events) - self.head > lim.max_events
        ):
            self.buffered -= len(self.events[self.head])
            self.head += 1
            self.first_event += 1
            dropped += 1
        if self.head > 1024 and self.head * 2 > len(self.events):  # amortized O(1)
            del self.events[: self.head], self.starts[: self.head]
            self.head = 0
        return dropped

    def finish(self) -> None:
        if not self.done:
            self.completed = time.time()
        self._wake()

    def _wake(self) -> None:
        waiters, self.waiters = self.waiters, []
        for w in waiters:
            if not w.done():
                w.set_result(None)

    async def wait(self) -> None:
        """Until the next append or the end."""
        fut = asyncio.get_running_loop().create_future()
        self.waiters.append(fut)
        await fut

    def position(self, offset: int | None, event: int | None) -> tuple[int, int]:
        """Where a reader starts: (stream event index, bytes of that event to skip), from a
        byte ``offset`` or an ``event`` index (neither: the start). APIError 400 when it is
        already dropped or beyond what the stream wrote."""
        if event is not None:
            if event > self.total_events:
                raise APIError(400, f"from_event is beyond the stream's {self.total_events} events")
            if event < self.first_event:
                raise APIError(400, "Stream offset lost, please restart")
            return event, 0
        off = offset or 0
        if off > self.total_bytes:
            raise APIError(400, f"from is beyond the stream's {self.total_bytes} bytes")
        if off == self.total_bytes:
            return self.total_events, 0
        i = bisect.bisect_right(self.starts, off, lo=self.head) - 1
        if i < self.head:
            raise APIError(400, "Stream offset lost, please restart")
        return self.first_event + i - self.head, off - self.starts[i]

    def take(self, event: int) -> bytes | None:
        """The buffered frames from stream index ``event`` on (b"" when there are none yet),
        None when ``event`` was dropped meanwhile (the reader fell a buffer behind)."""
        if event < self.first_event:
            return None
        i = self.head + event - self.first_event
        return b"".join(self.events[i:])

    def summary(self) -> JsonObject:
        """llama-server's lookup entry, plus ``total_events``."""
        return {
            "conversation_id": self.conv_id,
            "is_done": self.done,
            "total_bytes": self.total_bytes,
            "total_events": self.total_events,
            "started_at": int(self.started),
            "completed_at": int(self.completed),
        }


Bound = tuple[int, list[StreamSession]]  # a cap and the sessions it counts


class StreamRegistry:
    """The live sessions, keyed by (owner, conversation id)."""

    def __init__(self, limits: StreamLimits) -> None:
        self.limits = limits
        self.sessions: dict[tuple[str, str], StreamSession] = {}
        self.stats = StreamStats()
        # told True when a generation starts, False when it ends: a stream whose client left
        # still runs a task (the app counts it as one: no idle sleep under it)
        self.on_busy: Callable[[bool], None] = lambda busy: None

    @property
    def enabled(self) -> bool:
        return self.limits.max_streams > 0

    def buffered_bytes(self) -> int:
        return sum(s.buffered for s in self.sessions.values())

    def generating(self) -> int:
        return sum(1 for s in self.sessions.values() if not s.done)

    def open(
        self,
        owner: str,
        conv_id: str,
        source: AsyncIterator[str],
        started: Callable[[], bool] = lambda: True,
    ) -> StreamSession:
        """A new session fed by ``source`` (the route's SSE text), replacing any of the same
        key; ``started()`` says whether its generation has left the queue for a slot.
        APIError 429 when the owner, or the server, has its most sessions generating."""
        key = (owner, conv_id)
        old = self.sessions.get(key)
        if old is not None:
            self.stop(owner, conv_id)
        self._make_room(owner)
        s = StreamSession(conv_id, owner, self.limits, started)
        self.sessions[key] = s
        self.stats.opened += 1
        s.producer = asyncio.create_task(self._produce(s, source), name=f"stream-{conv_id}")
        self._arm(s)  # the requester's reader attaches at once and disarms it
        return s

    def _bounds(self) -> list[tuple[int, bool]]:
        """Each bound as (cap, counts the owner's sessions only): the owner's own (only
        where owners are told apart), then every session."""
        every = (self.limits.max_streams, False)
        return [(self.limits.per_owner, True), every] if self.limits.keyed else [every]

    def _pools(self, owner: str, skip: tuple[str, str] | None) -> list[Bound]:
        """The bounds a new session of ``owner`` must fit, each with the sessions it counts
        (all but ``skip``'s)."""
        every = [s for k, s in self.sessions.items() if k != skip]
        return [
            (cap, [s for s in every if not own or s.owner == owner]) for cap, own in self._bounds()
        ]

    def check_room(self, owner: str, conv_id: str | None) -> None:
        """APIError 429 when a new session of ``owner`` would find no room (``open``'s
        rule, without dropping anything): asked before a request's tasks are submitted.
        The session ``conv_id`` names (it would be replaced) does not count."""
        skip = (owner, conv_id) if conv_id is not None else None
        for cap, pool in self._pools(owner, skip):
            if sum(1 for s in pool if s.generating()) >= cap:
                self._refuse(cap)

    def _refuse(self, cap: int) -> NoReturn:
        self.stats.refused += 1
        raise APIError(
            429,
            f"too many resumable streams generating (at most {cap}); stop one "
            "(DELETE /v1/stream) or send the request without X-Conversation-Id",
            "rate_limit_error",
            headers={"Retry-After": "1"},
        )

    def _make_room(self, owner: str) -> None:
        """Below each bound before a new session: a 429 when a bound's generating sessions
        fill it (nothing dropped then); else the oldest finished sessions go first. Sessions
        still queued for a slot hold no quota: where they fill a bound, the new one is kept
        beyond it (the engine's --max-queue bounds them)."""
        self.check_room(owner, None)
        self._trim(owner, room=1)

    def _trim(self, owner: str, room: int) -> None:
        """Drop the oldest finished sessions until each bound (the owner's, where owners are
        told apart, then all) holds ``room`` more, or none finished is left: the buffers
        kept are those of at most ``max_streams`` sessions and the ones generating (a
        queued session's buffer stays nearly empty)."""
        for cap, own in self._bounds():
            pool = [s for s in self.sessions.values() if not own or s.owner == owner]
            finished = sorted((s for s in pool if s.done), key=lambda s: s.completed)
            for oldest in finished[: max(0, len(pool) + room - cap)]:
                self._drop(oldest)

    async def _produce(self, s: StreamSession, source: AsyncIterator[str]) -> None:
        self.on_busy(True)
        try:
            async for text in source:
                self.stats.events_dropped += s.append(text)
        except asyncio.CancelledError:
            # stopped: the cancellation went through ``source`` (an async generator), whose
            # cleanup closed its TaskGroup's batches, which cancels its tasks
            pass
        except Exception:
            log.exception("stream %s failed", s.conv_id)
        finally:
            self.on_busy(False)
            s.finish()
            if s.readers == 0 and self.sessions.get((s.owner, s.conv_id)) is s:
                self._arm(s)
            self._trim(s.owner, room=0)  # beyond the bounds (queued ones came): oldest out

    def get(self, owner: str, conv_id: str) -> StreamSession | None:
        return self.sessions.get((owner, conv_id))

    def lookup(self, owner: str, ids: list[str]) -> list[JsonObject]:
        """The owner's sessions each id names: the id itself, and llama-server's per-model
        variants ``<id>::<model>``. Never any session that was not named."""
        out = []
        for rid in dict.fromkeys(ids):
            prefix = rid + "::"
            for (o, cid), s in self.sessions.items():
                if o == owner and (cid == rid or cid.startswith(prefix)):
                    out.append(s.summary())
        return out

    def stop(self, owner: str, conv_id: str) -> bool:
        """Stop the session's generation and drop it; False when there is none."""
        s = self.sessions.get((owner, conv_id))
        if s is None:
            return False
        self.stats.stopped += 1
        self._drop(s)
        return True

    def _drop(self, s: StreamSession) -> None:
        if self.sessions.get((s.owner, s.conv_id)) is s:
            del self.sessions[(s.owner, s.conv_id)]
        if s.timer is not None:
            s.timer.cancel()
            s.timer = None
        if s.producer is not None and not s.producer.done():
            s.producer.cancel()  # closes the route's stream: its tasks are cancelled
        s.finish()  # readers drain what is buffered and end

    def attach(self, s: StreamSession) -> None:
        s.readers += 1
        if s.timer is not None:
            s.timer.cancel()
            s.timer = None

    def detach(self, s: StreamSession) -> None:
        s.readers -= 1
        if s.readers == 0 and self.sessions.get((s.owner, s.conv_id)) is s:
            self._arm(s)

    def _arm(self, s: StreamSession) -> None:
        if s.timer is not None:
            s.timer.cancel()
        s.timer = asyncio.get_running_loop().call_later(self.limits.ttl, self._expire, s)

    def _expire(self, s: StreamSession) -> None:
        s.timer = None
        if s.readers or self.sessions.get((s.owner, s.conv_id)) is not s:
            return
        self.stats.expired += 1
        if not s.done:
            self.stats.expired_running += 1
            log.info(
                "stream %s unread for %g s: stopping its generation", s.conv_id, self.limits.ttl
            )
        self._drop(s)

    async def read(self, s: StreamSession, event: int, skip: int = 0) -> AsyncIterator[bytes]:
        """The stream's bytes from (``event``, ``skip``): what is buffered, then live until it
        ends (or the reader falls a whole buffer behind). Counts as a reader meanwhile."""
        self.attach(s)
        try:
            while True:
                data = s.take(event)
                if data is None:
                    return
                if data:
                    event = s.total_events
                    yield data[skip:] if skip else data
                    skip = 0
                    continue
                if s.done:
                    return
                await s.wait()
        finally:
            self.detach(s)

    def close(self) -> None:
        """Stop every session (the server shuts down)."""
        for s in list(self.sessions.values()):
            self._drop(s)


def requested_name(registry: StreamRegistry, request: object) -> str | None:
    """The ``X-Conversation-Id`` a streamed request names, checked (400 for a bad id, 429
    when its owner or the server has no room left), before anything runs; None when it
    names none (or the feature is off)."""
    headers = getattr(request, "headers", None)
    conv_id = headers.get(HEADER) if headers is not None else None
    if conv_id is None or not registry.enabled:
        return None
    check_id(conv_id)
    registry.check_room(owner_of(request), conv_id)
    return conv_id


def group_started(group: TaskGroup) -> Callable[[], bool]:
    """Whether a task of ``group`` has left the engine's queue: a slot holds it now, or it
    sent an event (a slot took it). Read from the event loop: the engine thread writes
    these fields, and a stale read only delays the answer to the next check."""
    tasks = tuple(group.tasks)
    slots = group.engine.slots

    def started() -> bool:
        if any(t.n_sent for t in tasks):
            return True
        running = [s.task for s in slots]
        return any(r is t for r in running for t in tasks)

    return started
