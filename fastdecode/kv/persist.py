"""A KV pool that outlives its process: the pool, its block tables and positions in files under
--kv-dir (fastdecode/runtime/settings.py ShardSettings.kv_dir), mapped, not copied.

Two files per shard:
- `shard-N.kv`: a JSON header (what the bytes mean: dtype, block size, blocks, geometry, the boot it
  was written in), then per sequence slot its committed positions per layer (int32) and its append in
  flight (layer + 1 and end, 0 when none), then the K and V pools and their scales, each 2 MiB
  aligned. Attention reads and writes the pools in place (MAP_SHARED): nothing is copied per step.
- `shard-N.log`: the journal, frames of [length, crc32, msgpack records]: a sequence added (its
  slot, id and prefix names), its block tables, dropped; a prefix block cached or let go; the model.
  Replaying it gives every live sequence's tables and the prefix caches; a torn last frame (a kill
  inside a write) fails its crc and is ignored.

Crash consistency, in the order the store keeps: (1) the journal frame naming a block's owner is
written before any KV goes into that block; (2) an Attend item marks its sequences' append in flight,
the kernel appends, then the new positions are committed and the mark cleared. So after a kill -9 a
position is either committed (all of its layer's KV written) or past the committed end, never read:
a sequence resumes at its committed position, and the positions its append in flight was writing
(`torn`) are computed again. Page-cache writes survive a killed process; a reboot of a disk-backed
pool that was not closed cleanly is discarded (the header's boot id). Imports no gRPC.
"""

from __future__ import annotations

import fcntl
import json
import logging
import mmap
import os
import struct
import zlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import torch

from fastdecode.kv.blocks import BlockAllocator, SeqBlocks
from fastdecode.runtime.errors import FailedPrecondition, ResourceExhausted

log = logging.getLogger("fastdecode.kv_attention")

MAGIC = b"FDKVPOOL"
VERSION = 1
HEADER_BYTES = 1 << 16
ALIGN = 2 << 20  # a huge page: the pools start on one
MAX_SLOTS = 1 << 14  # sequences a persistent pool tracks at once
_FRAME = struct.Struct("<II")  # payload length, crc32
COMPACT_BYTES = 8 << 20  # the journal is rewritten as a snapshot past this (and 4x the last snapshot)


class PoolCorrupt(Exception):
    """The files do not describe a consistent pool: it is discarded, never read."""


def boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


@dataclass
class SeqRecord:
    seq_id: str
    hashes: list[bytes]
    blocks: list[int] = field(default_factory=list)
    more: list[list[int]] = field(default_factory=list)
    dead: list[int] = field(default_factory=list)
    frozen: int = 0
    gfrozen: list[int] = field(default_factory=list)


@dataclass
class JournalState:
    """What replaying a journal gives: live sequences by slot, each group's cached prefix blocks
    (block -> name, oldest first) and the model the pool's KV was computed by."""

    seqs: dict[int, SeqRecord] = field(default_factory=dict)
    prefixes: dict[int, dict[int, bytes]] = field(default_factory=dict)
    model: str = ""

    def apply(self, rec: list[Any]) -> None:
        kind = rec[0]
        if kind == "A":
            self.seqs[rec[1]] = SeqRecord(rec[2], list(rec[3]))
        elif kind == "S":
            s = self.seqs[rec[1]]
            s.blocks, s.more, s.dead, s.frozen, s.gfrozen = rec[2], rec[3], rec[4], rec[5], rec[6]
        elif kind == "D":
            self.seqs.pop(rec[1], None)
        elif kind == "P":
            self.prefixes.setdefault(rec[1], {})[rec[3]] = rec[2]
        elif kind == "U":
            self.prefixes.get(rec[1], {}).pop(rec[2], None)
        elif kind == "M":
            self.model = rec[1]
        else:
            raise PoolCorrupt(f"unknown journal record {kind!r}")


