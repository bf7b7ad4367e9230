"""A layer's items as a worker sees them: slices of a shared-memory arena (q, k, v, and o's room),
and each answer back as o. Where the items already lie in the slot's staging (the step runner put
q, k, v there), they cross with no copy; else they are copied into the worker's own arena. A
worker that had the very same items on the slot last layer (a step's later layers) gets none: its
message is a few bytes, and each o comes back as the view made at the step's first layer."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from fastdecode.dense import AttendItem
from fastdecode.dense.handoff import Arena, Slice, Staging, aligned
from fastdecode.runtime import errors
from fastdecode.runtime.errors import Status, Unavailable
from services.gpu_dense.exchange.messages import Err, ItemSlices, Ok
from services.gpu_dense.exchange.transport import ArenaPool


@dataclass
class Sent:
    """What a worker last had in full on a slot (staged items), and each item's o as a view, made
    once per step: every layer of the step answers into the same rows."""

    arena: Arena
    items: tuple[AttendItem, ...]
    views: list[tuple[tuple[Any, ...], torch.Tensor] | None]
    every: Sequence[AttendItem] | None = None  # the layer's whole list these items came from

    def o(
        self, j: int, r: Ok | Err, unpack: Callable[[Arena, Ok | Err], torch.Tensor | BaseException]
    ) -> torch.Tensor | BaseException:
        seen = self.views[j]
        if isinstance(r, Ok) and seen is not None and seen[0] == r.o:
            return seen[1]
        o = unpack(self.arena, r)
        if isinstance(r, Ok) and isinstance(o, torch.Tensor):
            self.views[j] = (r.o, o)
        return o


def staging_rows(
    pool: ArenaPool,
    stagings: dict[int, Staging],
    slot: int,
    rows: int,
    q_tail: tuple[int, ...],
    kv_tail: tuple[int, ...],
    dtype: torch.dtype,
) -> Staging:
    """The slot's staging (kept in `stagings`, at its full capacity) cut to `rows`: the same arena
    while the rows fit, so a worker keeps its mapping and the runner its copy."""
    st = stagings.get(slot)
    if (
        st is None
        or len(st.q) < rows
        or tuple(st.q.shape[1:]) != tuple(q_tail)
        or tuple(st.k.shape[1:]) != tuple(kv_tail)
        or st.q.dtype != dtype
    ):
        cap = max(rows + rows // 2, 16)
        arena = pool.get(("staging", slot), Staging.layout(cap, q_tail, kv_tail, dtype.itemsize)[-1])
        st = stagings[slot] = Staging.in_arena(arena, cap, tuple(q_tail), tuple(kv_tail), dtype)
    return st.rows(rows)


def copy_in(
    pool: ArenaPool, key: tuple[int, int], items: Sequence[AttendItem]
) -> tuple[Arena, list[ItemSlices]]:
    """Items that are not rows of a staging: q, k, v copied into the arena `key` (worker, slot),
    each with o's room after it, and their slices."""
    need = sum(aligned(t.nbytes) for it in items for t in (it.batch.q, it.batch.k, it.batch.v, it.batch.q))
    arena = pool.get(key, need)
    off = 0
    message = []
    for it in items:
        b, slices = it.batch, []
        for t in (b.q, b.k, b.v):
            slices.append(arena.put(off, t).astuple())
            off += aligned(t.nbytes)
        room = aligned(b.q.nbytes)  # o: [T, H*D] in q's dtype, as many bytes as q
        q, k, v = slices
        message.append(
            ItemSlices(it.shard, list(b.seq_ids), list(b.num_tokens), list(b.start_pos), q, k, v, off, room)
        )
        off += room
    return arena, message


def slices_for(
    sent: dict[int, Sent],
    pool: ArenaPool,
    key: tuple[int, int],
    st: Staging | None,
    every: Sequence[AttendItem],
    idx: list[int],
) -> tuple[Arena, list[ItemSlices] | None, Sent | None]:
    """One worker's items (`every[i]` for i in idx) on the slot `key[1]`, with `st` the slot's
    staging and `sent` what the worker last had per slot: the arena, the slices (None: the very items
    the worker had last time on this slot), and the Sent whose views answer them."""
    slot = key[1]
    last = sent.get(slot)
    if st is not None and last is not None and last.arena is st.arena and last.every is every:
        return st.arena, None, last  # the same list of items as the last layer: checked then
    items = [every[i] for i in idx]
    if st is not None and last is not None and last.arena is st.arena and len(last.items) == len(items):
        if all(a is b for a, b in zip(last.items, items, strict=True)):
            last.every = every
            return st.arena, None, last
    staged = (
        [[st.arena.slice_of(t) for t in (it.batch.q, it.batch.k, it.batch.v)] for it in items] if st else []
    )
    if st is None or not all(x is not None for row in staged for x in row):
        sent.pop(slot, None)
        return (*copy_in(pool, key, items), None)
    message = []
    for it, (q, k, v) in zip(items, staged, strict=True):
        assert q is not None and k is not None and v is not None
        o_off, room = st.o_room(q)
        message.append(
            ItemSlices(
                it.shard,
                it.batch.seq_ids,
                it.batch.num_tokens,
                it.batch.start_pos,
                q.astuple(),
                k.astuple(),
                v.astuple(),
                o_off,
                room,
            )
        )
    sent[slot] = Sent(st.arena, tuple(items), [None] * len(items), every)
    return st.arena, message, sent[slot]


def unpack_o(arena: Arena, r: Ok | Err, views: bool = True) -> torch.Tensor | BaseException:
    """An answer as o, or as the error it carries. A view of the arena when the caller consumes o
    before the slot's next layer (the step runner: its O-projection reads o, or copies it to the
    GPU, once); a copy else."""
    if isinstance(r, Ok):
        s = Slice(*r.o)
        return arena.view(s) if views else arena.take(s)
    return errors.error_for(Status.from_value(r.status), r.text)


class _Worker(Protocol):
    """What `collect` needs of a process.WorkerProcess."""

    index: int
    sent: dict[int, Sent]


def collect(
    out: list[torch.Tensor | BaseException],
    worker: _Worker,
    arena: Arena | None,
    idx: list[int],
    sent: Sent | None,
    results: list[Ok | Err] | BaseException | None,
    unpack: Callable[[Arena, Ok | Err], torch.Tensor | BaseException],
) -> None:
    """One worker's answer (or the error that stands for it) into its items' places in `out`."""
    if results is None:
        results = Unavailable(f"exchange worker {worker.index} did not answer")
    elif not isinstance(results, BaseException) and len(results) != len(idx):
        worker.sent.clear()  # a worker without the step's items: resend them next layer
        results = Unavailable(f"exchange worker {worker.index} lost the step's items")
    if isinstance(results, BaseException) or arena is None:
        for i in idx:
            out[i] = results if isinstance(results, BaseException) else Unavailable("no arena")
        return
    for j, (i, r) in enumerate(zip(idx, results, strict=True)):
        out[i] = unpack(arena, r) if sent is None else sent.o(j, r, unpack)
