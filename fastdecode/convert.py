"""Proto messages to domain objects and back: one place per message family. Imports the generated
messages (protobuf) but no gRPC; the service adapters call it, the cores never see a proto."""

from __future__ import annotations

from fastdecode.gateway.core import GenerationChunk, ModelCard
from fastdecode.gateway.text import GenerateParams, ValidRequest
from fastdecode.sampling import SamplingParams
from fastdecode.scheduling import Request, Step, TokenEvent
from fastdecode.v1 import dense_pb2, scheduler_pb2
from fastdecode.v1 import gateway_pb2 as gw_pb


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
        cached_tokens=ev.cached_tokens,
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


def chunk_to_proto(c: GenerationChunk) -> gw_pb.GenerateResponse:
    resp = gw_pb.GenerateResponse(text=c.text, token_ids=c.token_ids)
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
