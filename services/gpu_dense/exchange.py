"""Exchange workers: gpu_dense's Attend streams spread over worker processes.

One Python process moves gRPC payload at ~2 GB/s per CPU-second; a GPU host's layer (Llama-3-8B,
B=256, bf16: ~5 MB) would cost the dense process milliseconds of CPU per layer. With K workers,
each owns the Attend streams (services/gpu_dense/shards.py, unchanged: same wire, request ids,
in-band errors, shard loss, reconnection and timeouts) of the shards i with i % K == its index.
The dense process copies q, k, v into a shared-memory arena per (worker, slot), sends a small
descriptor over a Unix socket, and copies each o out when the worker answers
(fastdecode/dense/handoff.py): its own CPU per layer is two copies and two tiny messages.

A worker dies with its parent (PR_SET_PDEATHSIG, and the control socket's end); a worker that
dies fails its items as UNAVAILABLE and is started again on the next layer.
A worker is `python -m services.gpu_dense.exchange_worker` (services/gpu_dense/exchange_worker.py).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from fastdecode.dense import AttendItem
from fastdecode.dense.handoff import Arena, ArenaPool, Slice, aligned, frame, read_frame
from fastdecode.runtime import errors
from fastdecode.runtime.errors import Status, Unavailable
from fastdecode.runtime.settings import TLSFiles

log = logging.getLogger("fastdecode.gpu_dense.exchange")

START_TIMEOUT_S = 120.0  # a worker imports torch and grpc: seconds on a loaded host
# Beyond the shard timeout (the worker's own watchdog fails a silent shard's item), how long the
# dense side waits on a worker before it takes the worker for dead.
WORKER_GRACE_S = 10.0


def auto_workers(num_shards: int, dense_threads: int | None, device: str = "cpu") -> int:
    """The cores beyond the dense side's own, capped by the shards. The dense side's own: its
    --threads, else one (the event loop) when the S-part runs on a GPU, else torch's threads (all
    cores: a CPU dense half left to torch's default leaves none, and keeps the in-process path)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    on_gpu = device.startswith(("cuda", "emulated:")) or (device == "auto" and torch.cuda.is_available())
    own = dense_threads or (1 if on_gpu else torch.get_num_threads())
    return max(0, min(num_shards, cores - own))


@dataclass(frozen=True)
class ShardAddress:
    """What the service reports of a shard (the links of the in-process path have the same)."""

    index: int
    address: str
    removed: bool = False  # RemoveShard: its items fail UNAVAILABLE, its worker closed its streams

    @property
    def name(self) -> str:
        return f"shard {self.index} ({self.address})"


class _Worker:
    """The dense side's handle on one worker process."""

    def __init__(self, index: int, timeout: float, tls: TLSFiles | None) -> None:
        self.index = index
        self.timeout = timeout
        self.tls = tls
        self.shards: dict[int, str] = {}
        self.proc: subprocess.Popen[bytes] | None = None
        self.writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task[None] | None = None
        self.pending: dict[int, asyncio.Future[list[tuple[Any, ...]]]] = {}

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
        # Started from the event loop's thread: PR_SET_PDEATHSIG fires when the thread that
        # started the child ends, and this one lives as long as the process.
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
        self.writer.write(frame(("secret", self.tls.secret if self.tls is not None else None)))
        try:
            hello = await asyncio.wait_for(read_frame(reader), START_TIMEOUT_S)
        except TimeoutError:
            hello = None
        if hello != ("ready",):
            await self.stop()
            raise Unavailable(f"exchange worker {self.index} did not start")
        self._reader_task = asyncio.get_running_loop().create_task(self._read(reader))
        log.info("exchange worker %d (pid %d) owns shards %s", self.index, self.proc.pid, sorted(self.shards))

    async def _read(self, reader: asyncio.StreamReader) -> None:
        try:
            while (msg := await read_frame(reader)) is not None:
                if msg[0] == "done":
                    fut = self.pending.pop(msg[1], None)
                    if fut is not None and not fut.done():  # None: a cancelled layer's late answer
                        fut.set_result(msg[2])
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

    def send(self, message: tuple[Any, ...]) -> None:
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


