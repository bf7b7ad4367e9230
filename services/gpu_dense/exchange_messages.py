"""The control messages between gpu_dense and its exchange workers (over a Unix socket, framed by
fastdecode.dense.handoff.frame). Tensors never travel here: q, k, v and o sit in shared-memory
arenas, and a message names their slices (`Slice.astuple()`: offset, dtype, shape)."""

from __future__ import annotations

from typing import Any, NamedTuple

from fastdecode.runtime.fleet_secret import FleetSecret

SliceTuple = tuple[Any, ...]  # handoff.Slice.astuple()


# ---- dense -> worker ----------------------------------------------------------------------
class Secret(NamedTuple):
    """First message: the fleet secret the worker's links carry (never argv or the environment)."""

    secret: FleetSecret | None


class ItemSlices(NamedTuple):
    """One shard's item of a layer: its request fields and where q, k, v and o's room lie."""

    shard: int
    seq_ids: list[str]
    num_tokens: list[int]
    start_pos: list[int]
    q: SliceTuple
    k: SliceTuple
    v: SliceTuple
    o_offset: int
    o_room: int  # bytes free for o at o_offset


class Attend(NamedTuple):
    rid: int
    slot: int
    layer: int
    arena: str  # the shared-memory arena's name
    items: list[ItemSlices] | None  # None: the same items as this slot's last Attend (a step's layers)


class Cancel(NamedTuple):
    """The layer `rid` was cancelled: abandon its items (their streams reopen)."""

    rid: int


class AddShard(NamedTuple):
    index: int
    address: str


class RemoveShard(NamedTuple):
    index: int


class RestoreShard(NamedTuple):
    index: int


# ---- worker -> dense ----------------------------------------------------------------------
class Ready(NamedTuple):
    pid: int


class Ok(NamedTuple):
    o: SliceTuple  # where the worker put o in the arena


class Err(NamedTuple):
    status: int  # fastdecode.runtime.errors.Status value
    text: str


class Done(NamedTuple):
    rid: int
    results: list[Ok | Err]  # one per item, in order
