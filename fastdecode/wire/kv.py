"""kv_attention.proto: an Attend item both ways, a sequence's KV in migration chunks, the shard's
stats and the scheduler's reservations.

The shard's side of an Attend item stays close to the bytes: `attend_batch` decodes q, k and v as
views of the message's bytes (codec.decode, no copy), and services/kv_attention serializes o straight
into the answer's bytes (codec.serialize_with): the item is the latency every decode step pays once
per layer, and the message is the cheapest form it has. Errors travel as an in-band ItemError built
and read by fastdecode.runtime.rpc (`item_error`, `error_from_item`)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence

import torch
from google.protobuf.message import DecodeError

from fastdecode.kv.attend import AttendBatch
from fastdecode.kv.shard import LayerRows, SequenceHeader, ShardCore
from fastdecode.runtime import codec
from fastdecode.runtime.errors import InvalidInput
from fastdecode.runtime.geometry import MAX_KV_LAYERS, KVGeometry
from fastdecode.scheduling.ports import ReattachResult, ShardState
from fastdecode.scheduling.types import Reservation
from fastdecode.v1 import kv_attention_pb2 as kv_pb


def item_fields(batch: AttendBatch) -> bytes:
    """The AttendRequest fields an item keeps over a step's layers (its sequences), as wire bytes."""
    return kv_pb.AttendRequest(
        seq_ids=batch.seq_ids, num_tokens=batch.num_tokens, start_pos=batch.start_pos
    ).SerializeToString()


def attend_request(layer: int, batch: AttendBatch, request_id: int, fields: bytes | None = None) -> bytes:
    """One item's AttendRequest as wire bytes, q, k and v encoded straight into them (one copy).
    `fields`: item_fields(batch), when the caller keeps them for the item's next layers."""
    head = kv_pb.AttendRequest(request_id=request_id, layer=layer)
    prefix = item_fields(batch) if fields is None else fields
    return codec.serialize_with(head, prefix, q=batch.q, k=batch.k, v=batch.v)


def parse_response(data: bytes) -> tuple[kv_pb.AttendResponse, torch.Tensor | None]:
    """An AttendResponse's wire bytes: the message without o, and o aliasing `data` (read-only).

    FromString copies o's bytes into the message and reading `.data` copies them again; at a GPU
    host's sizes (2 MB of o per layer at Llama-3-8B B=256 bf16) those two copies were a third of
    the dense side's CPU per layer."""
    rest, o = codec.split_field(data, kv_pb.AttendResponse.DESCRIPTOR.fields_by_name["o"].number)
    try:
        head = kv_pb.AttendResponse.FromString(rest)
    except DecodeError as e:
        raise InvalidInput(f"malformed AttendResponse: {e}") from None
    return head, (codec.decode_wire(o) if o is not None else None)


def attend_batch(req: kv_pb.AttendRequest) -> AttendBatch:
    """The shard's side of an item: q, k and v as views of the message's bytes."""
    return AttendBatch(
        list(req.seq_ids),
        list(req.num_tokens),
        list(req.start_pos),
        codec.decode(req.q),
        codec.decode(req.k),
        codec.decode(req.v),
    )


# ---- live migration ---------------------------------------------------------------------------------
def export_chunks(core: ShardCore, seq_id: str, tokens: int = 0) -> Iterator[kv_pb.KVChunk]:
    """One sequence's KV (its first `tokens` positions; 0: all) as ImportSequence chunks: a header,
    then one chunk per layer. NotFound at once, before any chunk, when the sequence is not held here."""
    header, layers = core.export_sequence(seq_id, tokens)
    return _chunks(header, layers)


def _chunks(header: SequenceHeader, layers: Iterator[LayerRows]) -> Iterator[kv_pb.KVChunk]:
    yield kv_pb.KVChunk(
        seq_id=header.seq_id,
        geometry=geometry_to_proto(header.geometry),
        kv_dtype=codec.wire_dtype(header.dtype),
        tokens=header.tokens,
    )
    for layer in layers:
        chunk = kv_pb.KVChunk(seq_id=layer.seq_id, layer=layer.layer, first_token=layer.first)
        for name, t in zip(("k", "v", "k_scale", "v_scale"), layer.rows, strict=True):
            if t.numel():
                codec.encode(t, getattr(chunk, name))
        yield chunk


