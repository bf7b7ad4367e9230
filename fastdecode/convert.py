"""Proto messages to domain objects and back: one place per message family. Imports the generated
messages (protobuf) but no gRPC; the service adapters call it, the cores never see a proto.

One deliberate exception: the shard's parse of an Attend item. `fastdecode.shard.ShardCore.attend`
takes the AttendRequest message itself and attends on views of its bytes (q, k and v are decoded
without a copy, codec.decode): the item is the latency every decode step pays once per layer, and
the message is the cheapest form it has. Its other direction, `attend_request`, is here."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from fastdecode import codec
from fastdecode.gateway.core import BackendInfo, GenerationChunk, ModelCard
from fastdecode.gateway.text import GenerateParams, ValidRequest
from fastdecode.sampling import SamplingParams
from fastdecode.scheduling import PlannedSeq, Request, SchedulerStats, Step, TokenEvent
from fastdecode.v1 import dense_pb2, scheduler_pb2
from fastdecode.v1 import gateway_pb2 as gw_pb
from fastdecode.v1 import kv_attention_pb2 as kv_pb

if TYPE_CHECKING:  # annotations only: the gateway, which converts neither, loads no model or KV code
    from fastdecode.dense import AttendItem, Timings
    from fastdecode.model import ModelConfig
    from fastdecode.shard import ShardCore


# ---- sampling ---------------------------------------------------------------------------------------
def sampling_to_proto(s: SamplingParams) -> dense_pb2.SamplingParams:
    out = dense_pb2.SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k)
    if s.seed is not None:
        out.seed = s.seed
    return out


def sampling_from_proto(sp: dense_pb2.SamplingParams) -> SamplingParams:
    """An unset top_p (0 on the wire) means 1.0: no nucleus cut."""
    return SamplingParams(sp.temperature, sp.top_p or 1.0, sp.top_k, sp.seed if sp.HasField("seed") else None)


# ---- gateway <-> client -----------------------------------------------------------------------------
def params_from_proto(r: gw_pb.GenerateRequest) -> GenerateParams:
    which = r.WhichOneof("input")
    return GenerateParams(
        prompt=r.prompt if which == "prompt" else None,
        token_ids=list(r.token_ids.ids) if which == "token_ids" else None,
        max_tokens=r.max_tokens if r.HasField("max_tokens") else None,
        temperature=r.temperature if r.HasField("temperature") else None,
        top_p=r.top_p if r.HasField("top_p") else None,
        top_k=r.top_k if r.HasField("top_k") else None,
        seed=r.seed if r.HasField("seed") else None,
        stop=list(r.stop),
        stop_token_ids=list(r.stop_token_ids),
        ignore_eos=r.ignore_eos,
    )


# ---- gateway <-> scheduler --------------------------------------------------------------------------
def submit_request(request_id: str, v: ValidRequest, sample_offset: int = 0) -> scheduler_pb2.SubmitRequest:
    return scheduler_pb2.SubmitRequest(
        sample_index_offset=sample_offset,
        request_id=request_id,
        prompt_token_ids=v.prompt_ids,
        max_tokens=v.max_tokens,
        sampling=sampling_to_proto(SamplingParams(v.temperature, v.top_p, v.top_k, v.seed)),
        stop_token_ids=list(v.stop_token_ids),
        ignore_eos=v.ignore_eos,
    )


def request_from_submit(seq_id: str, r: scheduler_pb2.SubmitRequest) -> Request:
    return Request(
        seq_id=seq_id,
        prompt=list(r.prompt_token_ids),
        max_tokens=r.max_tokens,
        sampling=sampling_from_proto(r.sampling),
        stop_token_ids=frozenset(r.stop_token_ids),
        ignore_eos=r.ignore_eos,
        sample_offset=r.sample_index_offset,
    )


def token_event_to_proto(ev: TokenEvent) -> scheduler_pb2.TokenEvent:
    return scheduler_pb2.TokenEvent(
        token_ids=ev.token_ids,
        logprobs=ev.logprobs,
        finish_reason=ev.finish_reason or "",
        prompt_tokens=ev.prompt_tokens,
        completion_tokens=ev.completion_tokens,
        step=ev.step,
        shard=ev.shard,
    )


# ---- scheduler <-> gpu_dense ------------------------------------------------------------------------
def step_plan(step: Step, pipeline: bool) -> dense_pb2.StepPlan:
    plan = dense_pb2.StepPlan(step=step.step, pipeline=pipeline)
    for p in step.seqs:
        plan.sequences.add(
            seq_id=p.seq_id,
            shard=p.shard,
            mini_batch=p.mini_batch,
            token_ids=p.token_ids,
            start_pos=p.start_pos,
            sampling=sampling_to_proto(p.sampling),
            sample=p.sample,
            sample_index=p.sample_index,
        )
    return plan


def planned_seqs_from_proto(plan: dense_pb2.StepPlan) -> list[PlannedSeq]:
    return [
        PlannedSeq(
            seq_id=p.seq_id,
            shard=p.shard,
            mini_batch=p.mini_batch,
            token_ids=list(p.token_ids),
            start_pos=p.start_pos,
            sampling=sampling_from_proto(p.sampling),
            sample=p.sample,
            sample_index=p.sample_index,
        )
        for p in plan.sequences
    ]


def timings_to_proto(t: Timings) -> dense_pb2.StepTimings:
    return dense_pb2.StepTimings(
        s_part_seconds=t.s_part_seconds,
        shard_wait_seconds=t.shard_wait_seconds,
        step_seconds=t.step_seconds,
        attend_seconds=t.attend_seconds,
        overlap_ratio=t.overlap_ratio,
    )


def model_info_to_proto(
    c: ModelConfig, model_path: str, dtype: str, device: str, shards: Sequence[str]
) -> dense_pb2.ModelInfo:
    """gpu_dense's Info: the model it serves and the shards it attends on."""
    info = dense_pb2.ModelInfo(
        model_type=c.model_type,
        model_path=model_path,
        num_layers=c.num_hidden_layers,
        num_heads=c.num_attention_heads,
        num_kv_heads=c.num_key_value_heads,
        head_dim=c.head_dim,
        hidden_size=c.hidden_size,
        vocab_size=c.vocab_size,
        max_position_embeddings=c.max_position_embeddings,
        eos_token_ids=list(c.eos_token_ids),
        dtype=dtype,
        device=device,
        num_shards=len(shards),
        shards=list(shards),
    )
    if c.bos_token_id is not None:
        info.bos_token_id = c.bos_token_id
    return info


