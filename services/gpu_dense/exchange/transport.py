"""The transport between gpu_dense and its exchange workers: the arenas, the control socket, the
slots' own sockets. Imports no gRPC.

The dense process puts a layer's q, k, v in a shared-memory arena (fastdecode/dense/handoff.py: a
`Staging` the step runner fills, or an arena per (worker, slot) the plane copies items into:
`ArenaPool`), sends a small descriptor, and reads each o out of the same arena when the worker says
it is there. Tensors never cross a socket: a frame is a 4-byte length and a control message
(exchange.proto, encoded by messages.py, so the native worker reads it too). Arenas are reused; one
that is too small is replaced by a bigger one under a new name, which the worker maps when it first
sees it (`Attached`, the worker's side). The control socket is read by a `Channel` on the event
loop; each slot also has a `Port`, a socket its layer thread uses blocking.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import struct
from collections.abc import Callable
from typing import Any

from fastdecode.dense.handoff import Arena, aligned
from fastdecode.runtime.errors import InvalidInput

log = logging.getLogger("fastdecode.gpu_dense.exchange")
_LEN = struct.Struct("<I")
MAX_FRAME = 64 << 20  # descriptors are small; anything bigger is a bug in the peer


class ArenaPool:
    """The dense side's arenas, one per key (worker, slot), replaced by a bigger one on demand."""

    def __init__(self) -> None:
        self._arenas: dict[Any, Arena] = {}

    def get(self, key: Any, size: int) -> Arena:
        arena = self._arenas.get(key)
        if arena is None or arena.size < size:
            if arena is not None:
                arena.close()  # the worker still maps it until it sees the new name; unlink is safe
            arena = self._arenas[key] = Arena(aligned(size + size // 2))
        return arena

    def close(self) -> None:
        for arena in self._arenas.values():
            arena.close()
        self._arenas.clear()


class Attached:
    """The worker's side: arenas attached by name, the previous one of a key closed on a new name."""

    def __init__(self) -> None:
        self._by_name: dict[str, Arena] = {}

    def get(self, name: str) -> Arena:
        arena = self._by_name.get(name)
        if arena is None:
            arena = self._by_name[name] = Arena(name=name)
        return arena

    def forget(self, name: str) -> None:
        arena = self._by_name.pop(name, None)
        if arena is not None:
            arena.close()

    def close(self) -> None:
        for arena in self._by_name.values():
            arena.close()
        self._by_name.clear()


def frame(body: bytes) -> bytes:
    """One control message on the socket: a 4-byte little-endian length, then the message's bytes
    (messages.py encodes them; never tensors)."""
    return _LEN.pack(len(body)) + body


class Channel(asyncio.Protocol):
    """A control socket's frames, each handed to `on_message` right from the loop's read callback: no
    reader task and no coroutine hop per message (a layer's answer wakes only the layer's waiter).
    `closed` resolves when the peer goes, or when a frame is garbled (the channel is then closed)."""

    def __init__(self, on_message: Callable[[bytes], None]) -> None:
        self.on_message = on_message
        self.transport: asyncio.Transport | None = None
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._buf = bytearray()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        buf = self._buf
        buf += data
        pos = 0
        try:
            while len(buf) - pos >= _LEN.size:
                (n,) = _LEN.unpack_from(buf, pos)
                if n > MAX_FRAME:
                    raise InvalidInput(f"control frame of {n} bytes")
                if len(buf) - pos - _LEN.size < n:
                    break
                start = pos + _LEN.size
                pos = start + n
                self.on_message(bytes(buf[start:pos]))
        except Exception:  # a garbled channel is a dead peer
            log.exception("bad control message: closing the channel")
            self.close()
            return
        del buf[:pos]

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed.done():
            self.closed.set_result(None)

    def write(self, data: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
        if not self.closed.done():
            self.closed.set_result(None)


async def open_channel(sock: socket.socket, on_message: Callable[[bytes], None]) -> Channel:
    """A Channel on a connected Unix socket."""
    loop = asyncio.get_running_loop()
    _, channel = await loop.create_unix_connection(lambda: Channel(on_message), sock=sock)
    return channel


class PortStalled(OSError):
    """A Port's send timed out: the worker read nothing for a poll while its socket stayed full."""


class Port:
    """A slot's own socket to a worker, used blocking from the slot's layer thread (the step runner's
    threaded layer loop, fastdecode/dense/layer_loop.py): a layer is one send and one read of its answer,
    with no event loop between them. Reads wake every `poll` seconds so that the caller can check
    for a cancelled step and a stalled worker."""

    def __init__(self, sock: socket.socket, poll: float = 0.25) -> None:
        self.sock = sock
        sock.settimeout(poll)
        self._buf = bytearray()

    def send(self, data: bytes) -> None:
        """The whole frame, or OSError. A send that times out (the worker read nothing for a poll
        while its socket stayed full) may have written part of the frame: the socket is closed then,
        so that no later frame can be read from the middle of this one (the caller restarts the
        worker)."""
        try:
            self.sock.sendall(data)
        except TimeoutError:
            self.close()
            raise PortStalled("stopped reading its layer socket") from None

    def read(self, keep_waiting: Callable[[], bool]) -> bytes | None:
        """The next frame's body; None when `keep_waiting()` says stop (asked at each poll).
        OSError (EOF included) when the peer is gone or the frame is garbled."""
        buf = self._buf
        while True:
            if len(buf) >= _LEN.size:
                (n,) = _LEN.unpack_from(buf)
                if n > MAX_FRAME:
                    raise OSError(f"control frame of {n} bytes")
                end = _LEN.size + n
                if len(buf) >= end:
                    body = bytes(buf[_LEN.size : end])
                    del buf[:end]
                    return body
            try:
                data = self.sock.recv(1 << 16)
            except TimeoutError:
                if not keep_waiting():
                    return None
                continue
            if not data:
                raise OSError("the worker closed its layer socket")
            buf += data

    def close(self) -> None:
        with contextlib.suppress(OSError):  # wakes a thread blocked on it
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
