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
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("server.cache.kv_publisher")

QUEUE_MAX = 4096  # batches waiting for the sender
SNDHWM = 100_000  # ZMQ messages buffered per subscriber
SETTLE_S = 0.3  # after bind: subscribers already dialling connect before the first send


def encode(seq: int, ts: float, events: list[Any], dp_rank: int = 0) -> tuple[bytes, bytes]:
    """The sequence and payload frames of one batch."""
    import msgpack

    return seq.to_bytes(8, "big"), msgpack.packb([ts, events, dp_rank], use_bin_type=True)


class KVPublisher:
    """``endpoint``: a ZMQ address to bind (``tcp://*:5557``); ``sender``: replaces the ZMQ
    socket (tests), called with the three frames."""

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
        self.settle_s = settle_s
        self._q: queue.Queue[tuple[int, float, list[Any]] | None] = queue.Queue(max_queue)
        self._seq_lock = threading.Lock()
        self.seq = -1  # the last number given (the first batch is 0)
        self.sent = 0
        self.dropped = 0  # batches dropped: queue full, or ZMQ's high-water mark
        self._sender = sender
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self.error: str = ""

    def publish(self, events: list[Any]) -> None:
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
        send, sock, ctx = self._sender, None, None
        try:
            if send is None:
                sock, ctx = self._bind()
                send = self._zmq_send(sock)
        except Exception as e:  # a bad address, a port in use
            self.error = str(e)
            self._ready.set()
            return
        self._ready.set()
        time.sleep(self.settle_s)
        try:
            self._loop(send)
        finally:
            if sock is not None:
                sock.close(linger=500)
            if ctx is not None:
                ctx.term()

    def _loop(self, send: Callable[[list[bytes]], bool]) -> None:
        while True:
            item = self._q.get()
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

    def _bind(self) -> tuple[Any, Any]:
        import zmq

        ctx = zmq.Context()
        sock = ctx.socket(zmq.PUB)
        sock.setsockopt(zmq.SNDHWM, SNDHWM)
        sock.bind(self.endpoint)
        return sock, ctx

    @staticmethod
    def _zmq_send(sock: Any) -> Callable[[list[bytes]], bool]:
        import zmq

        def send(frames: list[bytes]) -> bool:
            try:
                sock.send_multipart(frames, flags=zmq.NOBLOCK)
                return True
            except zmq.Again:
                return False

        return send
