"""One exchange worker process: the Attend streams of some shards, fed through shared memory.

Started by plane.py (the dense side, ExchangePlane, through process.py); it runs gpu_dense's own
shard links (links.py) on its own event loop and core. It dies with its parent (PR_SET_PDEATHSIG,
and the end of its control socket). The native worker (native/exchange_worker.cpp) does the same.
`python -m services.gpu_dense.exchange.worker --fd N --parent PID --shards I=HOST:PORT,...`
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import socket
import time
from pathlib import Path
from typing import Any

import torch

from fastdecode.dense import AttendItem
from fastdecode.dense.handoff import Arena, Slice
from fastdecode.kv import AttendBatch
from fastdecode.runtime.errors import Status
from fastdecode.runtime.loop import run_loop
from fastdecode.runtime.rpc import status_of
from fastdecode.runtime.serving import die_with_parent
from fastdecode.runtime.settings import TLSFiles
from services.gpu_dense.exchange.links import AttendLink, ShardLinks
from services.gpu_dense.exchange.messages import (
    AddShard,
    Attend,
    Cancel,
    Done,
    Err,
    ItemSlices,
    Ok,
    Ready,
    RemoveShard,
    RestoreShard,
    Secret,
    Sync,
    Synced,
    pack,
    unpack_to_worker,
)
from services.gpu_dense.exchange.transport import Attached, Channel, open_channel


class _WorkerLoop:
    def __init__(self, links: ShardLinks, writer: Channel) -> None:
        self.links = links
        self.local: dict[int, int] = {link.index: i for i, link in enumerate(links.links)}
        self.writer = writer
        self.arenas = Attached()
        self.slot_arena: dict[int, str] = {}
        self.slot_lock: dict[int, asyncio.Lock] = {}
        self.tasks: dict[int, asyncio.Task[None]] = {}
        # per slot, the last Attend's arena, slices and items: reused by a message with no items
        self.last: dict[int, tuple[Arena, list[ItemSlices], list[AttendItem]]] = {}

    def add(self, index: int, address: str, timeout: float, tls: TLSFiles | None) -> None:
        if index not in self.local:
            self.local[index] = len(self.links.links)
            self.links.add(AttendLink(index, address, tls, timeout))

    def arena(self, slot: int, name: str) -> Arena:
        old = self.slot_arena.get(slot)
        if old is not None and old != name:
            self.arenas.forget(old)  # the dense side replaced it with a bigger one
        self.slot_arena[slot] = name
        return self.arenas.get(name)

    async def attend(self, msg: Attend, reply: Channel) -> None:
        lock = self.slot_lock.setdefault(msg.slot, asyncio.Lock())
        async with lock:  # a cancelled layer of this slot has unwound before the next one starts
            slices = msg.items
            try:
                if slices is None:  # the items this slot had last: views of the same arena
                    arena, slices, items = self.last[msg.slot]
                else:
                    arena = self.arena(msg.slot, msg.arena)
                    items = [
                        AttendItem(
                            self.local[it.shard],
                            AttendBatch(
                                it.seq_ids,
                                it.num_tokens,
                                it.start_pos,
                                arena.view(Slice(*it.q)),
                                arena.view(Slice(*it.k)),
                                arena.view(Slice(*it.v)),
                            ),
                        )
                        for it in slices
                    ]
                    self.last[msg.slot] = (arena, slices, items)
                wait = (msg.not_before_ns - time.monotonic_ns()) / 1e9
                if wait > 0:  # the device's q, k, v are not in the arena yet
                    await asyncio.sleep(wait)
                outs = await self.links.attend_layer(msg.slot, msg.layer, items)
                results: list[Ok | Err] = []
                for it, o in zip(slices, outs, strict=True):
                    if isinstance(o, BaseException):
                        status, text = status_of(o)
                        results.append(Err(status.value, text))
                    elif o.nbytes > it.o_room:
                        results.append(
                            Err(Status.INTERNAL.value, f"answer of {o.nbytes} bytes, room {it.o_room}")
                        )
                    else:
                        results.append(Ok(arena.put(it.o_offset, o).astuple()))
            except Exception as e:  # noqa: BLE001 - every item of the layer fails in-band
                status, text = status_of(e)
                results = [Err(status.value, text)] * (len(slices) if slices is not None else 0)
            reply.write(pack(Done(msg.rid, results)))
        self.tasks.pop(msg.rid, None)

    def on_message(
        self, msg: tuple[Any, ...], timeout: float, tls: TLSFiles | None, reply: Channel | None = None
    ) -> None:
        """A message from the control socket, or from a slot's layer socket (`reply`: its Done goes
        back there)."""
        loop = asyncio.get_running_loop()
        match msg:
            case Attend():
                self.tasks[msg.rid] = loop.create_task(self.attend(msg, reply or self.writer))
            case Cancel():
                task = self.tasks.pop(msg.rid, None)
                if task is not None:
                    task.cancel()
            case AddShard():
                self.add(msg.index, msg.address, timeout, tls)
            case RemoveShard() if msg.index in self.local:
                task = loop.create_task(self.links.remove(self.local[msg.index]))
                self.tasks[-id(task)] = task
                task.add_done_callback(lambda t: self.tasks.pop(-id(t), None))
            case RestoreShard() if msg.index in self.local:
                self.links.reopen(self.local[msg.index])
            case Sync():  # every message before it is applied: the messages are handled in order
                self.writer.write(pack(Synced(msg.n)))

    async def close(self) -> None:
        for task in self.tasks.values():
            task.cancel()
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)
        await self.links.close()
        self.arenas.close()


async def _worker_main(args: argparse.Namespace) -> None:
    sock = socket.socket(fileno=args.fd)
    loop = asyncio.get_running_loop()
    first: asyncio.Future[tuple[Any, ...]] = loop.create_future()
    state: dict[str, _WorkerLoop] = {}
    early: list[tuple[Any, ...]] = []  # what came before this loop was set up: handled right after

    def on_message(body: bytes) -> None:
        msg = unpack_to_worker(body)
        if not first.done():  # the parent's fleet secret (or None), before anything else
            first.set_result(msg)
        elif "loop" in state:
            state["loop"].on_message(msg, args.timeout, tls)
        else:
            early.append(msg)

    channel = await open_channel(sock, on_message)
    done, _ = await asyncio.wait([first, channel.closed], return_when=asyncio.FIRST_COMPLETED)
    if first not in done:
        return
    msg = first.result()
    secret = msg.secret if isinstance(msg, Secret) else None
    tls = None
    if args.tls_cert or args.tls_ca or secret is not None:
        tls = TLSFiles(
            cert=Path(args.tls_cert) if args.tls_cert else None,
            key=Path(args.tls_key) if args.tls_key else None,
            ca=Path(args.tls_ca) if args.tls_ca else None,
            secret=secret,
        )
    links = ShardLinks([])
    for part in filter(None, args.shards.split(",")):
        index, address = part.split("=", 1)
        links.add(AttendLink(int(index), address, tls, args.timeout))
    state["loop"] = worker = _WorkerLoop(links, channel)
    for msg in early:
        worker.on_message(msg, args.timeout, tls)
    ports = []  # each slot's layer socket: Attend and Cancel, answered on the same socket
    for fd in filter(None, args.layer_fds.split(",")):
        port: list[Channel] = []

        def on_layer(body: bytes, port: list[Channel] = port) -> None:
            worker.on_message(unpack_to_worker(body), args.timeout, tls, port[0])

        port.append(await open_channel(socket.socket(fileno=int(fd)), on_layer))
        ports.append(port[0])
    channel.write(pack(Ready(os.getpid())))
    await channel.closed
    for port_channel in ports:
        port_channel.close()
    await worker.close()
    channel.close()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="services.gpu_dense.exchange.worker")
    p.add_argument("--fd", type=int, required=True)
    p.add_argument("--parent", type=int, required=True)
    p.add_argument("--index", type=int, default=0)
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--shards", default="")
    p.add_argument("--layer-fds", default="")
    p.add_argument("--tls-cert")
    p.add_argument("--tls-key")
    p.add_argument("--tls-ca")
    args = p.parse_args(argv)
    die_with_parent(args.parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a ^C goes to the parent, which closes the socket
    torch.set_num_threads(1)  # the worker does no math
    logging.basicConfig(
        level=os.environ.get("FASTDECODE_LOG_LEVEL", "WARNING").upper(),
        format=f"%(asctime)s exchange[{args.index}] %(levelname)s %(message)s",
    )
    with contextlib.suppress(KeyboardInterrupt):
        run_loop(_worker_main(args))


if __name__ == "__main__":
    main()
