"""How a mini-batch's layer loop waits: on the event loop, or on a thread of its own.

The loop itself (StepRunner._layers, fastdecode/dense/runner.py) is a generator that yields what it
waits for, a layer's items for the shards or the device's results, and is sent the answer; a
driver here does the waiting. `on_loop` awaits the plane's attend_layer and the model's settle (the
other mini-batch, and the server, run meanwhile). `LayerThreads` runs it on a thread per slot, with
the plane's blocking path: a layer is one send and one read on the slot's own socket to each
exchange worker, with no event-loop turn, task wake-up or future between them. At a GPU's pace the
event loop's own work was about half of the dense process's CPU per layer; a thread costs the
GIL's hand-over instead, which the slots take only between their sends and reads.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import time
from collections.abc import Callable, Generator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from threading import Event
from typing import Any

import torch

from fastdecode.dense.handoff import StepCancelled

# What the layer loop asks for: a layer's items to the shards (layer, runner.AttendItem's, the time
# the device's q, k, v are ready, or None when the plane does not wait for the device), or None:
# wait for the device. What it is sent back: each item's o (or error), or None.
Ask = tuple[int, list[Any], float | None] | None
Answer = list[torch.Tensor | BaseException] | None
Layers = Generator[Ask, Answer, torch.Tensor]


@dataclass
class Meter:
    """Where one mini-batch's (or the step's own) time went: each slot's loop has its own, so that
    threads running two of them never add into the same number."""

    busy: float = 0.0  # S-part compute, wall
    busy_cpu: float = 0.0  # and its thread's CPU
    attend: float = 0.0  # waiting on the shards
    trips: int = 0  # Attend items sent


async def on_loop(slot: int, layers: Layers, shards: Any, model: Any, meter: Meter) -> torch.Tensor:
    """The layer loop on the event loop: each wait is an await."""
    try:
        ask = next(layers)
        while True:
            answer: Answer = None
            if ask is None:
                await model.settle()
            else:
                layer, items, ready = ask
                t0 = time.perf_counter()
                if ready is None:
                    answer = await shards.attend_layer(slot, layer, items)
                else:
                    answer = await shards.attend_layer(slot, layer, items, not_before=ready)
                meter.attend += time.perf_counter() - t0
            ask = layers.send(answer)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]


class LayerThreads:
    """The slots' layer loops on threads of their own (two: a step has at most two mini-batches)."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="dense-layers")

    async def run(
        self,
        slot: int,
        layers: Layers,
        attend: Callable[..., list[torch.Tensor | BaseException]],
        model: Any,
        meter: Meter,
    ) -> torch.Tensor:
        """The layer loop on a thread, in the step's context (an emulated device's clock keeps each
        mini-batch's ready time in a context variable). `attend`: the plane's attend_layer_blocking.
        A cancelled step stops the loop at its next layer (or at the next poll of the answer it
        waits for), and returns only once it has stopped: no two steps share a slot's socket."""
        loop = asyncio.get_running_loop()
        cancelled = Event()
        wait = getattr(model, "wait", None)  # the device's results, blocking (None: nothing to wait)

        def drive() -> torch.Tensor:
            try:
                ask = next(layers)
                while True:
                    if cancelled.is_set():
                        raise StepCancelled
                    answer: Answer = None
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
