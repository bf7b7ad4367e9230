"""The control messages between gpu_dense and its exchange workers (over a Unix socket, framed by
transport.frame). Tensors never travel here: q, k, v and o sit in shared-memory arenas, and a
message names their slices (`Slice.astuple()`: offset, shape, dtype).

On the socket they are protobuf (protos/fastdecode/v1/exchange.proto), so that the native worker
(native/) speaks them too; here they are named tuples, and `pack`/`unpack` are the one place that
converts."""

from __future__ import annotations

from typing import Any, NamedTuple

from fastdecode.runtime.codec import varint
from fastdecode.runtime.errors import InvalidInput
from fastdecode.runtime.fleet_secret import FleetSecret
from fastdecode.v1 import exchange_pb2 as pb
from services.gpu_dense.exchange.transport import frame

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
    not_before_ns: int = 0  # CLOCK_MONOTONIC (time.monotonic_ns): send nothing before (0: now)


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


class Sync(NamedTuple):
    """Answer Synced(n) once every control message before this one is applied."""

    n: int


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


class Synced(NamedTuple):
    n: int


# ---- the wire (exchange.proto) ------------------------------------------------------------
ToWorker = Secret | Attend | Cancel | AddShard | RemoveShard | RestoreShard | Sync
ToDense = Ready | Done | Synced


def _slice(s: SliceTuple) -> pb.ArenaSlice:
    return pb.ArenaSlice(offset=s[0], shape=s[1], dtype=s[2])


def _tuple(s: pb.ArenaSlice) -> SliceTuple:
    return (s.offset, tuple(s.shape), s.dtype)


def pack(msg: ToWorker | ToDense) -> bytes:
    """One message, framed for the control socket."""
    match msg:
        case Attend():
            items = [
                pb.ExchangeItem(
                    shard=it.shard,
                    seq_ids=it.seq_ids,
                    num_tokens=it.num_tokens,
                    start_pos=it.start_pos,
                    q=_slice(it.q),
                    k=_slice(it.k),
                    v=_slice(it.v),
                    o_offset=it.o_offset,
                    o_room=it.o_room,
                )
                for it in msg.items or ()
            ]
            attend = pb.ExchangeAttend(
                rid=msg.rid,
                slot=msg.slot,
                layer=msg.layer,
                arena=msg.arena,
                has_items=msg.items is not None,
                items=items,
                not_before_ns=msg.not_before_ns,
            )
            out: Any = pb.ToWorker(attend=attend)
        case Done():
            results = [
                pb.ExchangeResult(o=_slice(r.o))
                if isinstance(r, Ok)
                else pb.ExchangeResult(status=r.status, text=r.text)
                for r in msg.results
            ]
            out = pb.ToDense(done=pb.ToDense.Done(rid=msg.rid, results=results))
        case Secret():
            out = pb.ToWorker(secret=pb.ToWorker.Secret(send=msg.secret.send if msg.secret else ""))
        case Cancel():
            out = pb.ToWorker(cancel=msg.rid)
        case AddShard():
            out = pb.ToWorker(add_shard=pb.ExchangeShard(index=msg.index, address=msg.address))
        case RemoveShard():
            out = pb.ToWorker(remove_shard=msg.index)
        case RestoreShard():
            out = pb.ToWorker(restore_shard=msg.index)
        case Sync():
            out = pb.ToWorker(sync=msg.n)
        case Ready():
            out = pb.ToDense(ready=msg.pid)
        case Synced():
            out = pb.ToDense(synced=msg.n)
    return frame(out.SerializeToString())


def attend_frame(rid: int, slot: int, layer: int, arena: str, not_before_ns: int = 0) -> bytes:
    """pack(Attend(rid, slot, layer, arena, None, not_before_ns)) written directly (a step's later
    layers carry no items): ToWorker.attend (field 2) with its set fields in number order, as
    protobuf writes them, at a fifth of its cost on the per-layer path."""
    body = b"\x08" + varint(rid)
    if slot:
        body += b"\x10" + varint(slot)
    if layer:
        body += b"\x18" + varint(layer)
    name = arena.encode()
    body += b"\x22" + varint(len(name)) + name
    if not_before_ns:
        body += b"\x38" + varint(not_before_ns)
    return frame(b"\x12" + varint(len(body)) + body)


def unpack_to_worker(body: bytes) -> ToWorker:
    m = pb.ToWorker.FromString(body)
    kind = m.WhichOneof("kind")
    if kind == "attend":
        a = m.attend
        items = None
        if a.has_items:
            items = [
                ItemSlices(
                    it.shard,
                    list(it.seq_ids),
                    list(it.num_tokens),
                    list(it.start_pos),
                    _tuple(it.q),
                    _tuple(it.k),
                    _tuple(it.v),
                    it.o_offset,
                    it.o_room,
                )
                for it in a.items
            ]
        return Attend(a.rid, a.slot, a.layer, a.arena, items, a.not_before_ns)
    if kind == "secret":
        send = m.secret.send
        return Secret(FleetSecret(send, (send.encode(),)) if send else None)
    if kind == "cancel":
        return Cancel(m.cancel)
    if kind == "add_shard":
        return AddShard(m.add_shard.index, m.add_shard.address)
    if kind == "remove_shard":
        return RemoveShard(m.remove_shard)
    if kind == "restore_shard":
        return RestoreShard(m.restore_shard)
    if kind == "sync":
        return Sync(m.sync)
    raise InvalidInput(f"unknown control message {kind}")


def unpack_to_dense(body: bytes) -> ToDense:
    m = pb.ToDense.FromString(body)
    kind = m.WhichOneof("kind")
    if kind == "done":
        results: list[Ok | Err] = [
            Err(r.status, r.text) if r.status else Ok(_tuple(r.o)) for r in m.done.results
        ]
        return Done(m.done.rid, results)
    if kind == "ready":
        return Ready(m.ready)
    if kind == "synced":
        return Synced(m.synced)
    raise InvalidInput(f"unknown worker message {kind}")


def _varint(body: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = body[pos]
        value |= (byte & 0x7F) << shift
        pos += 1
        if byte < 0x80:
            return value, pos
        shift += 7


class DoneReader:
    """unpack_to_dense with a memo of answers: a step's layers come back in the same slices, so a
    Done whose results are byte for byte ones seen before (its rid aside) reuses their tuples
    (parsing them was a tenth of the dense loop's own CPU). Both workers write the fields in number
    order, ToDense.done (tag 0x12) then Done.rid (0x08) first; anything else is parsed in full."""

    def __init__(self, size: int = 64) -> None:
        self.size = size
        self._seen: dict[bytes, list[Ok | Err]] = {}

    @staticmethod
    def _split(body: bytes) -> tuple[int, bytes] | None:
        try:
            if body[0] != 0x12:
                return None
            _, pos = _varint(body, 1)
            if body[pos] != 0x08:
                return None
            rid, pos = _varint(body, pos + 1)
        except IndexError:
            return None
        return rid, body[pos:]

    def __call__(self, body: bytes) -> ToDense:
        split = self._split(body)
        if split is not None and (seen := self._seen.get(split[1])) is not None:
            return Done(split[0], seen)
        msg = unpack_to_dense(body)
        if (
            split is not None
            and isinstance(msg, Done)
            and msg.rid == split[0]
            and all(isinstance(r, Ok) for r in msg.results)
        ):
            if len(self._seen) >= self.size:
                self._seen.clear()
            self._seen[split[1]] = msg.results
        return msg
