"""gateway.proto: a client's GenerateRequest to the gateway's params, its chunks and model card back.
And the gateway's side of scheduler.proto: its Submit, the token events it reads back, the backend's
model info (dense.proto's ModelInfo, relayed by the scheduler). Loads no torch: the gateway imports it."""

from __future__ import annotations

import json
from typing import NamedTuple

from fastdecode.contract import TokenLogprob
from fastdecode.gateway.core import BackendInfo, GenerationChunk, ModelCard, UpstreamEvent
from fastdecode.gateway.text import GenerateParams, ValidRequest
from fastdecode.runtime.errors import InternalError, InvalidInput, Status
from fastdecode.runtime.grammar import Structured
from fastdecode.v1 import dense_pb2, scheduler_pb2
from fastdecode.v1 import gateway_pb2 as gw_pb
from fastdecode.wire.dense import position_from_proto, sampling_to_proto, top_from_proto


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
        logit_bias=dict(r.logit_bias) or None,
        min_p=r.min_p if r.HasField("min_p") else None,
        allowed_token_ids=list(r.allowed_token_ids) or None,
        bad_words=list(r.bad_words),
        cache_salt=r.cache_salt or None,
        lora=r.lora,
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


def token_logprob_to_proto(p: TokenLogprob) -> gw_pb.TokenLogprob:
    return gw_pb.TokenLogprob(
        token_id=p.token_id,
        logprob=p.logprob,
        top_token_ids=[t for t, _ in p.top],
        top_logprobs=[lp for _, lp in p.top],
    )


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


def backend_info_from_proto(info: dense_pb2.ModelInfo) -> BackendInfo:
    return BackendInfo(info.model_type, info.vocab_size, info.num_shards, info.device)


# ---- gateway <-> scheduler -------------------------------------------------------------------------
def submit_request(request_id: str, v: ValidRequest, sample_offset: int = 0) -> scheduler_pb2.SubmitRequest:
    return scheduler_pb2.SubmitRequest(
        sample_index_offset=sample_offset,
        request_id=request_id,
        prompt_token_ids=v.prompt_ids,
        max_tokens=v.max_tokens,
        sampling=sampling_to_proto(v.sampling()),
        stop_token_ids=list(v.stop_token_ids),
        ignore_eos=v.ignore_eos,
        cache_salt=v.cache_salt,
    )


def session_submit(request_id: str, v: ValidRequest, sample_offset: int = 0) -> scheduler_pb2.SessionRequest:
    return scheduler_pb2.SessionRequest(submit=submit_request(request_id, v, sample_offset))


def session_cancel(request_id: str) -> scheduler_pb2.SessionRequest:
    return scheduler_pb2.SessionRequest(cancel=scheduler_pb2.CancelRequest(request_id=request_id))


class UpstreamFailure(NamedTuple):
    """A request's in-band end on a session: the status Submit's call would have ended with."""

    status: Status
    message: str
    dependency_down: bool


def session_events_from_proto(
    msg: scheduler_pb2.SessionEvents,
) -> list[tuple[str, UpstreamEvent | UpstreamFailure]]:
    """Each request's events of one SessionEvents, in order (a request is either in the message's
    events or in its plain columns, never both)."""
    out: list[tuple[str, UpstreamEvent | UpstreamFailure]] = []
    for e in msg.events:
        if e.HasField("error"):
            failure = UpstreamFailure(Status.from_value(e.error.code), e.error.message, e.dependency_down)
            out.append((e.request_id, failure))
        else:
            out.append((e.request_id, upstream_event_from_proto(e.token)))
    ids = list(msg.plain_request_ids)
    if ids:
        toks, lps, cached = list(msg.plain_token_ids), list(msg.plain_logprobs), list(msg.plain_cached_tokens)
        if msg.plain_token_counts:
            return out + _plain_runs(ids, list(msg.plain_token_counts), toks, lps, cached)
        if not len(ids) == len(toks) == len(lps) == len(cached):
            raise InternalError("a SessionEvents message whose plain columns differ in length")
        out += [
            (sid, UpstreamEvent([tok], "", [lp], cached_tokens=c))
            for sid, tok, lp, c in zip(ids, toks, lps, cached, strict=True)
        ]
    return out


def _plain_runs(
    ids: list[str], counts: list[int], toks: list[int], lps: list[float], cached: list[int]
) -> list[tuple[str, UpstreamEvent | UpstreamFailure]]:
    """Plain rows of several tokens each (plain_token_counts)."""
    if not len(ids) == len(counts) == len(cached) or sum(counts) != len(toks) or len(lps) != len(toks):
        raise InternalError("a SessionEvents message whose plain columns differ in length")
    if min(counts) < 1:
        raise InternalError("a SessionEvents message with an empty plain row")
    out: list[tuple[str, UpstreamEvent | UpstreamFailure]] = []
    pos = 0
    for sid, n, c in zip(ids, counts, cached, strict=True):
        out.append((sid, UpstreamEvent(toks[pos : pos + n], "", lps[pos : pos + n], cached_tokens=c)))
        pos += n
    return out


def upstream_event_from_proto(ev: scheduler_pb2.TokenEvent) -> UpstreamEvent:
    return UpstreamEvent(
        list(ev.token_ids),
        ev.finish_reason,
        list(ev.logprobs),
        [top_from_proto(t) for t in ev.top] if ev.top else [],
        [position_from_proto(p) for p in ev.prompt_logprobs] if ev.prompt_logprobs else [],
        cached_tokens=ev.cached_tokens,
    )
