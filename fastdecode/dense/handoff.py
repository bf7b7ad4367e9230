"""The shared memory a mini-batch's q, k, v and o cross in to gpu_dense's exchange workers. Imports
no gRPC.

An arena is one shared-memory segment; a `Slice` names where a tensor lies in it (offset, shape,
dtype name), which is all a worker is told. A `Staging` is one mini-batch's q, k, v and o in an arena,
rows in the step's order: the step runner copies q, k and v in once per layer (from a GPU: a DMA
straight into shared memory), items are row ranges of them, and each item's o comes back into its
rows of o. The staging is what the runner and a plane share (LayerPlane.staging,
fastdecode/dense/runner.py); the transport around it (the arenas per worker, the control socket and
its frames, the slots' own sockets) is the exchange's: services/gpu_dense/exchange/transport.py.
The worker kinds are named here too, for the benchmarks under fastdecode/ that report them.
"""

from __future__ import annotations

import math
import mmap
import os
import shutil
import sys
from dataclasses import dataclass
from multiprocessing import shared_memory
from pathlib import Path

import numpy as np
import torch

from fastdecode.runtime.errors import FailedPrecondition, InvalidInput

ALIGN = 64  # cache-line aligned slices: the copies run at memcpy speed

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
_NAMES = {v: k for k, v in DTYPES.items()}


@dataclass(frozen=True)
class Slice:
    """Where one tensor lies in an arena."""

    offset: int
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype].itemsize

    def astuple(self) -> tuple[int, tuple[int, ...], str]:
        return (self.offset, self.shape, self.dtype)


def aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst[...] = src, dst a contiguous host tensor of src's shape and dtype."""
    if src.device.type == "cpu":
        # numpy's copy is one memcpy on this thread; torch's copy_ wakes its OpenMP team, which
        # costs 5-10x the CPU of the copy on a loaded host (measured: 4.5 vs 0.4 ms for 3 MB)
        s = src.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        np.copyto(dst.reshape(-1).view(torch.uint8).numpy(), s)
    else:
        dst.copy_(src)  # device -> host memory straight, one DMA


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _NAMES[dtype]
    except KeyError:
        raise InvalidInput(f"dtype {dtype} cannot go through the exchange handoff") from None


class Arena:
    """One shared-memory segment: the owner creates (and unlinks) it, the peer attaches by name."""

    def __init__(self, size: int = 0, name: str | None = None) -> None:
        self.owner = name is None
        self._address: int | None = None
        self.shm: shared_memory.SharedMemory | None = None
        self._map: mmap.mmap | None = None
        if self.owner:
            self.shm = shared_memory.SharedMemory(create=True, size=max(size, ALIGN))
            self.name, self.buf = self.shm.name, self.shm.buf
        else:
            # The peer maps the segment itself: Python 3.11's SharedMemory would register it with
            # a resource tracker (one more process) that unlinks it when this process exits, and
            # the creator owns its life.
            fd = os.open(f"/dev/shm/{str(name).lstrip('/')}", os.O_RDWR)
            try:
                self._map = mmap.mmap(fd, 0)
            finally:
                os.close(fd)
            self.name, self.buf = str(name), memoryview(self._map)

    @property
    def size(self) -> int:
        return len(self.buf)

    def view(self, s: Slice) -> torch.Tensor:
        """The slice as a tensor aliasing the arena (no copy); valid until the arena is reused."""
        if s.offset < 0 or s.offset + s.nbytes > self.size:
            raise InvalidInput(f"slice {s} lies outside the {self.size}-byte arena")
        n = s.nbytes
        if n == 0:
            return torch.empty(s.shape, dtype=DTYPES[s.dtype])
        flat = torch.frombuffer(self.buf, dtype=torch.uint8, count=n, offset=s.offset)
        return flat.view(DTYPES[s.dtype]).view(s.shape)

    def _bytes(self, offset: int, n: int) -> np.ndarray:
        if offset < 0 or offset + n > self.size:
            raise InvalidInput(f"{n} bytes at {offset} do not fit the {self.size}-byte arena")
        return np.frombuffer(self.buf, dtype=np.uint8, count=n, offset=offset)

    @property
    def address(self) -> int:
        """Where the arena starts in this process's memory (tensors in it are found by pointer)."""
        if self._address is None:
            self._address = torch.frombuffer(self.buf, dtype=torch.uint8, count=1).data_ptr()
        return self._address

    def slice_of(self, t: torch.Tensor) -> Slice | None:
        """Where t lies when it is a contiguous tensor inside this arena (None: it is elsewhere)."""
        if t.device.type != "cpu" or not t.is_contiguous() or t.dtype not in _NAMES:
            return None
        offset = t.data_ptr() - self.address
        if offset < 0 or offset + t.nbytes > self.size:
            return None
        return Slice(offset, tuple(t.shape), _NAMES[t.dtype])

    def put(self, offset: int, t: torch.Tensor) -> Slice:
        """Copy t into the arena at offset (the one copy on the way in)."""
        s = Slice(offset, tuple(t.shape), dtype_name(t.dtype))
        if s.nbytes:
            copy_into(self.view(s), t)
        return s

    def take(self, s: Slice) -> torch.Tensor:
        """A copy of the slice (the one copy on the way out: the arena is reused by the next layer)."""
        if not s.nbytes:
            return torch.empty(s.shape, dtype=DTYPES[s.dtype])
        out = torch.from_numpy(self._bytes(s.offset, s.nbytes).copy())
        return out.view(DTYPES[s.dtype]).view(s.shape)

    def close(self) -> None:
        try:
            if self.shm is not None:
                self.shm.close()
            else:
                self.buf.release()
                assert self._map is not None
                self._map.close()
        except BufferError:  # a view still alive; the mapping goes with it
            pass
        if self.shm is not None:
            try:
                self.shm.unlink()
            except FileNotFoundError:
                pass


