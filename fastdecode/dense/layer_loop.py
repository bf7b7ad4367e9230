"""How a mini-batch's layer loop waits: on the event loop, or on a thread of its own.

The loop itself (StepRunner._layers, fastdecode/dense/runner.py) is a generator that yields what it
waits for and is sent the answer, so that one loop body runs under either driver here. It yields an
`Ask`: a layer's items for the shards, `(layer, items, not_before)`, answered with the plane's
`Answered`; or None, a wait for the device's results, answered with None. The plane and the device
are the ones declared in plane.py.

- `on_loop` drives it on the event loop: each wait is an await (the plane's attend_layer or
  attend_layer_at, the device's settle), and the other mini-batch and the server run meanwhile.
- `LayerThreads` drives it on a thread per slot, with the plane's attend_layer_blocking: a layer is
  one send and one read on the slot's own socket to each exchange worker, with no event-loop turn,
  task wake-up or future between them, and a wait for the device (its `wait`) blocks the thread. At
  a GPU's pace the event loop's own work was about half of the dense process's CPU per layer; a
  thread costs the GIL's hand-over instead, which the slots take only between their sends and reads.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import time
from collections.abc import Generator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from threading import Event
from typing import TypeVar

import torch

from fastdecode.dense.plane import Answered, BlockingAttend, Device, LayerPlane, StepCancelled

Item = TypeVar("Item")  # the runner's AttendItem: the drivers hand items on and never look inside
# What the layer loop asks for: a layer's items, with `not_before` the time (time.monotonic()) the
# device's q, k, v for it are ready when the plane waits for the device itself (else None); or None:
# wait for the device.
Ask = tuple[int, list[Item], float | None] | None
Layers = Generator[Ask[Item], Answered | None, torch.Tensor]


@dataclass
class Meter:
    """Where one mini-batch's (or the step's own) time went: each slot's loop has its own, so that
    threads running two of them never add into the same number."""

    busy: float = 0.0  # S-part compute, wall
    busy_cpu: float = 0.0  # and its thread's CPU
    attend: float = 0.0  # waiting on the shards
    trips: int = 0  # Attend items sent


async def on_loop(
    slot: int, layers: Layers[Item], plane: LayerPlane[Item], device: Device, meter: Meter
) -> torch.Tensor:
    """The layer loop on the event loop: each wait is an await. A layer asked with its ready time goes
    to the plane's attend_layer_at (the loop asks so only when the plane has one), else to its
    attend_layer; a wait for the device is the device's settle."""
    attend_at = plane.attend_layer_at
    try:
        ask = next(layers)
        while True:
            answer: Answered | None = None
            if ask is None:
                await device.settle()
            else:
                layer, items, ready = ask
                t0 = time.perf_counter()
                if ready is None or attend_at is None:
                    answer = Answered(await plane.attend_layer(slot, layer, items))
                else:
                    answer = Answered(await attend_at(slot, layer, items, ready))
                meter.attend += time.perf_counter() - t0
            ask = layers.send(answer)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]


class LayerThreads:
    """The slots' layer loops on threads of their own (two: a step has at most two mini-batches)."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="dense-layers")

    async def run(
        self, slot: int, layers: Layers[Item], attend: BlockingAttend[Item], device: Device, meter: Meter
    ) -> torch.Tensor:
        """The layer loop on a thread, in the step's context (an emulated device's clock keeps each
        mini-batch's ready time in a context variable). `attend`: the plane's attend_layer_blocking
        (not_before 0.0: now). A cancelled step stops the loop at its next layer (or at the next
        poll of the answer it waits for), and returns only once it has stopped: no two steps share
        a slot's socket."""
        loop = asyncio.get_running_loop()
        cancelled = Event()
        wait = device.wait  # None: nothing to wait for

        def drive() -> torch.Tensor:
            try:
                ask = next(layers)
                while True:
                    if cancelled.is_set():
                        raise StepCancelled
                    answer: Answered | None = None
                    if ask is None:
                        if wait is not None:
                            wait()
                    else:
                        layer, items, ready = ask
                        t0 = time.perf_counter()
                        answer = attend(loop, slot, layer, items, ready or 0.0, cancelled)
                        meter.attend += time.perf_counter() - t0
                    ask = layers.send(answer)
            except StopIteration as done:
                return done.value  # type: ignore[no-any-return]

        running = loop.run_in_executor(self._pool, contextvars.copy_context().run, drive)
        try:
            return await asyncio.shield(running)
        except asyncio.CancelledError:
            cancelled.set()
            with contextlib.suppress(Exception):
                await running
            raise
