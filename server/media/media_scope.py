"""A request's image work (issue 56): whose caches it may read, how many pixels it may
decode, and on which lane it runs.

A ``MediaScope`` is made per hand-off of a request's preparation (server.service.pools) by
whoever knows the request: ``service.submit`` and ``protocols.common.prep``. The worker runs
inside it (``run_in``); the image code reads it with ``current()``:

- **Tenant.** Image caches (the projector's embedding cache and its bytes-to-identity map,
  the recently decoded base64 texts) are keyed by the request's tenant, as the text caches
  are (server/tiers/tenancy.py): under ``--cache-isolation`` one tenant's image never
  makes another's request faster or moves a counter for it.
- **Pixels per request.** Each image's width x height, read from its header before any
  decoder runs (server/media/image_inputs.py), is charged against ``request_pixels``
  (--image-max-request-pixels): past it, 413 before a byte is decoded. stb_image decodes a
  GIF's first frame only, onto its whole logical screen: a 35-byte GIF declaring 8192x4096
  takes 0.5 s to decode on 2 idle cores (1.25 s loaded), so neither bytes nor files count.
- **Pixels per API key in flight.** Before its images are decoded, a request holds its
  charge against its key's budget (``key_pixels``, --image-max-key-pixels) until its
  preparation ends, queueing included: past it, 429 with ``Retry-After``.
- **Its own lane.** Decoding runs on the media lane only (``decoding``): on a text lane it
  raises ``NeedsMediaLane`` and the pools run the preparation again on the media lane (what
  ran before is cheap: checks of headers, rendering; compiled constraints are cached), so
  a text-only chat never waits behind images.

Outside a scope (unit tests calling the functions directly) nothing is charged or moved.
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from ..schemas.errors import APIError

T = TypeVar("T")

IMAGE_PIXELS = 1 << 25  # --image-max-pixels' default
REQUEST_IMAGES = 4  # --image-max-request-pixels' default: this many images at the limit
KEY_REQUESTS = 2  # --image-max-key-pixels' default: this many requests at their limit


def request_pixels(max_pixels: int, given: int = 0) -> int:
    """--image-max-request-pixels: ``given``, or (0) ``REQUEST_IMAGES`` images at the
    per-image limit ``max_pixels``."""
    return given if given > 0 else REQUEST_IMAGES * max_pixels


def key_pixels(per_request: int, given: int = 0) -> int:
    """--image-max-key-pixels: ``given``, or (0) ``KEY_REQUESTS`` requests at their limit."""
    return given if given > 0 else KEY_REQUESTS * per_request


class NeedsMediaLane(Exception):
    """Raised where a request's images are about to be decoded on a text lane: the pools
    run its preparation again on the media lane, holding ``pixels`` of its key's budget
    for it from then on."""

    def __init__(self, pixels: int) -> None:
        super().__init__("image decoding moves to the media lane")
        self.pixels = pixels


class InFlight:
    """Image pixels held per API key by requests being prepared. Thread-safe: held on the
    event loop, given back by workers."""

    def __init__(self) -> None:
        self._held: dict[str, int] = {}
        self._lock = threading.Lock()

    def take(self, key: str, n: int, limit: int) -> None:
        """Hold ``n`` more pixels for ``key``; APIError 429 (nothing held) when that would
        pass ``limit``."""
        with self._lock:
            now = self._held.get(key, 0)
            if now + n > limit:
                msg = (
                    f"this API key's requests are decoding {now} image pixels; this one's "
                    f"{n} more would pass {limit} (--image-max-key-pixels): retry later"
                )
                raise APIError(429, msg, "rate_limit_error", headers={"Retry-After": "1"})
            self._held[key] = now + n

    def give(self, key: str, n: int) -> None:
        """Give back ``n`` of the pixels ``key`` holds."""
        with self._lock:
            left = self._held.get(key, 0) - n
            if left > 0:
                self._held[key] = left
            else:
                self._held.pop(key, None)

    def held(self, key: str) -> int:
        with self._lock:
            return self._held.get(key, 0)


IN_FLIGHT = InFlight()  # the process's


@dataclass
class MediaScope:
    """One hand-off's image work (see the module doc). Used by one thread at a time: the
    worker while it runs, the event loop between runs."""

    tenant: str = ""  # the request's tenant (server.service.state.tenant_of)
    key: str = ""  # its API key's digest ("" without --api-key): whose in-flight budget
    request_pixels: int = REQUEST_IMAGES * IMAGE_PIXELS
    key_pixels: int = KEY_REQUESTS * REQUEST_IMAGES * IMAGE_PIXELS
    in_flight: InFlight = field(default=IN_FLIGHT, repr=False)
    on_media_lane: bool = False
    charged: int = 0  # pixels of this run's images, read from their headers
    held: int = 0  # pixels held in ``in_flight`` for this request
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def cache_scope(self) -> bytes:
        """The tenant as the image caches key by it (``b""``: shared by everyone)."""
        return self.tenant.encode("utf-8", "surrogatepass")

    def charge(self, pixels: int, where: str) -> None:
        """Count an image of ``pixels`` (its header's width x height) before it is decoded;
        APIError 413 when the request's images would pass ``request_pixels``."""
        if self.charged + pixels > self.request_pixels:
            raise APIError(
                413,
                f"{where}: the request's images would be {self.charged + pixels} pixels, "
                f"more than {self.request_pixels} (--image-max-request-pixels)",
                "request_too_large",
            )
        self.charged += pixels

    def decoding(self) -> None:
        """Called right before this run's images are decoded: on a text lane raises
        ``NeedsMediaLane``; on the media lane holds what was charged beyond what is held
        (APIError 429 past the key's budget)."""
        if not self.on_media_lane:
            raise NeedsMediaLane(self.charged)
        self.hold(self.charged - self.held)

    def hold(self, n: int) -> None:
        """Hold ``n`` more pixels of the key's budget for this request (429 past it)."""
        if n <= 0:
            return
        with self._lock:
            self.in_flight.take(self.key, n, self.key_pixels)
            self.held += n

    def to_media_lane(self, pixels: int) -> None:
        """Before the run on the media lane: hold ``pixels`` (what the text lane's run
        charged; 429 past the key's budget) while it waits and runs; it charges anew."""
        self.on_media_lane = True
        self.charged = 0
        self.hold(pixels)

    def release(self) -> None:
        """Give back what this request holds (idempotent): when its preparation ends."""
        with self._lock:
            n, self.held = self.held, 0
        if n:
            self.in_flight.give(self.key, n)


_SCOPE: contextvars.ContextVar[MediaScope | None] = contextvars.ContextVar(
    "media_scope", default=None
)


def current() -> MediaScope | None:
    """The scope the running preparation is in (None outside one)."""
    return _SCOPE.get()


def run_in(scope: MediaScope | None, fn: Callable[..., T], *args: object) -> T:
    """``fn(*args)`` in ``scope`` (this thread's ``current()``); whatever the request holds
    is given back when it returns or raises (a run that moves to the media lane holds
    nothing yet)."""
    if scope is None:
        return fn(*args)
    token = _SCOPE.set(scope)
    try:
        return fn(*args)
    finally:
        _SCOPE.reset(token)
        scope.release()