class ExchangePlane:
    """A ShardPlane whose Attend streams live in K exchange worker processes."""

    def __init__(
        self,
        addresses: Sequence[str],
        workers: int,
        tls: TLSFiles | None = None,
        timeout: float = 60.0,
        views: bool = True,
    ) -> None:
        if workers < 1:
            raise errors.InvalidInput("an exchange plane needs at least one worker")
        self.timeout = timeout
        self.views = views  # o as views of the arena, valid until the slot's next attend_layer
        self.links: list[ShardAddress] = []
        self.workers = [_Worker(i, timeout, tls) for i in range(workers)]
        self.arenas = ArenaPool()
        self._rids = 0
        self._lock = asyncio.Lock()
        self._closing: set[asyncio.Task[None]] = set()
        for a in addresses:
            self._assign(a)

    @property
    def num_shards(self) -> int:
        return len(self.links)

    def _assign(self, address: str) -> int:
        index = len(self.links)
        self.links.append(ShardAddress(index, address))
        self.workers[index % len(self.workers)].shards[index] = address
        return index

    def add_shard(self, address: str) -> int:
        index = self._assign(address)
        worker = self.workers[index % len(self.workers)]
        if worker.alive:
            worker.send(("add", index, address))
        return index

    def add(self, link: Any) -> None:
        """AddShard hands an in-process ShardLink: its address joins a worker, its channel closes."""
        self.add_shard(link.address)
        task = asyncio.get_running_loop().create_task(link.close())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def remove(self, index: int) -> None:
        """RemoveShard: the shard's items fail UNAVAILABLE from now on; its worker closes its streams.
        Its index stays taken, so no other shard's moves."""
        if not 0 <= index < len(self.links):
            raise errors.NotFound(f"unknown shard {index}")
        if not self.links[index].removed:
            self.links[index] = replace(self.links[index], removed=True)
            worker = self.workers[index % len(self.workers)]
            if worker.alive:
                worker.send(("remove", index))
            log.info("removed %s", self.links[index].name)

    def restore(self, index: int) -> None:
        """AddShard of a removed shard's address (a restarted pod): it takes items again."""
        if self.links[index].removed:
            self.links[index] = replace(self.links[index], removed=False)
            worker = self.workers[index % len(self.workers)]
            if worker.alive:
                worker.send(("restore", index))

    async def start(self) -> None:
        await asyncio.gather(*(self._ensure(w) for w in self.workers))

    async def _ensure(self, worker: _Worker) -> None:
        if worker.alive:
            return
        async with self._lock:  # one (re)start at a time; the other waiters then find it alive
            if not worker.alive:
                await worker.stop(grace=1.0)
                await worker.start()

    async def attend_layer(
        self,
        slot: int,
        layer: int,
        items: Sequence[AttendItem],
        between: Callable[[], None] | None = None,
    ) -> list[torch.Tensor | BaseException]:
        """`between`: as ShardLinks.attend_layer's, once every worker has its items."""
        out: list[torch.Tensor | BaseException] = [torch.empty(0)] * len(items)
        by_worker: dict[int, list[int]] = {}
        for i, item in enumerate(items):
            if self.links[item.shard].removed:
                out[i] = Unavailable(f"{self.links[item.shard].name} was removed")
                continue
            by_worker.setdefault(item.shard % len(self.workers), []).append(i)
        waits: list[tuple[_Worker, int, Arena, list[int], asyncio.Future[list[tuple[Any, ...]]]]] = []
        try:
            for w, idx in by_worker.items():
                worker = self.workers[w]
                try:
                    await self._ensure(worker)
                    arena, message = self._pack(w, slot, layer, [items[i] for i in idx])
                    self._rids += 1
                    fut: asyncio.Future[list[tuple[Any, ...]]] = asyncio.get_running_loop().create_future()
                    worker.pending[self._rids] = fut
                    worker.send(("attend", self._rids, slot, layer, arena.name, message))
                    waits.append((worker, self._rids, arena, idx, fut))
                except errors.ServiceError as e:
                    for i in idx:
                        out[i] = e
            if between is not None:
                between()
            for worker, _rid, arena, idx, fut in waits:
                try:
                    results = await asyncio.wait_for(fut, self.timeout + WORKER_GRACE_S)
                except TimeoutError:
                    log.warning("exchange worker %d did not answer: restarting it", worker.index)
                    await worker.stop(grace=0.5)
                    results = None
                except errors.ServiceError as e:
                    for i in idx:
                        out[i] = e
                    continue
                if results is None:
                    for i in idx:
                        out[i] = Unavailable(f"exchange worker {worker.index} did not answer")
                    continue
                for i, r in zip(idx, results, strict=True):
                    out[i] = self._unpack(arena, r)
        except asyncio.CancelledError:
            for worker, rid, *_ in waits:  # the worker abandons those items (their streams reopen)
                if worker.pending.pop(rid, None) is not None and worker.writer is not None:
                    worker.send(("cancel", rid))
            raise
        return out

    def _pack(
        self, w: int, slot: int, layer: int, items: Sequence[AttendItem]
    ) -> tuple[Arena, list[tuple[Any, ...]]]:
        """q, k, v of the worker's items into its arena (one copy each), o's room after them."""
        need = sum(aligned(t.nbytes) for it in items for t in (it.q, it.k, it.v, it.q))
        arena = self.arenas.get((w, slot), need)
        off = 0
        message = []
        for it in items:
            slices = []
            for t in (it.q, it.k, it.v):
                slices.append(arena.put(off, t).astuple())
                off += aligned(t.nbytes)
            room = aligned(it.q.nbytes)  # o: [T, H*D] in q's dtype, as many bytes as q
            message.append(
                (it.shard, list(it.seq_ids), list(it.num_tokens), list(it.start_pos), *slices, off, room)
            )
            off += room
        return arena, message

    def _unpack(self, arena: Arena, r: tuple[Any, ...]) -> torch.Tensor | BaseException:
        if r[0] == "ok":
            # A view of the arena when the caller consumes o before the slot's next layer (the
            # step runner: its O-projection reads o, or copies it to the GPU, once); a copy else.
            s = Slice(*r[1])
            return arena.view(s) if self.views else arena.take(s)
        return errors.error_for(Status.from_value(r[1]), r[2])

    async def close(self) -> None:
        await asyncio.gather(*(w.stop() for w in self.workers))
        self.arenas.close()
