"""Exchange workers: gpu_dense's Attend streams spread over K worker processes.

Worker w owns the Attend streams of the shards i with i % K == w (the wire, request ids, in-band
errors, shard loss, reconnection and timeouts of links.py). A layer's q, k, v cross in shared memory
(transport.py): in the runner's staging (`staging`), else copied into an arena per (worker, slot);
the worker gets a small descriptor and answers with where each o lies. A layer goes out from the
event loop (attend_layer, attend_layer_at) or from a slot's thread (attend_layer_blocking). A worker
dies with its parent (PR_SET_PDEATHSIG, the control socket's end); one that dies fails its items
UNAVAILABLE and is started again at the next layer. `kind` (--exchange-worker): the native worker
(native/, C++) where `make setup` built it, else `python -m services.gpu_dense.exchange.worker`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import replace

import torch

from fastdecode.dense import Answered, AttendItem, LayerPlane
from fastdecode.dense.handoff import Arena, Staging
from fastdecode.runtime import errors
from fastdecode.runtime.errors import Unavailable
from fastdecode.runtime.settings import TLSFiles
from services.gpu_dense.exchange.messages import (
    AddShard,
    Attend,
    Cancel,
    Err,
    ItemSlices,
    Ok,
    RemoveShard,
    RestoreShard,
    attend_frame,
    pack,
)
from services.gpu_dense.exchange.process import WORKER_GRACE_S, WorkerProcess, WorkerStalled, worker_command
from services.gpu_dense.exchange.service import ShardAddress
from services.gpu_dense.exchange.slices import Sent, collect, slices_for, staging_rows, unpack_o
from services.gpu_dense.exchange.transport import ArenaPool, PortStalled

log = logging.getLogger("fastdecode.gpu_dense.exchange")
# one worker's part of a layer in flight: the worker, the rid, the arena, the items' indices, the answer
_Wait = tuple[WorkerProcess, int, Arena, list[int], "asyncio.Future[list[Ok | Err]]", Sent | None]
Coro = Coroutine[None, None, list[torch.Tensor | BaseException]]


class ExchangePlane(LayerPlane[AttendItem]):
    """A shard plane whose Attend streams live in K exchange worker processes, with each of
    LayerPlane's capabilities (the workers hold a layer's bytes till its not_before)."""

    def __init__(
        self,
        addresses: Sequence[str],
        workers: int,
        tls: TLSFiles | None = None,
        timeout: float = 60.0,
        views: bool = True,
        kind: str = "auto",
    ) -> None:
        if workers < 1:
            raise errors.InvalidInput("an exchange plane needs at least one worker")
        self.timeout = timeout
        self.views = views  # o as views of the arena, valid until the slot's next attend_layer
        self.links: list[ShardAddress] = []
        command = worker_command(kind)  # native (C++) or python: the same messages either way
        self.workers = [WorkerProcess(i, timeout, tls, command) for i in range(workers)]
        self.arenas = ArenaPool()
        self._staging: dict[int, Staging] = {}  # per slot, at its full capacity
        # per slot: a step's items list, each worker's indices in it (routed once; RemoveShard resets it)
        self._routes: dict[int, tuple[Sequence[AttendItem], dict[int, list[int]]]] = {}
        self._rids = itertools.count(1)  # next() is atomic: the slots' threads share it
        # per slot, the blocking path's last layer: its items, each worker's results, its answers repeated
        self._answered: dict[int, tuple[Sequence[AttendItem], list[object], Answered]] = {}
        self._lock = asyncio.Lock()
        self._watchdog: asyncio.Task[None] | None = None
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

    async def add_shard(self, address: str) -> int:
        index = self._assign(address)
        worker = self.workers[index % len(self.workers)]
        if worker.alive:
            await worker.apply(AddShard(index, address))  # before any item names it
        return index

    async def remove(self, index: int) -> None:
        """RemoveShard: the shard's items fail UNAVAILABLE from now on; its worker closes its streams.
        Its index stays taken, so no other shard's moves."""
        if not 0 <= index < len(self.links):
            raise errors.NotFound(f"unknown shard {index}")
        if not self.links[index].removed:
            self.links[index] = replace(self.links[index], removed=True)
            self._routes.clear()
            worker = self.workers[index % len(self.workers)]
            if worker.alive:
                worker.send(RemoveShard(index))
            log.info("removed %s", self.links[index].name)

    async def restore(self, index: int) -> None:
        """AddShard of a removed shard's address (a restarted pod): it takes items again."""
        if self.links[index].removed:
            self.links[index] = replace(self.links[index], removed=False)
            self._routes.clear()
            worker = self.workers[index % len(self.workers)]
            if worker.alive:
                await worker.apply(RestoreShard(index))

    async def start(self) -> None:
        await asyncio.gather(*(self._ensure(w) for w in self.workers))

    async def _ensure(self, worker: WorkerProcess) -> None:
        if worker.alive:
            return
        async with self._lock:  # one (re)start at a time; the other waiters then find it alive
            if not worker.alive:
                await worker.stop(grace=1.0)
                await worker.start()

    def staging(
        self, slot: int, rows: int, q_tail: tuple[int, ...], kv_tail: tuple[int, ...], dtype: torch.dtype
    ) -> Staging:
        """LayerPlane.staging: the same arena while the rows fit, so a worker keeps its mapping and the
        runner its copy."""
        return staging_rows(self.arenas, self._staging, slot, rows, q_tail, kv_tail, dtype)

    def _route(
        self, slot: int, items: Sequence[AttendItem], out: list[torch.Tensor | BaseException]
    ) -> dict[int, list[int]]:
        """Which worker gets which items (indices), routed once per step: a step's later layers pass
        the same list. Items of a removed shard fail in `out`."""
        routed = self._routes.get(slot)
        if routed is not None and routed[0] is items:
            return routed[1]
        by_worker: dict[int, list[int]] = {}
        for i, item in enumerate(items):
            if self.links[item.shard].removed:
                out[i] = Unavailable(f"{self.links[item.shard].name} was removed")
                continue
            by_worker.setdefault(item.shard % len(self.workers), []).append(i)
        if len(by_worker) and sum(map(len, by_worker.values())) == len(items):
            self._routes[slot] = (items, by_worker)
        return by_worker

    async def attend_layer(
        self,
        slot: int,
        layer: int,
        items: Sequence[AttendItem],
        between: Callable[[], None] | None = None,
        not_before: float = 0.0,
    ) -> list[torch.Tensor | BaseException]:
        """`between`: as ShardLinks.attend_layer's, once every worker has its items. `not_before`
        (time.monotonic()): the workers send none of the layer's bytes before then."""
        loop = asyncio.get_running_loop()
        if self._watchdog is None or self._watchdog.done():
            self._watchdog = loop.create_task(self._watch())
        out: list[torch.Tensor | BaseException] = [torch.empty(0)] * len(items)
        by_worker = self._route(slot, items, out)
        deadline = int(not_before * 1e9) if not_before > 0 else 0
        waits: list[_Wait] = []
        try:
            for w, idx in by_worker.items():
                worker = self.workers[w]
                try:
                    if not worker.alive:
                        await self._ensure(worker)
                    arena, message, sent = self._slices(worker, slot, items, idx)
                    rid = next(self._rids)
                    fut: asyncio.Future[list[Ok | Err]] = loop.create_future()
                    worker.pending[rid] = (fut, time.monotonic())
                    worker.send(Attend(rid, slot, layer, arena.name, message, deadline))
                    waits.append((worker, rid, arena, idx, fut, sent))
                except errors.ServiceError as e:
                    for i in idx:
                        out[i] = e
            if between is not None:
                between()
            for worker, _rid, arena, idx, fut, sent in waits:
                results: list[Ok | Err] | BaseException | None
                try:
                    results = await fut  # the plane's watchdog fails it when the worker stalls
                except WorkerStalled:
                    log.warning("exchange worker %d did not answer: restarting it", worker.index)
                    await worker.stop(grace=0.5)
                    results = None
                except errors.ServiceError as e:
                    results = e
                collect(out, worker, arena, idx, sent, results, self._unpack)
        except asyncio.CancelledError:
            for worker, rid, *_ in waits:  # the worker abandons those items (their streams reopen)
                if worker.pending.pop(rid, None) is not None and worker.writer is not None:
                    worker.send(Cancel(rid))
            raise
        return out

    def attend_layer_at(self, slot: int, layer: int, items: Sequence[AttendItem], not_before: float) -> Coro:
        """attend_layer whose bytes the workers send no earlier than `not_before` (time.monotonic())."""
        return self.attend_layer(slot, layer, items, None, not_before)

    def attend_layer_blocking(
        self,
        loop: asyncio.AbstractEventLoop,
        slot: int,
        layer: int,
        items: Sequence[AttendItem],
        not_before: float = 0.0,
        cancelled: threading.Event | None = None,
    ) -> Answered:
        """attend_layer for a slot's own thread, on the slot's Port to each worker: one send and one
        blocking read per worker, no event loop in between. `loop` runs the plane (a dead worker is
        restarted there); `cancelled` set: StepCancelled. The answers are `repeated` when they are
        the slot's last layer's (the same items, each worker's DoneReader handing back the same results)."""
        out: list[torch.Tensor | BaseException] = [torch.empty(0)] * len(items)
        by_worker = self._route(slot, items, out)
        deadline = int(not_before * 1e9) if not_before > 0 else 0
        waits: list[tuple[WorkerProcess, int, Arena, list[int], Sent | None]] = []
        for w, idx in by_worker.items():
            worker = self.workers[w]
            try:
                if not (worker.alive and worker.ports):
                    asyncio.run_coroutine_threadsafe(self._ensure(worker), loop).result()
                arena, message, sent = self._slices(worker, slot, items, idx)
                rid = next(self._rids)
                if message is None:  # a step's later layers: a few bytes, encoded without protobuf
                    frame = attend_frame(rid, slot, layer, arena.name, deadline)
                else:
                    frame = pack(Attend(rid, slot, layer, arena.name, message, deadline))
                worker.ports[slot].send(frame)
                waits.append((worker, rid, arena, idx, sent))
            except errors.ServiceError as e:
                collect(out, worker, None, idx, None, e, self._unpack)
            except OSError as e:  # the worker went (its port closed), or stopped reading its port
                why = str(e) if isinstance(e, PortStalled) else "exited"
                collect(out, worker, None, idx, None, Unavailable(f"exchange worker {w} {why}"), self._unpack)
                if isinstance(e, PortStalled):  # restarted at the next layer, like a stalled one
                    log.warning("exchange worker %d %s: restarting it", w, why)
                    asyncio.run_coroutine_threadsafe(worker.stop(grace=0.5), loop).result()
        answers = []
        for worker, rid, *_ in waits:
            results = worker.read_port(slot, rid, self.timeout + WORKER_GRACE_S, cancelled)
            if results is None:
                log.warning("exchange worker %d did not answer: restarting it", worker.index)
                asyncio.run_coroutine_threadsafe(worker.stop(grace=0.5), loop).result()
            answers.append(results)
        # The same items answered in the same slices as the slot's last layer (DoneReader hands the
        # very same results back): the same answers, handed back as a repeat of those.
        last = self._answered.get(slot)
        if last is not None and last[0] is items and len(answers) == len(last[1]) == len(by_worker):
            if all(a is b for a, b in zip(answers, last[1], strict=True)):
                return last[2]
        for (worker, _, arena, idx, sent), results in zip(waits, answers, strict=True):
            collect(out, worker, arena, idx, sent, results, self._unpack)
        if len(waits) == len(by_worker) and all(isinstance(a, list) for a in answers):
            self._answered[slot] = (items, answers, Answered(out, repeated=True))
        return Answered(out)

    def _slices(
        self, worker: WorkerProcess, slot: int, items: Sequence[AttendItem], idx: list[int]
    ) -> tuple[Arena, list[ItemSlices] | None, Sent | None]:
        return slices_for(worker.sent, self.arenas, (worker.index, slot), self._staging.get(slot), items, idx)

    def _unpack(self, arena: Arena, r: Ok | Err) -> torch.Tensor | BaseException:
        return unpack_o(arena, r, self.views)

    async def _watch(self) -> None:
        """One timer for every layer in flight (an `asyncio.timeout` per layer was a timer handle made
        and cancelled 64 times a step): a request older than the shard timeout plus the grace fails
        with WorkerStalled, and its layer restarts the worker."""
        limit = self.timeout + WORKER_GRACE_S
        while True:
            await asyncio.sleep(min(1.0, limit / 4))
            now = time.monotonic()
            for worker in self.workers:
                for fut, since in list(worker.pending.values()):
                    if now - since > limit and not fut.done():
                        fut.set_exception(WorkerStalled(f"exchange worker {worker.index} did not answer"))

    async def close(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            await asyncio.gather(self._watchdog, return_exceptions=True)
        await asyncio.gather(*(w.stop() for w in self.workers))
        self.arenas.close()
