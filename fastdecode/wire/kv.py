"""kv_attention.proto's data: an Attend item both ways, a sequence's KV in migration chunks, and the
shard's stats. The control messages the scheduler speaks (geometry, reservations, reattach, the
stats read back) are fastdecode.wire.kv_control, which loads no torch.

The shard's side of an Attend item stays close to the bytes: `attend_batch` decodes q, k and v as
views of the message's bytes (codec.decode, no copy), and services/kv_attention serializes o straight
into the answer's bytes (codec.serialize_with): the item is the latency every decode step pays once
per layer, and the message is the cheapest form it has. Errors travel as an in-band ItemError built
and read by fastdecode.runtime.rpc (`item_error`, `error_from_item`)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import torch
from google.protobuf.message import DecodeError

from fastdecode.kv.attend import AttendBatch
from fastdecode.kv.shard import LayerRows, SequenceHeader, ShardCore
from fastdecode.runtime import codec
from fastdecode.runtime.errors import InvalidInput
from fastdecode.v1 import kv_attention_pb2 as kv_pb
from fastdecode.wire.kv_control import geometry_from_proto, geometry_to_proto


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


# ---- the shard's stats (read back by fastdecode.wire.kv_control) -------------------------------------
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