@dataclass(frozen=True)
class Staging:
    """One mini-batch's q, k, v and o in one arena, rows in the step's order: the dense side copies
    q, k and v in once per layer (from a GPU: a DMA straight into shared memory), each item is a row
    range of them, and each item's o comes back into its rows of `o`, which is then the layer's
    whole attention output, already in order."""

    arena: Arena
    q: torch.Tensor  # [T, heads, head_dim]
    k: torch.Tensor  # [T, kv_heads, head_dim]
    v: torch.Tensor
    o: torch.Tensor  # [T, heads * head_dim], q's dtype

    @staticmethod
    def layout(rows: int, q_tail: tuple[int, ...], kv_tail: tuple[int, ...], itemsize: int) -> list[int]:
        """Byte offsets of q, k, v, o and the end, for `rows` rows."""
        q_bytes = rows * math.prod(q_tail) * itemsize
        kv_bytes = rows * math.prod(kv_tail) * itemsize
        offs = [0]
        for n in (q_bytes, kv_bytes, kv_bytes, q_bytes):
            offs.append(offs[-1] + aligned(n))
        return offs

    @classmethod
    def in_arena(
        cls, arena: Arena, rows: int, q_tail: tuple[int, ...], kv_tail: tuple[int, ...], dtype: torch.dtype
    ) -> Staging:
        name = dtype_name(dtype)
        offs = cls.layout(rows, q_tail, kv_tail, dtype.itemsize)
        shapes = ((rows, *q_tail), (rows, *kv_tail), (rows, *kv_tail), (rows, math.prod(q_tail)))
        q, k, v, o = (arena.view(Slice(off, shape, name)) for off, shape in zip(offs, shapes, strict=False))
        return cls(arena, q, k, v, o)

    def rows(self, n: int) -> Staging:
        """The first n rows (views; the same arena)."""
        return Staging(self.arena, self.q[:n], self.k[:n], self.v[:n], self.o[:n])

    def o_room(self, q: Slice) -> tuple[int, int]:
        """(offset, bytes) of o's rows for an item whose q lies at `q` in this staging."""
        row_bytes = self.q[0].nbytes if len(self.q) else 1
        first = (q.offset - (self.q.data_ptr() - self.arena.address)) // row_bytes
        o_row = self.o[0].nbytes if len(self.o) else 0
        return self.o.data_ptr() - self.arena.address + first * o_row, q.shape[0] * o_row


# The native exchange worker (services/gpu_dense/exchange/native/exchange_worker.cpp), which `make
# setup` builds into the environment's bin/ where gRPC C++ is installed.
NATIVE_WORKER = "fastdecode-exchange-worker"


def native_worker() -> Path | None:
    """The native worker's binary: beside this Python (the venv's bin/), else on PATH; None if unbuilt."""
    beside = Path(sys.executable).parent / NATIVE_WORKER
    if os.access(beside, os.X_OK):
        return beside
    found = shutil.which(NATIVE_WORKER)
    return Path(found) if found else None


def worker_kind(kind: str = "auto") -> str:
    """The exchange worker a setting means: `native`, `python`, or `auto` (native when built)."""
    if kind not in ("auto", "native", "python"):
        raise InvalidInput(f"unknown exchange worker {kind!r} (auto, native, python)")
    if kind == "python":
        return kind
    if native_worker() is not None:
        return "native"
    if kind == "native":
        raise FailedPrecondition(
            f"the native exchange worker ({NATIVE_WORKER}) is not built: run `make setup` on a host with "
            "gRPC C++ (Debian: libgrpc++-dev protobuf-compiler-grpc), or use --exchange-worker python"
        )
    return "python"
