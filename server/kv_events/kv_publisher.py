"""The KV-event publisher: vLLM's ZMQ PUB wire format, off the engine thread.

Each message is three frames: the topic (``kv@<host>@<model>`` by default), the batch's
sequence number (8 bytes, big-endian, one more than the last batch's) and the msgpack payload
``[ts, [event, ...], dp_rank]`` (vLLM's ``KVEventBatch`` as msgspec ``array_like`` encodes
it; llm-d's subscriber decodes exactly that).

``publish`` (any thread) numbers a batch and puts it on a bounded queue without waiting; a
full queue drops the batch, counted in ``dropped``. The sequence number was taken all the
same, so a subscriber sees the gap. A sender thread encodes the batches and sends them with
NOBLOCK; ZMQ's own high-water mark drops what a slow subscriber cannot take (counted too).
pyzmq and msgpack are imported by the sender only: a server without --kv-events-endpoint
never loads them.

What a subscriber sends is bounded (issue 40): libzmq keeps every subscription a peer sends
until it leaves, so one peer could grow the server without bound. The socket is an XPUB:
an inbound message (a subscription) over ``MAXMSGSIZE`` bytes disconnects its peer, and the
sender thread reads libzmq's notices of each prefix subscribed or no longer subscribed by
anyone, so it knows how many distinct subscriptions are held. Over ``MAX_SUBSCRIPTIONS`` (a
real subscriber needs one; only prefixes of the topic match at all) the socket is closed and
bound again: every peer is dropped and its subscriptions freed; real subscribers reconnect
by themselves and see the gap in the sequence numbers.

Where it binds (``endpoint_problem``): the loopback, an ``ipc://`` or ``inproc://`` address;
a wildcard or any other interface only when the operator confirms it
(``--kv-events-allow-remote``): the events carry what the prompts hold.
"""

from __future__ import annotations

import ipaddress
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from .kv_blocks import Event

if TYPE_CHECKING:  # imported by the sender thread only (see above)
    import zmq

    ZmqContext = zmq.Context[zmq.Socket[bytes]]

log = logging.getLogger("server.kv_events.kv_publisher")

QUEUE_MAX = 4096  # batches waiting for the sender
SNDHWM = 100_000  # ZMQ messages buffered per subscriber
SETTLE_S = 0.3  # after bind: subscribers already dialling connect before the first send
MAX_SUBSCRIPTIONS = 64  # distinct subscribed prefixes held before the socket is reset
POLL_S = 0.05  # how often an idle sender reads the subscription notices
LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1")


def normalize_endpoint(value: str) -> str:
    """``--kv-events-endpoint``: a bare port binds the loopback (``tcp://127.0.0.1:PORT``);
    anything else is a ZMQ address, as given."""
    return f"tcp://127.0.0.1:{value}" if value.isdigit() else value


def endpoint_problem(endpoint: str) -> str:
    """Why binding ``endpoint`` would expose the events beyond this machine ("" when it
    does not): a wildcard (``tcp://*``, ``0.0.0.0``, ``[::]``), a non-loopback address, a
    host or interface name other than ``localhost``."""
    transport, sep, rest = endpoint.partition("://")
    if not sep or transport in ("ipc", "inproc"):
        return ""
    host = rest.rsplit(":", 1)[0] if ":" in rest else rest
    host = host.strip("[]")
    if host in LOCAL_HOSTS:
        return ""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        what = "every interface" if host == "*" else f"the interface or host {host!r}"
    else:
        if ip.is_loopback:
            return ""
        what = "every interface" if ip.is_unspecified else f"the non-loopback address {host}"
    return (
        f"{endpoint} binds {what}: anyone who can reach it reads the prompts' block hashes"
        " and, unless withheld, their token ids; bind the loopback (tcp://127.0.0.1:PORT),"
        " or confirm with --kv-events-allow-remote (README: Scaling out on llm-d)"
    )


def encode(seq: int, ts: float, events: list[Event], dp_rank: int = 0) -> tuple[bytes, bytes]:
    """The sequence and payload frames of one batch."""
    import msgpack

    return seq.to_bytes(8, "big"), msgpack.packb([ts, events, dp_rank], use_bin_type=True)