# ---- scheduler <-> gateway, operators ---------------------------------------------------------------
def backend_info_from_proto(info: dense_pb2.ModelInfo) -> BackendInfo:
    return BackendInfo(info.model_type, info.vocab_size, info.num_shards, info.device)


def scheduler_stats_to_proto(
    st: SchedulerStats, addresses: Sequence[str], not_ready_reason: str | None
) -> scheduler_pb2.SchedulerStats:
    """`addresses[i]` is shard i's address."""
    out = scheduler_pb2.SchedulerStats(
        running=st.running,
        waiting=st.waiting,
        steps=st.steps,
        finished=st.finished,
        recoveries=st.recoveries,
        preemptions=st.preemptions,
        kv_load_tokens=st.kv_load_tokens,
        w_limit=st.w_limit or 0.0,
        admission=st.admission,
        not_ready_reason=not_ready_reason or "",
    )
    for sh in st.shards:
        out.shards.add(
            shard=sh.shard,
            address=addresses[sh.shard],
            healthy=sh.healthy,
            sequences=sh.sequences,
            tokens=sh.tokens,
            expected_tokens=sh.expected_tokens,
            capacity_tokens=sh.capacity_tokens,
            block_tokens=sh.reserved_tokens,
        )
    return out


# ---- gateway -> client ------------------------------------------------------------------------------
def chunk_to_proto(c: GenerationChunk) -> gw_pb.GenerateResponse:
    resp = gw_pb.GenerateResponse(text=c.text, token_ids=c.token_ids)
    if c.finish_reason:
        resp.finish_reason = c.finish_reason
        resp.usage.prompt_tokens = c.prompt_tokens
        resp.usage.completion_tokens = c.completion_tokens
    return resp


def model_card_to_proto(m: ModelCard) -> gw_pb.GetModelInfoResponse:
    return gw_pb.GetModelInfoResponse(
        model_type=m.model_type,
        model_name=m.model_name,
        vocab_size=m.vocab_size,
        max_context=m.max_context,
        eos_token_ids=m.eos_token_ids,
        num_shards=m.num_shards,
        device=m.device,
    )


# ---- gpu_dense <-> kv_attention ---------------------------------------------------------------------
def attend_request(layer: int, item: AttendItem, request_id: int) -> bytes:
    """One item's AttendRequest as wire bytes, q, k and v encoded straight into them (one copy)."""
    head = kv_pb.AttendRequest(
        request_id=request_id,
        layer=layer,
        seq_ids=item.seq_ids,
        num_tokens=item.num_tokens,
        start_pos=item.start_pos,
    )
    return codec.serialize_with(head, q=item.q, k=item.k, v=item.v)


def shard_stats_to_proto(shard_id: int, core: ShardCore) -> kv_pb.ShardStats:
    stats = kv_pb.ShardStats(
        shard_id=shard_id, kv_dtype=codec.wire_dtype(core.dtype), block_size=core.block_size
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
    stats.blocks_in_use, stats.blocks_free = s.blocks_in_use, s.blocks_free
    return stats
