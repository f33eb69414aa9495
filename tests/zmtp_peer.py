"""A raw ZMTP 3.0 peer (plain TCP, NULL mechanism) that says it is a SUB socket and sends
whatever subscription frames a test wants: what a hostile subscriber of the KV events can
send that pyzmq's SUB socket would not (issue 40)."""

from __future__ import annotations

import socket
import struct


def connect(port: int, host: str = "127.0.0.1") -> socket.socket:
    """Connected, greeted and READY, step by step as the spec orders it (libzmq refused a
    peer that sent its whole greeting, READY and a message in one go now and then)."""
    s = socket.create_connection((host, port), timeout=5)
    s.sendall(b"\xff" + b"\x00" * 8 + b"\x7f")  # the signature
    _read(s, 10)
    s.sendall(b"\x03\x00" + b"NULL".ljust(20, b"\x00") + b"\x00" * 32)  # as-server 0, filler
    _read(s, 54)
    body = b"\x05READY" + b"\x0bSocket-Type" + struct.pack(">I", 3) + b"SUB"
    s.sendall(b"\x04" + bytes([len(body)]) + body)
    _flags, size = _read(s, 2)  # the server's READY (a short command frame)
    _read(s, size)
    return s


def _read(s: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        got = s.recv(n - len(out))
        if not got:
            raise ConnectionError("the server hung up during the handshake")
        out += got
    return out


def frame(data: bytes) -> bytes:
    """One message frame (short or long form)."""
    if len(data) < 256:
        return b"\x00" + bytes([len(data)]) + data
    return b"\x02" + struct.pack(">Q", len(data)) + data


def subscribe(prefix: bytes) -> bytes:
    """A ZMTP 3.0 subscription message (``\\x01`` + prefix) as one frame."""
    return frame(b"\x01" + prefix)


def closed(s: socket.socket, timeout: float = 5) -> bool:
    """Whether the server hangs up on the peer (EOF or a reset) within ``timeout``."""
    s.settimeout(timeout)
    try:
        while s.recv(65536):
            pass
        return True
    except TimeoutError:
        return False
    except OSError:  # reset by the server
        return True


def send_quietly(s: socket.socket, data: bytes) -> bool:
    """``sendall``; False when the server already hung up."""
    try:
        s.sendall(data)
        return True
    except OSError:
        return False
