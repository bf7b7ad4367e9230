"""kv_attention.proto's control messages: the KV geometry, a shard's stats and the scheduler's
reservations and reattaches. No torch: the scheduler speaks these and loads no tensor code (the item
and migration halves are fastdecode.wire.kv)."""

from __future__ import annotations

from collections.abc import Sequence

from fastdecode.runtime.errors import InvalidInput
from fastdecode.runtime.geometry import MAX_KV_LAYERS, KVGeometry
from fastdecode.scheduling.ports import ReattachResult, ShardState
from fastdecode.scheduling.types import Reservation
from fastdecode.v1 import kv_attention_pb2 as kv_pb
from fastdecode.v1 import tensor_pb2

# bytes per element of each KV dtype a shard reports (fastdecode.runtime.codec maps them to torch)
WIRE_ITEMSIZE: dict[int, int] = {
    tensor_pb2.FLOAT32: 4,
    tensor_pb2.FLOAT16: 2,
    tensor_pb2.BFLOAT16: 2,
    tensor_pb2.INT8: 1,
    tensor_pb2.UINT8: 1,
    tensor_pb2.FLOAT8_E4M3: 1,
}


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


def _itemsize(wire: int) -> int:
    try:
        return WIRE_ITEMSIZE[wire]
    except KeyError:
        raise InvalidInput(f"a shard reported KV dtype {wire}, which no KV pool holds") from None


def shard_state_from_proto(st: kv_pb.ShardStats) -> ShardState:
    """What the scheduler's driver reads of a shard's Stats."""
    return ShardState(
        sequences=st.sequences,
        configured=st.configured,
        free_tokens=st.free_tokens,
        tokens_reserved=st.tokens_reserved,
        bytes_capacity=st.bytes_capacity,
        kv_itemsize=_itemsize(st.kv_dtype),
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