def read_journal(path: Path) -> tuple[JournalState, int]:
    """Replay the journal: its state and the bytes of whole, intact frames (a torn tail ends it)."""
    state, good = JournalState(), 0
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return state, 0
    while good + _FRAME.size <= len(data):
        n, crc = _FRAME.unpack_from(data, good)
        body = data[good + _FRAME.size : good + _FRAME.size + n]
        if len(body) < n or zlib.crc32(body) != crc:
            break
        try:
            for rec in msgpack.unpackb(body, use_list=True):
                state.apply(rec)
        except (ValueError, KeyError, IndexError, TypeError, msgpack.ExtraData) as e:
            raise PoolCorrupt(f"journal record unreadable: {e}") from None
        good += _FRAME.size + n
    return state, good


@dataclass(frozen=True)
class Layout:
    """Where everything lies in the pool file, from the pool's shapes."""

    identity: dict[str, Any]  # dtype, block size, blocks, geometry: a pool of another is discarded
    num_layers: int
    shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]  # k, v, k_scale, v_scale

    def offsets(self) -> tuple[dict[str, int], int]:
        at, out = HEADER_BYTES, {}
        for name, shape in (("lengths", (MAX_SLOTS, self.num_layers)), ("flying", (MAX_SLOTS, 2))):
            out[name] = at
            at += 4 * shape[0] * shape[1]
        for name, (shape, dtype) in self.shapes.items():
            at = -(-at // ALIGN) * ALIGN
            out[name] = at
            n = 1
            for d in shape:
                n *= d
            at += n * dtype.itemsize
        return out, at


class PoolFile:
    """The mapped pool file and its journal; `recovered` is the state found there (None: new)."""

    def __init__(self, base: Path, layout: Layout) -> None:
        self.path, self.log_path = base.with_suffix(".kv"), base.with_suffix(".log")
        self.layout = layout
        offsets, size = layout.offsets()
        base.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        # One process per pool: a second shard on the same files is refused, never interleaved. The
        # lock is on a file of its own (the mapping holds a duplicate of the pool's descriptor).
        lock = os.open(base.with_suffix(".lock"), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(lock)
            raise FailedPrecondition(
                f"KV pool {self.path} is in use by another process (two shards on one --kv-dir and id?)"
            ) from None
        self._lock = lock
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        header = _read_header(self.path)
        self.recovered: JournalState | None = None
        self.discarded = ""
        if header is not None:
            why = _mismatch(header, layout.identity)
            if not why:
                try:
                    self.recovered, good = read_journal(self.log_path)
                    if self.log_path.exists():
                        os.truncate(self.log_path, good)  # a torn last frame goes
                except PoolCorrupt as e:
                    why = str(e)
            if why:
                self.discarded = why
                log.warning("KV pool %s discarded: %s", self.path, why)
                os.ftruncate(fd, 0)
                self.log_path.unlink(missing_ok=True)
        os.fchmod(fd, 0o600)  # a pool left by an older run keeps no wider mode
        try:
            # Every page taken now: a full tmpfs (an emptyDir's sizeLimit, a small /dev/shm) is this
            # one line at start, never a SIGBUS in the middle of a decode step.
            os.ftruncate(fd, size)
            os.posix_fallocate(fd, 0, size)
        except OSError as e:
            os.close(fd)
            raise ResourceExhausted(
                f"--kv-dir {base.parent} has no room for a KV pool of {size} bytes ({e.strerror}): "
                "lower --kv-capacity or give the directory more space"
            ) from None
        self._map = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
        os.close(fd)
        try:
            self._map.madvise(mmap.MADV_HUGEPAGE)  # huge pages where the tmpfs allows them
        except (AttributeError, OSError):
            pass
        self._write_header(clean=False)
        whole = torch.frombuffer(self._map, dtype=torch.uint8)
        n = MAX_SLOTS * layout.num_layers
        self.lengths = whole[offsets["lengths"] : offsets["lengths"] + 4 * n].view(torch.int32)
        self.lengths = self.lengths.view(MAX_SLOTS, layout.num_layers)
        self.flying = whole[offsets["flying"] : offsets["flying"] + 8 * MAX_SLOTS].view(torch.int32)
        self.flying = self.flying.view(MAX_SLOTS, 2)
        self.tensors: dict[str, torch.Tensor] = {}
        for name, (shape, dtype) in layout.shapes.items():
            nbytes = dtype.itemsize
            for d in shape:
                nbytes *= d
            raw = whole[offsets[name] : offsets[name] + nbytes]
            self.tensors[name] = raw.view(dtype).view(shape) if nbytes else torch.empty(shape, dtype=dtype)
        if self.recovered is None:
            self.lengths.zero_()
            self.flying.zero_()
            self.log_path.unlink(missing_ok=True)
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - held open for the pool's life
        os.chmod(self.log_path, 0o600)

    def _write_header(self, clean: bool) -> None:
        body = json.dumps({**self.layout.identity, "boot_id": boot_id(), "clean": clean}).encode()
        if len(MAGIC) + 4 + len(body) > HEADER_BYTES:
            raise PoolCorrupt("KV pool header too large")
        self._map[: len(MAGIC) + 4 + len(body)] = MAGIC + struct.pack("<I", len(body)) + body

    def append(self, records: list[list[Any]]) -> None:
        """One frame: written whole by one write(), or cut short by a kill and then ignored."""
        body = msgpack.packb(records, use_bin_type=True)
        self._log.write(_FRAME.pack(len(body), zlib.crc32(body)) + body)
        self._log.flush()

    def log_bytes(self) -> int:
        return self._log.tell()

    def rewrite(self, records: list[list[Any]]) -> None:
        """Replace the journal by a snapshot (write aside, then rename: never half of either)."""
        tmp = self.log_path.with_suffix(".log.tmp")
        body = msgpack.packb(records, use_bin_type=True)
        with open(tmp, "wb") as f:
            os.fchmod(f.fileno(), 0o600)
            f.write(_FRAME.pack(len(body), zlib.crc32(body)) + body)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.log_path)
        self._log.close()
        self._log = open(self.log_path, "ab")  # noqa: SIM115

    def close(self) -> None:
        """A clean stop: everything on its backing store and the header marked clean."""
        self._map.flush()
        self._write_header(clean=True)
        self._map.flush()
        self.detach()

    def detach(self) -> None:
        """Let go of the files as a killed process would: nothing written, the lock released."""
        self._log.close()
        if self._lock >= 0:
            os.close(self._lock)
            self._lock = -1

    def remove(self) -> None:
        PoolFile.remove_files(self.path)

    @staticmethod
    def remove_files(base: Path) -> None:
        for suffix in (".kv", ".log", ".log.tmp", ".lock"):
            base.with_suffix(suffix).unlink(missing_ok=True)


def _read_header(path: Path) -> dict[str, Any] | None:
    try:
        with open(path, "rb") as f:
            head = f.read(HEADER_BYTES)
    except FileNotFoundError:
        return None
    if not head.strip(b"\0"):
        return None  # created (its room taken: take_room), never written
    if len(head) < len(MAGIC) + 4 or not head.startswith(MAGIC):
        return {}
    (n,) = struct.unpack_from("<I", head, len(MAGIC))
    try:
        return json.loads(head[len(MAGIC) + 4 : len(MAGIC) + 4 + n])
    except ValueError:
        return {}


def _mismatch(header: dict[str, Any], identity: dict[str, Any]) -> str:
    """Why a pool on file may not be reused by this shard ('' when it may)."""
    if not header:
        return "not a KV pool file (no header)"
    for key, want in identity.items():
        if header.get(key) != want:
            return f"{key} is {header.get(key)!r}, this shard's is {want!r}"
    if not header.get("clean") and header.get("boot_id") != boot_id():
        return "the host restarted since it was written and it was not closed cleanly"
    return ""


SLACK_BYTES = 32 << 20  # beyond the pool: header, positions (16384 slots x layers x 4), alignment


def take_room(base: Path, capacity: int) -> None:
    """Allocate the pool file's pages before the shard serves: at its first reservation (when the
    geometry is known) it is only cut to size, so a large pool's allocation never runs inside a
    Reserve the scheduler waits for. ResourceExhausted when the directory has no room."""
    base.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = base.with_suffix(".kv")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.posix_fallocate(fd, 0, capacity + SLACK_BYTES)
    except OSError as e:
        raise ResourceExhausted(
            f"--kv-dir {base.parent} has no room for a KV pool of {capacity + SLACK_BYTES} bytes "
            f"({e.strerror}): lower --kv-capacity or give the directory more space"
        ) from None
    finally:
        os.close(fd)


def pool_header(base: Path) -> dict[str, Any] | None:
    """The header of the pool file at `base` (None: no file; {}: not a pool)."""
    return _read_header(base.with_suffix(".kv"))


class Journal:
    """The store's writes to its journal and its position arrays (see the module's order)."""

    def __init__(self, pool: PoolFile, num_groups: int) -> None:
        self.pool = pool
        self.lengths, self.flying = pool.lengths, pool.flying
        self.num_groups = num_groups
        self.slot_of: dict[int, int] = {}  # id(SeqBlocks) -> slot
        self.free_slots = list(range(MAX_SLOTS - 1, -1, -1))
        self._pending: list[list[Any]] = []
        self._dirty: dict[int, SeqBlocks] = {}
        self._item: torch.Tensor | None = None
        self._snapshot_bytes = 0

    def added(self, seq_id: str, seq: SeqBlocks) -> None:
        if not self.free_slots:
            raise ResourceExhausted(f"a persistent KV pool tracks at most {MAX_SLOTS} sequences")
        slot = self.free_slots.pop()
        # The slot's row is written while the journal says the slot is free (its last holder's drop
        # flushed first), then the journal names its new holder: a kill between the two leaves a
        # free slot with a row nobody reads, never a sequence with its predecessor's positions.
        self.flush()
        self.flying[slot] = 0
        self.lengths[slot] = torch.tensor(seq.lengths, dtype=torch.int32)
        self.slot_of[id(seq)] = slot
        self._pending.append(["A", slot, seq_id, seq.hashes])
        self._dirty[id(seq)] = seq
        self.flush()

    def dropped(self, seq: SeqBlocks) -> None:
        slot = self.slot_of.pop(id(seq), None)
        if slot is None:
            return
        self._dirty.pop(id(seq), None)
        self._pending.append(["D", slot])
        self.free_slots.append(slot)

    def changed(self, seq: SeqBlocks) -> None:
        if id(seq) in self.slot_of:
            self._dirty[id(seq)] = seq

    def prefix(self, group: int, kind: str, name: bytes | None, block: int) -> None:
        self._pending.append(["P", group, name, block] if kind == "P" else ["U", group, block])

    def model(self, model: str) -> None:
        self._pending.append(["M", model])
        self.flush()

    def flush(self) -> None:
        for key, seq in self._dirty.items():
            self._pending.append(
                ["S", self.slot_of[key], seq.blocks, seq.more, seq.dead, seq.frozen, seq.gfrozen]
            )
        self._dirty.clear()
        if self._pending:
            self.pool.append(self._pending)
            self._pending = []

    def begin(self, layer: int, seqs: list[SeqBlocks], ends: list[int]) -> None:
        """Before an item's appends: its tables on the journal, its sequences marked in flight."""
        self.flush()
        slots = torch.tensor([self.slot_of[id(s)] for s in seqs], dtype=torch.int64)
        self._item = slots
        self.flying[slots] = torch.tensor([[layer + 1, e] for e in ends], dtype=torch.int32)

    def commit(self, layer: int, ends: list[int]) -> None:
        """After the appends: the new positions committed, the marks cleared."""
        slots, self._item = self._item, None
        if slots is None:
            return
        self.lengths[slots, layer] = torch.tensor(ends, dtype=torch.int32)
        self.flying[slots, 0] = 0

    def sync(self, seq: SeqBlocks) -> None:
        """Every layer's position of one sequence (a write, fill, truncate or import)."""
        self.flush()
        slot = self.slot_of.get(id(seq))
        if slot is not None:
            self.lengths[slot] = torch.tensor(seq.lengths, dtype=torch.int32)

    def compact(self, store: Any, force: bool = False) -> None:
        """Rewrite the journal as the store's state now, when it has grown (or `force`)."""
        self.flush()
        size = self.pool.log_bytes()
        if not force and size < max(COMPACT_BYTES, 4 * self._snapshot_bytes):
            return
        recs: list[list[Any]] = [["M", store.model]] if store.model else []
        for g, cache in enumerate(store.prefixes):
            recs += [["P", g, h, b] for b, h in cache.entries()]
        for sid, seq in store.seqs.items():
            slot = self.slot_of[id(seq)]
            recs.append(["A", slot, sid, seq.hashes])
            recs.append(["S", slot, seq.blocks, seq.more, seq.dead, seq.frozen, seq.gfrozen])
        self.pool.rewrite(recs)
        self._snapshot_bytes = self.pool.log_bytes()


@dataclass
class Reattached:
    """What a restarted shard found in its pool: sequences (id -> committed position), the
    positions appends in flight were writing when it stopped (computed again), and prefix blocks."""

    positions: dict[str, int] = field(default_factory=dict)
    torn_positions: int = 0
    torn_sequences: int = 0
    prefix_blocks: int = 0


def restore(store: Any, pool: PoolFile, state: JournalState, journal: Journal) -> Reattached:
    """Rebuild the store's sequences, prefix caches and free blocks from a replayed journal and the
    committed positions. PoolCorrupt when they contradict each other (the caller discards)."""
    bs, nb, groups = store.block_size, store.num_blocks, store.num_groups
    grouped = store.grouped
    used: set[int] = set()
    readers: Counter[tuple[int, int]] = Counter()
    caches = {g: state.prefixes.get(g, {}) for g in range(groups)}
    if caches and any(caches.values()) and not store.prefixes:
        raise PoolCorrupt("prefix blocks in a pool without prefix sharing")
    for cache in caches.values():
        for b in cache:
            if not 0 <= b < nb or b in used:
                raise PoolCorrupt(f"prefix block {b} out of range or cached twice")
            used.add(b)
    out = Reattached(prefix_blocks=len(used))
    lengths = pool.lengths.tolist()
    flying = pool.flying.tolist()
    seen: set[str] = set()
    for slot, rec in state.seqs.items():
        if rec.seq_id in seen or not rec.blocks and not grouped:
            raise PoolCorrupt(f"sequence {rec.seq_id!r} twice or without blocks")
        seen.add(rec.seq_id)
        tables = [rec.blocks, *rec.more]
        if len(tables) != groups:
            raise PoolCorrupt(f"sequence {rec.seq_id!r} has {len(tables)} block tables, not {groups}")
        for g, tab in enumerate(tables):
            cached = rec.gfrozen[g] if grouped else rec.frozen
            for i, b in enumerate(tab):
                if b < 0:
                    continue
                if i < cached:
                    if b not in caches[g]:
                        raise PoolCorrupt(f"sequence {rec.seq_id!r} reads block {b}, which is not cached")
                    readers[(g, b)] += 1
                elif not 0 <= b < nb or b in used:
                    raise PoolCorrupt(f"block {b} of {rec.seq_id!r} out of range or held twice")
                else:
                    used.add(b)
        held = lengths[slot]
        for layer, n in enumerate(held):
            if not 0 <= n <= len(tables[store._group_of[layer]]) * bs:
                raise PoolCorrupt(f"sequence {rec.seq_id!r} holds {n} positions on layer {layer}")
        # Resumed where every layer holds it: past that, an append in flight or a step cut between
        # its layers (`torn`) is computed again.
        low, (layer_plus, end) = min(held), flying[slot]
        torn = max(max(held), end if layer_plus else 0) - low
        out.torn_sequences += torn > 0
        out.torn_positions += torn
        held = [low] * len(held)
        pool.lengths[slot] = low
        seq = SeqBlocks([], 0, held, True, hashes=rec.hashes, frozen=rec.frozen)
        seq.more, seq.dead, seq.gfrozen = rec.more, rec.dead, rec.gfrozen
        store._set_blocks(seq, rec.blocks)
        store.seqs[rec.seq_id] = seq
        journal.slot_of[id(seq)] = slot
        journal.free_slots.remove(slot)
        out.positions[rec.seq_id] = low
    for g, cache in caches.items():
        for b, h in cache.items():
            store.prefixes[g].restore(h, b, readers[(g, b)])
    store.alloc = BlockAllocator.without(nb, used)
    store.model = state.model
    pool.flying.zero_()
    return out
