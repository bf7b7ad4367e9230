"""The dense side's handle on one exchange worker process (services/gpu_dense/exchange_worker.py):
starting it, its control socket (named messages: exchange_messages.py), its answers, stopping it.
Started from the event loop's thread: PR_SET_PDEATHSIG fires when the thread that started the
child ends, and this one lives as long as the process."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import subprocess
import sys

from fastdecode.dense.handoff import frame, read_frame
from fastdecode.runtime.errors import Unavailable
from fastdecode.runtime.settings import TLSFiles
from services.gpu_dense.exchange_messages import (
    AddShard,
    Attend,
    Cancel,
    Done,
    Err,
    Ok,
    Ready,
    RemoveShard,
    RestoreShard,
    Secret,
)

log = logging.getLogger("fastdecode.gpu_dense.exchange")

START_TIMEOUT_S = 120.0  # a worker imports torch and grpc: seconds on a loaded host


class WorkerProcess:
    """The dense side's handle on one worker process."""

    def __init__(self, index: int, timeout: float, tls: TLSFiles | None) -> None:
        self.index = index
        self.timeout = timeout
        self.tls = tls
        self.shards: dict[int, str] = {}
        self.proc: subprocess.Popen[bytes] | None = None
        self.writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task[None] | None = None
        self.pending: dict[int, asyncio.Future[list[Ok | Err]]] = {}

    @property
    def alive(self) -> bool:
        return self.writer is not None and self.proc is not None and self.proc.poll() is None

    async def start(self) -> None:
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        cmd = [
            sys.executable,
            "-m",
            "services.gpu_dense.exchange_worker",
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
            self.proc = subprocess.Popen(cmd, pass_fds=(child.fileno(),), stdin=subprocess.DEVNULL)
        except OSError as e:
            parent.close()
            raise Unavailable(f"exchange worker {self.index} could not start: {e}") from None
        finally:
            child.close()
        reader, self.writer = await asyncio.open_unix_connection(sock=parent)
        # The fleet secret goes over the socket, never argv or the environment: the worker's links
        # carry it on every Attend call (shards refuse internal calls without it).
        self.writer.write(frame(Secret(self.tls.secret if self.tls is not None else None)))
        try:
            hello = await asyncio.wait_for(read_frame(reader), START_TIMEOUT_S)
        except TimeoutError:
            hello = None
        if not isinstance(hello, Ready):
            await self.stop()
            raise Unavailable(f"exchange worker {self.index} did not start")
        self._reader_task = asyncio.get_running_loop().create_task(self._read(reader))
        log.info("exchange worker %d (pid %d) owns shards %s", self.index, self.proc.pid, sorted(self.shards))

    async def _read(self, reader: asyncio.StreamReader) -> None:
        try:
            while (msg := await read_frame(reader)) is not None:
                if isinstance(msg, Done):
                    fut = self.pending.pop(msg.rid, None)
                    if fut is not None and not fut.done():  # None: a cancelled layer's late answer
                        fut.set_result(msg.results)
        except Exception:  # noqa: BLE001 - a garbled channel is a dead worker
            log.exception("exchange worker %d: bad control message", self.index)
        self._fail_pending(f"exchange worker {self.index} exited")
        if self.writer is not None:
            self.writer.close()
            self.writer = None

    def _fail_pending(self, reason: str) -> None:
        for fut in self.pending.values():
            if not fut.done():
                fut.set_exception(Unavailable(reason))
        self.pending.clear()

    def send(self, message: Attend | Cancel | AddShard | RemoveShard | RestoreShard) -> None:
        if self.writer is None:
            raise Unavailable(f"exchange worker {self.index} is not running")
        self.writer.write(frame(message))

    async def stop(self, grace: float = 5.0) -> None:
        if self.writer is not None:
            self.writer.close()  # the worker sees the end of its control socket and exits
            self.writer = None
        if self._reader_task is not None:
            self._reader_task.cancel()
            await asyncio.gather(self._reader_task, return_exceptions=True)
            self._reader_task = None
        self._fail_pending(f"exchange worker {self.index} stopped")
        proc, self.proc = self.proc, None
        if proc is not None:
            try:
                await asyncio.to_thread(proc.wait, grace)
            except subprocess.TimeoutExpired:
                proc.kill()
                await asyncio.to_thread(proc.wait, grace)
