"""Proto messages to domain objects and back: one place per message family. Imports the generated
messages (protobuf) but no gRPC; the service adapters call it, the cores never see a proto.

One deliberate exception: the shard's side of an Attend item. `fastdecode.kv.shard.ShardCore.attend`
takes the AttendRequest message itself and attends on views of its bytes (q, k and v are decoded
without a copy, codec.decode), and services/kv_attention serializes o straight into the answer's
bytes (codec.serialize_with): the item is the latency every decode step pays once per layer, and the
message is the cheapest form it has. gpu_dense's side, `attend_request`, is here. Errors travel as
an in-band ItemError built and read by fastdecode.runtime.rpc (`item_error`, `error_from_item`), next to the
error tables."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING

from google.protobuf.message import DecodeError

from fastdecode.dense.sampling import SamplingParams, TokenLogprob
from fastdecode.dense.structured import Structured
from fastdecode.gateway.core import BackendInfo, GenerationChunk, ModelCard
from fastdecode.gateway.text import GenerateParams, ValidRequest
from fastdecode.runtime import codec
from fastdecode.runtime.errors import InvalidInput
from fastdecode.scheduling import PlannedSeq, Request, SchedulerStats, Step, TokenEvent
from fastdecode.scheduling.types import RemoveResult
from fastdecode.v1 import dense_pb2, scheduler_pb2
from fastdecode.v1 import gateway_pb2 as gw_pb
from fastdecode.v1 import kv_attention_pb2 as kv_pb

if TYPE_CHECKING:  # annotations only: the gateway, which converts neither, loads no model or KV code
    import torch

    from fastdecode.dense import AttendItem, Timings
    from fastdecode.kv.shard import ShardCore
    from fastdecode.model import ModelConfig


# ---- sampling ---------------------------------------------------------------------------------------
def sampling_to_proto(s: SamplingParams) -> dense_pb2.SamplingParams:
    out = dense_pb2.SamplingParams(
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        top_logprobs=s.top_logprobs,
        prompt_logprobs=s.prompt_logprobs,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        min_tokens=s.min_tokens,
        suppress_token_ids=s.suppress_ids,
        grammar=s.grammar,
    )
    if s.seed is not None:
        out.seed = s.seed
    if s.repetition_penalty != 1.0:
        out.repetition_penalty = s.repetition_penalty
    return out


def sampling_from_proto(sp: dense_pb2.SamplingParams) -> SamplingParams:
    """An unset top_p (0 on the wire) means 1.0: no nucleus cut; an unset repetition_penalty, 1."""
    return SamplingParams(
        sp.temperature,
        sp.top_p or 1.0,
        sp.top_k,
        sp.seed if sp.HasField("seed") else None,
        top_logprobs=sp.top_logprobs,
        prompt_logprobs=sp.prompt_logprobs,
        presence_penalty=sp.presence_penalty,
        frequency_penalty=sp.frequency_penalty,
        repetition_penalty=sp.repetition_penalty if sp.HasField("repetition_penalty") else 1.0,
        min_tokens=sp.min_tokens,
        suppress_ids=tuple(sp.suppress_token_ids),
        grammar=sp.grammar,
    )


# ---- logprobs ---------------------------------------------------------------------------------------
def top_to_proto(top: tuple[tuple[int, float], ...]) -> dense_pb2.TopLogprobs:
    return dense_pb2.TopLogprobs(token_ids=[t for t, _ in top], logprobs=[lp for _, lp in top])


def top_from_proto(t: dense_pb2.TopLogprobs) -> tuple[tuple[int, float], ...]:
    return tuple(zip(t.token_ids, t.logprobs, strict=True))


def position_to_proto(p: TokenLogprob) -> dense_pb2.PositionLogprob:
    return dense_pb2.PositionLogprob(token_id=p.token_id, logprob=p.logprob, top=top_to_proto(p.top))


def position_from_proto(p: dense_pb2.PositionLogprob) -> TokenLogprob:
    return TokenLogprob(p.token_id, p.logprob, top_from_proto(p.top))


def token_logprob_to_proto(p: TokenLogprob) -> gw_pb.TokenLogprob:
    return gw_pb.TokenLogprob(
        token_id=p.token_id,
        logprob=p.logprob,
        top_token_ids=[t for t, _ in p.top],
        top_logprobs=[lp for _, lp in p.top],
    )


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
        logprobs=r.logprobs if r.HasField("logprobs") else None,
        prompt_logprobs=r.prompt_logprobs,
        presence_penalty=r.presence_penalty,
        frequency_penalty=r.frequency_penalty,
        repetition_penalty=r.repetition_penalty if r.HasField("repetition_penalty") else None,
        min_tokens=r.min_tokens,
        structured=structured_from_proto(r.structured) if r.HasField("structured") else None,
    )


def structured_from_proto(s: gw_pb.StructuredOutput) -> Structured:
    kind = s.WhichOneof("kind")
    if kind is None:
        raise InvalidInput("structured is set but names no kind")
    if kind == "choice":
        return Structured("choice", json.dumps(list(s.choice.choices)))
    if kind == "json_object":
        return Structured("json_object")
    return Structured(kind, getattr(s, kind))


# ---- gateway <-> scheduler --------------------------------------------------------------------------
def submit_request(request_id: str, v: ValidRequest, sample_offset: int = 0) -> scheduler_pb2.SubmitRequest:
    return scheduler_pb2.SubmitRequest(
        sample_index_offset=sample_offset,
        request_id=request_id,
        prompt_token_ids=v.prompt_ids,
        max_tokens=v.max_tokens,
        sampling=sampling_to_proto(v.sampling()),
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
        cached_tokens=ev.cached_tokens,
        top=[top_to_proto(t) for t in ev.top],
        prompt_logprobs=[position_to_proto(p) for p in ev.prompt_logprobs],
    )


# ---- scheduler <-> gpu_dense ------------------------------------------------------------------------
def step_plan(step: Step, pipeline: bool) -> dense_pb2.StepPlan:
    plan = dense_pb2.StepPlan(step=step.step, pipeline=pipeline, ended=step.ended)
    for p in step.seqs:
        q = plan.sequences.add(
            seq_id=p.seq_id,
            shard=p.shard,
            mini_batch=p.mini_batch,
            token_ids=p.token_ids,
            start_pos=p.start_pos,
            sampling=sampling_to_proto(p.sampling),
            sample=p.sample,
            sample_index=p.sample_index,
        )
        if p.next_token is not None:
            q.next_token_id = p.next_token
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
            next_token=p.next_token_id if p.HasField("next_token_id") else None,
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
        pipelined=t.pipelined,
        s_part_cpu_seconds=t.s_part_cpu_seconds,
    )


def model_info_to_proto(
    c: ModelConfig,
    model_path: str,
    dtype: str,
    device: str,
    shards: Sequence[str],
    removed_shards: Sequence[int] = (),
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
        removed_shards=list(removed_shards),
        layer_windows=list(c.layer_windows),
        attn_logit_softcap=c.attn_logit_softcap,
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
        migrations=st.migrations,
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
            state=sh.state,
        )
    return out


def remove_result_to_proto(r: RemoveResult) -> scheduler_pb2.RemoveShardResponse:
    return scheduler_pb2.RemoveShardResponse(
        shard=r.shard,
        migrated_sequences=r.migrated,
        reprefilled_sequences=r.reprefilled,
        seconds=r.seconds,
        bytes=r.bytes,
    )


# ---- gateway -> client ------------------------------------------------------------------------------
def chunk_to_proto(c: GenerationChunk) -> gw_pb.GenerateResponse:
    resp = gw_pb.GenerateResponse(
        text=c.text,
        token_ids=c.token_ids,
        logprobs=[token_logprob_to_proto(p) for p in c.logprobs],
        prompt_logprobs=[token_logprob_to_proto(p) for p in c.prompt_logprobs],
    )
    if c.finish_reason:
        resp.finish_reason = c.finish_reason
        resp.usage.prompt_tokens = c.prompt_tokens
        resp.usage.completion_tokens = c.completion_tokens
        resp.usage.cached_tokens = c.cached_tokens
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
    stats.host_busy_seconds = core.host_busy_seconds
    stats.blocks_in_use, stats.blocks_free = s.blocks_in_use, s.blocks_free
    for name, value in s.prefix_stats.items():
        setattr(stats, f"prefix_{name}", value)
    return stats
