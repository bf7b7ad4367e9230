"""Yardsticks for the Attend round trip: a bare gRPC bidi echo and a raw TCP echo of the same bytes.

Each server runs in its own process (as a shard does) and answers every message of `out_bytes`
with `back_bytes` bytes. The gRPC echo carries raw bytes (identity serializers, no protobuf, no
codec): what grpc.aio itself costs for one message each way on one stream. The TCP echo is the
floor of the loopback wire. `python -m fastdecode.benchmarks.echo {grpc,tcp} OUT BACK PORT_FILE`.
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path

_METHOD = "/fastdecode.bench.Echo/Echo"
_MAX = 64 << 20
_OPTIONS = [("grpc.max_send_message_length", _MAX), ("grpc.max_receive_message_length", _MAX)]


def _ident(b: bytes) -> bytes:
    return b


async def _grpc_server(back: int, port_file: Path) -> None:
    import grpc

    reply = b"\0" * back

    async def echo(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        async for _ in requests:
            yield reply

    handler = grpc.method_handlers_generic_handler(
        "fastdecode.bench.Echo",
        {"Echo": grpc.stream_stream_rpc_method_handler(echo, _ident, _ident)},
    )
    server = grpc.aio.server(options=_OPTIONS)
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    port_file.write_text(str(port))
    await server.wait_for_termination()


def _tcp_server(out: int, back: int, port_file: Path) -> None:
    reply = b"\0" * back
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port_file.write_text(str(srv.getsockname()[1]))
    conn, _ = srv.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = bytearray(out)
    view = memoryview(buf)
    while True:
        got = 0
        while got < out:
            n = conn.recv_into(view[got:])
            if n == 0:
                return
            got += n
        conn.sendall(reply)


@contextmanager
def _server(kind: str, out: int, back: int) -> Iterator[int]:
    with tempfile.TemporaryDirectory(prefix="fastdecode-echo-") as d:
        port_file = Path(d) / "port"
        proc = subprocess.Popen(
            [sys.executable, "-m", "fastdecode.benchmarks.echo", kind, str(out), str(back), str(port_file)]
        )
        try:
            deadline = time.monotonic() + 30
            while not port_file.exists() or not port_file.read_text():
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"{kind} echo server did not start")
                time.sleep(0.02)
            yield int(port_file.read_text())
        finally:
            proc.kill()
            proc.wait(10)


def grpc_echo_s(out: int, back: int, repeats: int = 200) -> list[float]:
    """Seconds per round trip of `out` bytes out and `back` bytes back on one grpc.aio bidi stream."""
    import grpc

    from fastdecode.benchmarks.common import run_async

    payload = b"\1" * out

    async def run(port: int) -> list[float]:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=_OPTIONS) as ch:
            call = ch.stream_stream(_METHOD, request_serializer=_ident, response_deserializer=_ident)()
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                await call.write(payload)
                await call.read()
                times.append(time.perf_counter() - t0)
            await call.done_writing()
            return times

    with _server("grpc", out, back) as port:
        return run_async(run(port))[repeats // 10 :]


def grpc_echo_cpu_s(out: int, back: int, repeats: int = 200) -> tuple[float, float]:
    """(median wall seconds, client CPU seconds) per round trip of the bare grpc.aio echo: the CPU
    is this process's (every thread: the event loop and gRPC's poller) over the timed round trips."""
    import grpc

    from fastdecode.benchmarks.common import median, run_async

    payload = b"\1" * out
    warm = max(1, repeats // 10)

    async def run(port: int) -> tuple[float, float]:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=_OPTIONS) as ch:
            call = ch.stream_stream(_METHOD, request_serializer=_ident, response_deserializer=_ident)()
            for _ in range(warm):
                await call.write(payload)
                await call.read()
            times = []
            c0 = time.process_time()
            for _ in range(repeats):
                t0 = time.perf_counter()
                await call.write(payload)
                await call.read()
                times.append(time.perf_counter() - t0)
            cpu = (time.process_time() - c0) / repeats
            await call.done_writing()
            return median(times), cpu

    with _server("grpc", out, back) as port:
        return run_async(run(port))


def tcp_echo_s(out: int, back: int, repeats: int = 200) -> list[float]:
    """Seconds per round trip of the same bytes over a raw loopback TCP socket (TCP_NODELAY)."""
    payload = b"\1" * out
    buf = bytearray(back)
    view = memoryview(buf)
    with _server("tcp", out, back) as port, socket.create_connection(("127.0.0.1", port)) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            s.sendall(payload)
            got = 0
            while got < back:
                got += s.recv_into(view[got:])
            times.append(time.perf_counter() - t0)
        return times[repeats // 10 :]


async def grpc_echo_cpu_s_apart(
    out: int, back: int, repeats: int = 200, timeout: float = 120.0
) -> tuple[float, float]:
    """grpc_echo_cpu_s in a process of its own (client and server), awaited from a running loop."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "fastdecode.benchmarks.echo",
        "grpc-client",
        str(out),
        str(back),
        str(repeats),
        stdout=subprocess.PIPE,
    )
    try:
        got, _ = await asyncio.wait_for(proc.communicate(), timeout)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    if proc.returncode != 0:
        raise RuntimeError(f"the gRPC echo client exited with {proc.returncode}")
    wall, cpu = json.loads(got)
    return float(wall), float(cpu)


if __name__ == "__main__":
    kind, out_b, back_b = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    if kind == "grpc-client":
        print(json.dumps(grpc_echo_cpu_s(out_b, back_b, int(sys.argv[4]))))
        sys.exit(0)
    pf = Path(sys.argv[4])
    if kind == "grpc":
        asyncio.run(_grpc_server(back_b, pf))
    else:
        _tcp_server(out_b, back_b, pf)
