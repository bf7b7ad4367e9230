"""The gateway's HTTP listening socket (opens a port, so not a unit test)."""

from __future__ import annotations

import socket

from services.gateway.http_server import _bind


def test_http_sockets_say_tcp_so_asyncio_disables_nagle() -> None:
    """With proto 0, asyncio leaves Nagle on and keep-alive responses wait ~40 ms for delayed ACKs."""
    listener = _bind("127.0.0.1", 0)
    with listener, socket.create_connection(listener.getsockname()[:2], timeout=5):
        accepted, _ = listener.accept()
        with accepted:
            assert accepted.proto == socket.IPPROTO_TCP
