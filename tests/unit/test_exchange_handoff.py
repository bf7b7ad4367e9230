"""The shared-memory handoff of the exchange workers (fastdecode/dense/handoff.py, and its transport:
services/gpu_dense/exchange/transport.py): tensors go in and out bit for bit in every dtype it
carries, out-of-range slices are refused, a small arena is replaced by a bigger one under a new name,
the peer attaches by name, control frames round-trip."""

from __future__ import annotations

import asyncio
import socket

import pytest
import torch

from fastdecode.dense.handoff import ALIGN, Arena, Slice, aligned
from fastdecode.runtime.errors import InvalidInput
from services.gpu_dense.exchange.transport import ArenaPool, Attached, Channel, Port, PortStalled, frame


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_tensors_round_trip_through_an_arena(dtype: torch.dtype) -> None:
    arena = Arena(1 << 20)
    try:
        q = torch.randn(5, 3, 8).to(dtype)
        k = torch.randn(5, 1, 8).to(dtype)
        sq = arena.put(0, q)
        sk = arena.put(aligned(q.nbytes), k[:, :, :])
        assert sq.offset == 0 and sk.offset % ALIGN == 0 and sq.shape == (5, 3, 8)
        assert torch.equal(arena.take(sq), q) and torch.equal(arena.take(sk), k)
        assert torch.equal(arena.view(sk), k)
        # a non-contiguous tensor goes in as its values, C-contiguous
        t = torch.randn(8, 6).to(dtype).t()
        st = arena.put(4096, t)
        assert torch.equal(arena.take(st), t)
        # take copies: writing the arena afterwards leaves the taken tensor alone
        taken = arena.take(sq)
        arena.put(0, torch.zeros_like(q))
        assert torch.equal(taken, q)
        del taken
    finally:
        arena.close()


def test_empty_tensors_and_bad_slices() -> None:
    arena = Arena(256)
    try:
        s = arena.put(0, torch.empty(0, 3, 4))
        assert arena.take(s).shape == (0, 3, 4)
        with pytest.raises(InvalidInput, match="outside"):
            arena.put(200, torch.zeros(32))
        with pytest.raises(InvalidInput, match="outside"):
            arena.view(Slice(128, (64,), "float32"))
        with pytest.raises(InvalidInput, match="cannot go through"):
            arena.put(0, torch.zeros(2, dtype=torch.int64))
    finally:
        arena.close()


def test_pool_replaces_a_small_arena_and_the_peer_follows_by_name() -> None:
    pool = ArenaPool()
    peer = Attached()
    try:
        a = pool.get(("w0", 0), 1000)
        assert pool.get(("w0", 0), 1000) is a  # reused, not reallocated
        assert pool.get(("w0", 1), 10) is not a  # one arena per (worker, slot)
        x = torch.arange(100, dtype=torch.float32)
        s = a.put(0, x)
        seen = peer.get(a.name)
        assert torch.equal(seen.take(s), x)  # the peer sees the owner's bytes
        seen.put(512, x * 2)
        assert torch.equal(a.take(Slice(512, (100,), "float32")), x * 2)  # and the other way
        name = a.name
        b = pool.get(("w0", 0), 1 << 20)  # too small: a bigger one under a new name
        assert b.name != name and b.size >= 1 << 20
        peer.forget(name)
        assert torch.equal(peer.get(b.name).take(b.put(0, x)), x)
    finally:
        peer.close()
        pool.close()


def test_frames_round_trip_split_anywhere_and_end_cleanly() -> None:
    async def run() -> None:
        got: list[bytes] = []
        channel = Channel(got.append)
        msgs = [b"attend" * 300, b"", b"ready"]
        data = b"".join(frame(m) for m in msgs) + frame(b"done")[:5]  # the peer died mid-frame
        for i in range(0, len(data), 7):  # the bytes arrive in arbitrary pieces
            channel.data_received(data[i : i + 7])
        channel.connection_lost(None)
        assert got == msgs
        assert channel.closed.done()

    asyncio.run(run())


def test_a_garbled_frame_closes_the_channel() -> None:
    async def run() -> None:
        got: list[bytes] = []
        channel = Channel(got.append)
        channel.data_received(frame(b"ready") + (2**31).to_bytes(4, "little") + b"xx")  # over MAX_FRAME
        assert got == [b"ready"]
        assert channel.closed.done()

        def refuse(body: bytes) -> None:
            raise ValueError("not a message")

        bad = Channel(refuse)
        bad.data_received(frame(b"abc"))  # the receiver cannot read it
        assert bad.closed.done()

    asyncio.run(run())


def test_a_port_reads_whole_frames_and_closes_on_a_send_that_times_out() -> None:
    """A send the peer never reads times out with part of a frame written: the port closes, so the
    peer reads that part and then the end of the stream, never a frame made of the middle of one."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    port = Port(ours, poll=0.05)
    theirs.sendall(frame(b"done") + frame(b"x" * 100_000)[:9])  # one frame, then part of the next
    assert port.read(lambda: True) == b"done"
    assert port.read(lambda: False) is None  # the rest never comes: the caller stops waiting
    with pytest.raises(PortStalled, match="stopped reading"):
        for _ in range(1000):  # the peer reads nothing: its buffer fills
            port.send(frame(b"a" * 65536))
    assert ours.fileno() == -1
    theirs.settimeout(5)
    seen = b""
    while chunk := theirs.recv(1 << 20):  # ends (b"") once the port closed: no timeout
        seen += chunk
    whole = frame(b"a" * 65536)
    assert seen and seen[: len(seen) // len(whole) * len(whole)] == whole * (len(seen) // len(whole))
    theirs.close()
