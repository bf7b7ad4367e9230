"""What the dense step hands a layer to, and what it waits on, declared: the shard plane and the device.

The step runner (runner.py) cuts each layer of a mini-batch into items, one per shard (its
AttendItem), and hands them to a `ShardPlane`, which answers with each item's o. What a plane can do
beyond that is declared by `LayerPlane`: each capability a typed attribute, None where the plane has
none (attend_layer_at: it waits for the device itself; attend_layer_blocking: a slot's thread may
attend on it; staging: q, k, v go to it in shared memory). What the device offers is declared by
`Device` (when its results are ready, whether they are synthetic, a blocking and an awaiting wait).

A class declares a protocol by inheriting it, and sets each capability (gpu_dense's planes:
services/gpu_dense/exchange/; the emulated GPU: emulated.py). `declares` reads that from the class,
never from the object's attributes; the runner takes a plane or a device that declares nothing as
one with no capability (`PlainPlane`, `SyncDevice`). The declarations are generic in the item
(`Item`: the runner's AttendItem), so that they need not import the runner.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Sequence
from typing import NamedTuple, Protocol, TypeVar

import torch

from fastdecode.dense.handoff import Staging

Item = TypeVar("Item", contravariant=True)
# A layer's answers, one per item in order: its o, or the error that item met (the others still answer).
Outs = list[torch.Tensor | BaseException]


class Answered(NamedTuple):
    """A layer's answers as a blocking attend hands them back. `repeated`: they are the very answers
    of the slot's last layer (the same items, each o in the same place: exchange workers answer a
    step's layers into the same rows of the staging), so the runner takes them as it took those,
    without reading them again. A plane that cannot tell says False."""

    outs: Outs
    repeated: bool = False


class StepCancelled(Exception):
    """A step was cancelled while one of its slots' threads waited on the plane's blocking attend."""


class ShardPlane(Protocol[Item]):
    """The shards as the dense step sees them: what every plane does. `slot` names the mini-batch: a
    slot has at most one layer in flight, so each (shard, slot) pair can be one ordered stream."""

    num_shards: int

    async def attend_layer(self, slot: int, layer: int, items: Sequence[Item]) -> Outs:
        """o for each item, or the error that item met (the others still answer)."""
        ...


class AttendAt(Protocol[Item]):
    def __call__(
        self, slot: int, layer: int, items: Sequence[Item], not_before: float
    ) -> Awaitable[Outs]: ...


class BlockingAttend(Protocol[Item]):
    def __call__(
        self,
        loop: asyncio.AbstractEventLoop,
        slot: int,
        layer: int,
        items: Sequence[Item],
        not_before: float = 0.0,
        cancelled: threading.Event | None = None,
    ) -> Answered: ...


class Stage(Protocol):
    def __call__(
        self, slot: int, rows: int, q_tail: tuple[int, ...], kv_tail: tuple[int, ...], dtype: torch.dtype
    ) -> Staging: ...


class LayerPlane(ShardPlane[Item], Protocol[Item]):
    """A shard plane with what it can do beyond attend_layer declared, each capability None where
    the plane has none."""

    # attend_layer that sends none of the layer's bytes before `not_before` (time.monotonic()), when
    # the device's q, k, v are ready: the layer goes out as soon as its device work is queued, and
    # the loop spares a wake-up per layer (exchange workers hold the bytes till then). None: the
    # runner waits for the device, then calls attend_layer.
    attend_layer_at: AttendAt[Item] | None
    # attend_layer from a slot's own thread (layer_loop.LayerThreads), blocking, `not_before` as
    # attend_layer_at's (0.0: now); StepCancelled once `cancelled` is set. `loop` runs the plane (what
    # must happen there, a worker restarted, is handed to it). None: the layers stay on the event loop.
    attend_layer_blocking: BlockingAttend[Item] | None
    # where the runner puts a mini-batch's q, k and v (rows in step order) so that items cut from
    # them cross without a copy, each o coming back into its rows of the staging's o. None: items
    # are views of the layer's own tensors.
    staging: Stage | None


class PlainPlane(LayerPlane[Item]):
    """A ShardPlane that declares nothing more, as the runner sees it: every capability None."""

    attend_layer_at = None
    attend_layer_blocking = None
    staging = None

    def __init__(self, plane: ShardPlane[Item]) -> None:
        self.plane = plane

    @property
    def num_shards(self) -> int:
        return self.plane.num_shards

    def attend_layer(self, slot: int, layer: int, items: Sequence[Item]) -> Awaitable[Outs]:
        return self.plane.attend_layer(slot, layer, items)


class Device(Protocol):
    """The device the S-part runs on, as the layer loop waits for it: each capability a typed
    attribute, None where the device has none."""

    # q, k, v are the same synthetic rows at every layer, and their copy to the host is charged on the
    # device's clock: the runner stages them once per arena and hands o on as it is (no values read)
    synthetic: bool
    # when the calling task's (or thread's) last result, a layer's q, k, v in host memory, is ready
    # (time.monotonic()); None: a result is ready when the call that made it returns
    ready_at: Callable[[], float] | None
    # blocks until then (a slot's thread); None: nothing to wait for
    wait: Callable[[], None] | None
    # awaits until then (the event loop)
    settle: Callable[[], Awaitable[None]]


class SyncDevice(Device):
    """A device whose results are ready when the calls that make them return: the CPU, and CUDA, whose
    copy of q, k, v to the host waits for its kernels (DenseModel). `settle` is the model's own."""

    synthetic = False
    ready_at = None
    wait = None

    def __init__(self, settle: Callable[[], Awaitable[None]]) -> None:
        self.settle = settle


def declares(obj: object, protocol: type) -> bool:
    """Whether obj's class inherits `protocol`, i.e. declares it and each of its capabilities (a
    nominal check: the class's bases are read, never the object's attributes)."""
    return protocol in type(obj).__mro__