async def import_chunks(core: ShardCore, chunks: AsyncIterator[kv_pb.KVChunk]) -> tuple[int, int]:
    """Receive one sequence's chunks (header, then every layer) into `core`. Returns (tokens, bytes)."""
    header = await anext(chunks, None)
    if header is None or not header.seq_id or header.tokens < 1:
        raise InvalidInput("an import starts with a header chunk naming the sequence and its tokens")
    geometry = geometry_from_proto(header.geometry)
    head = SequenceHeader(header.seq_id, geometry, codec.torch_dtype(header.kv_dtype), header.tokens)

    async def layers() -> AsyncIterator[LayerRows]:
        async for c in chunks:
            rows = [
                codec.decode(t) if t.ByteSize() else torch.empty(0) for t in (c.k, c.v, c.k_scale, c.v_scale)
            ]
            yield LayerRows(c.seq_id, c.layer, rows, c.first_token)

    return await core.import_sequence(head, layers())


# ---- geometry, stats and reservations ---------------------------------------------------------------
def geometry_from_proto(g: kv_pb.KVGeometry) -> KVGeometry:
    """A Reserve's or an import's geometry, the one way it leaves the wire. KVGeometry checks only
    what is cheap (windows against layers, signs); ShardCore checks every field and what its pool
    takes before allocating, so that (2^31-1)^3 is refused by its size. The windows are copied out
    only when there can be that many layers: a message may carry millions of them."""
    if len(g.layer_windows) > MAX_KV_LAYERS:
        raise InvalidInput(f"KV geometry: {len(g.layer_windows)} layer windows, at most {MAX_KV_LAYERS}")
    return KVGeometry(g.num_layers, g.num_kv_heads, g.head_dim, tuple(g.layer_windows), g.attn_logit_softcap)


def geometry_to_proto(geometry: KVGeometry) -> kv_pb.KVGeometry:
    """A geometry for a Reserve or a migration's header, the one way it goes on the wire."""
    return kv_pb.KVGeometry(
        num_layers=geometry.num_layers,
        num_kv_heads=geometry.num_kv_heads,
        head_dim=geometry.head_dim,
        layer_windows=geometry.layer_windows,
        attn_logit_softcap=geometry.attn_logit_softcap,
    )


def shard_stats_to_proto(shard_id: int, core: ShardCore) -> kv_pb.ShardStats:
    stats = kv_pb.ShardStats(
        shard_id=shard_id,
        kv_dtype=codec.wire_dtype(core.dtype),
        block_size=core.block_size,
        kv_persistent=core.persistent,
    )
    s = core.store
    if s is None:
        stats.bytes_capacity = core.kv_capacity  # no pool yet: its budget
        return stats
    stats.configured = True
    stats.sequences = len(s.seqs)
    stats.tokens_held = s.tokens_held
    stats.tokens_reserved = s.tokens_reserved
    stats.bytes_used = s.bytes_used
    stats.bytes_capacity = s.capacity_bytes
    stats.attention_busy_seconds = s.busy_seconds
    stats.attend_items = s.attend_calls
    stats.free_tokens = s.free_tokens
    stats.attended_token_pairs = core.attended_pairs
    stats.host_busy_seconds = core.host_busy_seconds
    stats.blocks_in_use, stats.blocks_free = s.blocks_in_use, s.blocks_free
    for name, value in s.prefix_stats.items():
        setattr(stats, f"prefix_{name}", value)
    return stats


def shard_state_from_proto(st: kv_pb.ShardStats) -> ShardState:
    """What the scheduler's driver reads of a shard's Stats."""
    return ShardState(
        sequences=st.sequences,
        configured=st.configured,
        free_tokens=st.free_tokens,
        tokens_reserved=st.tokens_reserved,
        bytes_capacity=st.bytes_capacity,
        kv_itemsize=codec.torch_dtype(st.kv_dtype).itemsize,
        block_size=st.block_size,
        # a shard hosted by gpu_dense shares its cores with the S-part: both count
        busy_seconds=st.attention_busy_seconds + st.host_busy_seconds,
        attended_pairs=st.attended_token_pairs,
        persistent=st.kv_persistent,
    )


def reattach_request(geometry: KVGeometry, model: str, keep: Sequence[str]) -> kv_pb.ReattachRequest:
    return kv_pb.ReattachRequest(geometry=geometry_to_proto(geometry), model=model, keep=list(keep))


def reattach_from_proto(r: kv_pb.ReattachResponse) -> ReattachResult:
    return ReattachResult(
        {s.seq_id: int(s.tokens) for s in r.sequences}, r.released, int(r.torn_positions), r.discarded
    )


def reserve_request(geometry: KVGeometry, seqs: Sequence[Reservation], model: str) -> kv_pb.ReserveRequest:
    return kv_pb.ReserveRequest(
        model=model,
        geometry=geometry_to_proto(geometry),
        sequences=[
            kv_pb.SequenceReservation(
                seq_id=s.seq_id, max_tokens=s.max_tokens, token_ids=s.token_ids, cache_salt=s.cache_salt
            )
            for s in seqs
        ],
    )
