"""The listening sockets this server makes itself (uvicorn makes one for a single host)."""

from __future__ import annotations

import socket


def bind(hosts: list[str], port: int, reuse_port: bool = False) -> list[socket.socket]:
    """Listening sockets for ``--host a,b`` (llama-server listens on each address);
    ``reuse_port`` (--reuse-port): SO_REUSEPORT, so several servers bind the same port and
    the kernel spreads connections over them."""
    socks = []
    for host in hosts:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind((host.strip("[]"), port))
        sock.listen(2048)
        socks.append(sock)
    return socks