class KVPublisher:
    """``endpoint``: a ZMQ address to bind (``tcp://127.0.0.1:5557``; ``endpoint_problem``
    is checked by the caller); ``sender``: replaces the ZMQ socket (tests), called with the
    three frames."""

    _sock: zmq.Socket[bytes]  # the XPUB: bound by the sender thread (``_run``) before any use

    def __init__(
        self,
        endpoint: str,
        topic: str,
        *,
        max_queue: int = QUEUE_MAX,
        settle_s: float = SETTLE_S,
        sender: Callable[[list[bytes]], bool] | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.topic = topic.encode("utf-8")
        # a subscription is 1 byte + a prefix; none longer than the topic can match
        self.max_msg = max(256, len(self.topic) + 1)
        self.settle_s = settle_s
        self._q: queue.Queue[tuple[int, float, list[Event]] | None] = queue.Queue(max_queue)
        self._seq_lock = threading.Lock()
        self.seq = -1  # the last number given (the first batch is 0)
        self.sent = 0
        self.dropped = 0  # batches dropped: queue full, or ZMQ's high-water mark
        self._sender = sender
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self.error: str = ""
        self._subs: set[bytes] = set()  # distinct prefixes subscribed (libzmq's notices)
        self.resets = 0  # socket resets after too many subscriptions

    def publish(self, events: list[Event]) -> None:
        """Number and queue one batch; never blocks (a full queue drops it)."""
        with self._seq_lock:
            self.seq += 1
            item = (self.seq, time.time(), events)
            try:
                self._q.put_nowait(item)
            except queue.Full:
                self.dropped += 1

    def start(self) -> None:
        """Bind (on the sender thread) and start sending; raises when the bind fails."""
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()
        self._ready.wait(10)
        if self.error:
            raise RuntimeError(f"--kv-events-endpoint {self.endpoint}: {self.error}")

    def close(self, timeout: float = 2.0) -> None:
        """Send what is queued (for at most ``timeout`` seconds), then stop."""
        if self._thread is None:
            return
        try:
            self._q.put(None, timeout=timeout)
        except queue.Full:
            pass
        self._thread.join(timeout)

    def _run(self) -> None:
        send = self._sender
        ctx: ZmqContext | None = None
        try:
            if send is None:
                import zmq

                ctx = zmq.Context()
                self._sock = self._bind(ctx)
                send = self._zmq_send
        except Exception as e:  # a bad address, a port in use
            self.error = str(e)
            self._ready.set()
            return
        self._ready.set()
        deadline = time.monotonic() + self.settle_s
        while ctx is not None and time.monotonic() < deadline:
            self._read_subscriptions(ctx)
            time.sleep(min(POLL_S, self.settle_s))
        if ctx is None:
            time.sleep(self.settle_s)
        try:
            self._loop(send, ctx)
        finally:
            if ctx is not None:
                self._sock.close(linger=500)
                ctx.term()

    def _loop(self, send: Callable[[list[bytes]], bool], ctx: ZmqContext | None) -> None:
        while True:
            if ctx is not None:
                self._read_subscriptions(ctx)
            try:
                item = self._q.get(timeout=POLL_S)
            except queue.Empty:
                continue
            if item is None:
                return
            seq, ts, events = item
            try:
                seq_b, payload = encode(seq, ts, events)
                ok = send([self.topic, seq_b, payload])
            except Exception:
                log.exception("kv events: could not send batch %d", seq)
                ok = False
            if ok:
                self.sent += 1
            else:
                self.dropped += 1

    def _read_subscriptions(self, ctx: ZmqContext) -> None:
        """Track the distinct subscribed prefixes from the XPUB's notices (``\\x01`` +
        prefix: first subscribed; ``\\x00`` + prefix: no longer subscribed by anyone); over
        ``MAX_SUBSCRIPTIONS``, reset the socket."""
        import zmq

        while True:
            try:
                msg = self._sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            if msg[:1] == b"\x01":
                self._subs.add(msg[1:])
            elif msg[:1] == b"\x00":
                self._subs.discard(msg[1:])
            if len(self._subs) > MAX_SUBSCRIPTIONS:
                self._reset(ctx)
                return

    def _reset(self, ctx: ZmqContext) -> None:
        """Close the socket (dropping every peer and what libzmq holds for it) and bind
        again; while the port is not free yet, retry for a few seconds."""
        log.warning(
            "kv events: over %d distinct subscriptions on %s; dropping every subscriber",
            MAX_SUBSCRIPTIONS,
            self.endpoint,
        )
        self.resets += 1
        self._subs.clear()
        self._sock.close(linger=0)
        for _ in range(100):
            try:
                self._sock = self._bind(ctx)
                return
            except Exception:
                time.sleep(0.05)
        self._sock = self._bind(ctx)  # still refused: the sender stops with the error

    def _bind(self, ctx: ZmqContext) -> zmq.Socket[bytes]:
        """An XPUB bound to the endpoint: inbound messages (subscriptions) capped at
        ``MAXMSGSIZE``: a longer one drops its peer."""
        import zmq

        sock = ctx.socket(zmq.XPUB)
        sock.setsockopt(zmq.SNDHWM, SNDHWM)
        sock.setsockopt(zmq.RCVHWM, 1000)
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_msg)
        try:
            sock.bind(self.endpoint)
        except Exception:
            sock.close(linger=0)
            raise
        return sock

    def _zmq_send(self, frames: list[bytes]) -> bool:
        import zmq

        try:
            self._sock.send_multipart(frames, flags=zmq.NOBLOCK)
            return True
        except zmq.Again:
            return False
