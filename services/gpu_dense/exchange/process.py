"""The dense side's handle on one exchange worker process (worker.py, or the native one in native/):
starting it, its control socket (named messages: messages.py), its answers, stopping it.
Started from the event loop's thread: PR_SET_PDEATHSIG fires when the thread that started the
child ends, and this one lives as long as the process."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import socket
import subprocess
import sys
import threading
import time

import torch

from fastdecode.dense import StepCancelled
from fastdecode.dense.handoff import native_worker, worker_kind
from fastdecode.runtime.errors import Unavailable
from fastdecode.runtime.settings import TLSFiles
from services.gpu_dense.exchange.messages import (
    AddShard,
    Attend,
    Cancel,
    Done,
    DoneReader,
    Err,
    Ok,
    Ready,
    RemoveShard,
    RestoreShard,
    Secret,
    Sync,
    Synced,
    pack,
)
from services.gpu_dense.exchange.slices import Sent
from services.gpu_dense.exchange.transport import Channel, Port, open_channel

log = logging.getLogger("fastdecode.gpu_dense.exchange")

START_TIMEOUT_S = 120.0  # a worker imports torch and grpc: seconds on a loaded host

# Beyond the shard timeout (the worker's own watchdog fails a silent shard's item), how long the
# dense side waits on a worker before it takes the worker for dead.
WORKER_GRACE_S = 10.0

# Mini-batch slots with their own layer socket to each worker (the step runner's threaded layer
# loop: a slot's thread sends its layer and reads the answer there, no event loop in between).
PORT_SLOTS = 2


def worker_command(kind: str = "auto") -> list[str]:
    """How to start a worker (`native`, `python`, or `auto`: handoff.worker_kind). Both take the same
    arguments and speak the same control messages (exchange.proto)."""
    if worker_kind(kind) == "native":
        return [str(native_worker())]
    return [sys.executable, "-m", "services.gpu_dense.exchange.worker"]


class WorkerStalled(Exception):
    """A worker kept a layer past the shard timeout plus WORKER_GRACE_S (set by the plane's watchdog)."""


def auto_workers(num_shards: int, dense_threads: int | None, device: str = "cpu") -> int:
    """The cores beyond the dense side's own, capped by the shards. The dense side's own: its
    --threads, else one (the event loop) when the S-part runs on a GPU, else torch's threads (all
    cores: a CPU dense half left to torch's default leaves none, and keeps the in-process path)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    on_gpu = device.startswith(("cuda", "emulated:")) or (device == "auto" and torch.cuda.is_available())
    own = dense_threads or (1 if on_gpu else torch.get_num_threads())
    return max(0, min(num_shards, cores - own))


class WorkerProcess:
    """The dense side's handle on one worker process."""

    def __init__(
        self, index: int, timeout: float, tls: TLSFiles | None, command: list[str] | None = None
    ) -> None:
        self.index = index
        self.command = command or worker_command("python")
        self.timeout = timeout
        self.tls = tls
        self.shards: dict[int, str] = {}
        self.proc: subprocess.Popen[bytes] | None = None
        self.writer: Channel | None = None
        self._hello: asyncio.Future[Ready] | None = None
        # per request id: its future and when it went out (the plane's watchdog ages them)
        self.pending: dict[int, tuple[asyncio.Future[list[Ok | Err]], float]] = {}
        # per slot, the arena and items the worker last had in full (ExchangePlane._pack): a layer
        # with the very same items sends none; a restarted worker has none, so this starts empty
        self.sent: dict[int, Sent] = {}
        self._read = DoneReader()
        self.ports: list[Port] = []  # per slot (PORT_SLOTS), a blocking socket: Port
        self.port_reads: list[DoneReader] = []
        self._syncs: dict[int, asyncio.Future[None]] = {}  # per Sync number, its Synced
        self._sync_numbers = itertools.count(1)

    @property
    def kind(self) -> str:
        return "python" if self.command[0] == sys.executable else "native"

    @property
    def alive(self) -> bool:
        """Whether its control socket is open: a worker's exit closes it, and the loop's read of that
        end (`_lost`) drops the writer. No waitpid here: this is asked on every layer."""
        return self.writer is not None and self.proc is not None

    async def start(self) -> None:
        self.sent.clear()
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        pairs = [socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(PORT_SLOTS)]
        cmd = [
            *self.command,
            "--fd",
            str(child.fileno()),
            "--parent",
            str(os.getpid()),
            "--index",
            str(self.index),
            "--timeout",
            repr(self.timeout),
            "--shards",
            ",".join(f"{i}={a}" for i, a in sorted(self.shards.items())),
            "--layer-fds",
            ",".join(str(c.fileno()) for _, c in pairs),
        ]
        if self.tls is not None:
            for flag, path in (
                ("--tls-cert", self.tls.cert),
                ("--tls-key", self.tls.key),
                ("--tls-ca", self.tls.ca),
            ):
                if path is not None:
                    cmd += [flag, str(path)]
        try:
            fds = (child.fileno(), *(c.fileno() for _, c in pairs))
            self.proc = subprocess.Popen(cmd, pass_fds=fds, stdin=subprocess.DEVNULL)
        except OSError as e:
            parent.close()
            for p, _ in pairs:
                p.close()
            raise Unavailable(f"exchange worker {self.index} could not start: {e}") from None
        finally:
            child.close()
            for _, c in pairs:
                c.close()
        self.ports = [Port(p) for p, _ in pairs]
        self.port_reads = [DoneReader() for _ in pairs]
        self._hello = asyncio.get_running_loop().create_future()
        channel = self.writer = await open_channel(parent, self._on_message)
        channel.closed.add_done_callback(lambda _: self._lost(channel))
        # The fleet secret goes over the socket, never argv or the environment: the worker's links
        # carry it on every Attend call (shards refuse internal calls without it).
        channel.write(pack(Secret(self.tls.secret if self.tls is not None else None)))
        try:
            await asyncio.wait_for(asyncio.shield(self._hello), START_TIMEOUT_S)
        except (TimeoutError, Unavailable):
            await self.stop()
            raise Unavailable(f"exchange worker {self.index} did not start") from None
        log.info("exchange worker %d (pid %d) owns shards %s", self.index, self.proc.pid, sorted(self.shards))

    def _on_message(self, body: bytes) -> None:
        msg = self._read(body)
        if isinstance(msg, Done):
            waiting = self.pending.pop(msg.rid, None)
            if waiting is not None and not waiting[0].done():  # None: a cancelled layer's late answer
                waiting[0].set_result(msg.results)
        elif isinstance(msg, Synced):
            fut = self._syncs.pop(msg.n, None)
            if fut is not None and not fut.done():
                fut.set_result(None)
        elif isinstance(msg, Ready) and self._hello is not None and not self._hello.done():
            self._hello.set_result(msg)

    def _lost(self, channel: Channel) -> None:
        """The worker's end of the control socket closed (it exited), or a frame was garbled."""
        if self._hello is not None and not self._hello.done():
            self._hello.set_exception(Unavailable(f"exchange worker {self.index} exited"))
            self._hello.exception()  # retrieved: start() reports it in its own words
        self._fail_pending(f"exchange worker {self.index} exited")
        if self.writer is channel:
            channel.close()
            self.writer = None

    def _fail_pending(self, reason: str) -> None:
        for fut, _ in self.pending.values():
            if not fut.done():
                fut.set_exception(Unavailable(reason))
        self.pending.clear()
        for sync in self._syncs.values():  # a worker started again is given every shard it owns
            if not sync.done():
                sync.set_result(None)
        self._syncs.clear()

    async def apply(self, message: AddShard | RestoreShard) -> None:
        """Sends a change of the shards; returns once the worker applied it."""
        self.send(message)
        await self.sync()

    async def sync(self) -> None:
        """Once the worker has applied every control message sent before: a layer socket is another
        socket, so an item for a shard just added could otherwise reach the worker before its
        AddShard. Returns at once when the worker is not running (a new one starts with its shards);
        a worker that does not answer within the shard timeout is left to the plane's watchdog."""
        if not self.alive:
            return
        n = next(self._sync_numbers)
        fut = self._syncs[n] = asyncio.get_running_loop().create_future()
        self.send(Sync(n))
        try:
            await asyncio.wait_for(fut, self.timeout)
        except TimeoutError:
            self._syncs.pop(n, None)
            log.warning("exchange worker %d did not answer a sync within %.1f s", self.index, self.timeout)

    def read_port(
        self, slot: int, rid: int, limit_s: float, cancelled: threading.Event | None
    ) -> list[Ok | Err] | BaseException | None:
        """From the slot's own thread: the answer to `rid` on the slot's Port; the error that stands
        for it when the worker went; None when none came within `limit_s` (a stalled worker).
        StepCancelled once `cancelled` is set (the worker is told to drop the layer)."""
        ports, reads = self.ports, self.port_reads
        if slot >= len(ports):
            return Unavailable(f"exchange worker {self.index} is not running")
        port, read = ports[slot], reads[slot]
        limit = time.monotonic() + limit_s

        def keep_waiting() -> bool:
            return not (cancelled is not None and cancelled.is_set()) and time.monotonic() < limit

        while True:
            try:
                body = port.read(keep_waiting)
            except OSError:
                return Unavailable(f"exchange worker {self.index} exited")
            if body is None:
                if cancelled is not None and cancelled.is_set():
                    with contextlib.suppress(OSError):
                        port.send(pack(Cancel(rid)))
                    raise StepCancelled
                return None
            msg = read(body)
            if isinstance(msg, Done) and msg.rid == rid:
                return msg.results
            # else a cancelled layer's late answer: skipped

    def send(self, message: Attend | Cancel | AddShard | RemoveShard | RestoreShard | Sync) -> None:
        if self.writer is None:
            raise Unavailable(f"exchange worker {self.index} is not running")
        self.writer.write(pack(message))

    async def stop(self, grace: float = 5.0) -> None:
        if self.writer is not None:
            self.writer.close()  # the worker sees the end of its control socket and exits
            self.writer = None
        for port in self.ports:
            port.close()  # a layer thread reading one gets an error: its items fail UNAVAILABLE
        self.ports = []
        self._fail_pending(f"exchange worker {self.index} stopped")
        proc, self.proc = self.proc, None
        if proc is not None:
            try:
                await asyncio.to_thread(proc.wait, grace)
            except subprocess.TimeoutExpired:
                proc.kill()
                await asyncio.to_thread(proc.wait, grace)
