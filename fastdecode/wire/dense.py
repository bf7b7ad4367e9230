"""dense.proto: sampling settings and logprobs (shared by the scheduler's messages), the step plan
gpu_dense runs and the result it answers, its model info."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from fastdecode.contract import LAST_SAMPLE, PlannedSeq, SamplingParams, TokenLogprob
from fastdecode.runtime.geometry import KVGeometry
from fastdecode.scheduling.ports import DenseInfo, ItemResult, StepOutcome
from fastdecode.scheduling.types import Step
from fastdecode.v1 import dense_pb2
from fastdecode.wire.errors import error_from_item, item_error

if TYPE_CHECKING:  # annotations only
    from fastdecode.dense import Outcome, Timings
    from fastdecode.model import ModelConfig


# ---- sampling -------------------------------------------------------------------------------------
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
        logit_bias=dict(s.logit_bias),
        min_p=s.min_p,
        allowed_token_ids=s.allowed_token_ids,
        bad_words=[dense_pb2.TokenSequence(token_ids=w) for w in s.bad_words],
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
        logit_bias=tuple(sorted(sp.logit_bias.items())),
        min_p=sp.min_p,
        allowed_token_ids=tuple(sp.allowed_token_ids),
        bad_words=tuple(tuple(w.token_ids) for w in sp.bad_words),
    )


# ---- logprobs -------------------------------------------------------------------------------------
def top_to_proto(top: tuple[tuple[int, float], ...]) -> dense_pb2.TopLogprobs:
    return dense_pb2.TopLogprobs(token_ids=[t for t, _ in top], logprobs=[lp for _, lp in top])


def top_from_proto(t: dense_pb2.TopLogprobs) -> tuple[tuple[int, float], ...]:
    return tuple(zip(t.token_ids, t.logprobs, strict=True))


def position_to_proto(p: TokenLogprob) -> dense_pb2.PositionLogprob:
    return dense_pb2.PositionLogprob(token_id=p.token_id, logprob=p.logprob, top=top_to_proto(p.top))


def position_from_proto(p: dense_pb2.PositionLogprob) -> TokenLogprob:
    return TokenLogprob(p.token_id, p.logprob, top_from_proto(p.top))


# ---- scheduler <-> gpu_dense -----------------------------------------------------------------------
def step_plan(step: Step, pipeline: bool) -> dense_pb2.StepPlan:
    plan = dense_pb2.StepPlan(step=step.step, pipeline=pipeline, ended=step.ended)
    # Sequences mostly share a few sampling settings (greedy, a client's defaults): each distinct
    # one is converted once a step, not once a sequence.
    samplings: dict[SamplingParams, dense_pb2.SamplingParams] = {}
    for p in step.seqs:
        try:
            sp = samplings.get(p.sampling)
            if sp is None:
                sp = samplings[p.sampling] = sampling_to_proto(p.sampling)
        except TypeError:  # settings built with a list somewhere (unhashable): converted as they are
            sp = sampling_to_proto(p.sampling)
        q = plan.sequences.add(
            seq_id=p.seq_id,
            shard=p.shard,
            mini_batch=p.mini_batch,
            token_ids=() if p.use_last_sample else p.token_ids,
            start_pos=p.start_pos,
            sampling=sp,
            sample=p.sample,
            sample_index=p.sample_index,
            use_last_sample=p.use_last_sample,
        )
        if p.next_token is not None:
            q.next_token_id = p.next_token
    return plan


def planned_seqs_from_proto(plan: dense_pb2.StepPlan) -> list[PlannedSeq]:
    # A step's sequences share a few distinct SamplingParams: each is converted once (by its bytes).
    params: dict[bytes, SamplingParams] = {}

    def sampling(sp: dense_pb2.SamplingParams) -> SamplingParams:
        key = sp.SerializeToString(deterministic=True)
        got = params.get(key)
        if got is None:
            got = params[key] = sampling_from_proto(sp)
        return got

    return [
        PlannedSeq(
            p.seq_id,
            p.shard,
            p.mini_batch,
            [LAST_SAMPLE] if p.use_last_sample else list(p.token_ids),
            p.start_pos,
            sampling(p.sampling),
            p.sample,
            p.sample_index,
            p.next_token_id if p.HasField("next_token_id") else None,
            p.use_last_sample,
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


def step_result(
    step: int, outcomes: Mapping[str, Outcome], timings: Timings | None, error: BaseException | None = None
) -> dense_pb2.StepResult:
    """gpu_dense's answer to one plan: each sequence's token (or its error), the step's timings; a
    step that failed as a whole carries only its error."""
    result = dense_pb2.StepResult(step=step)
    if error is not None:
        result.error.CopyFrom(item_error(error))
        return result
    for sid, o in outcomes.items():
        r = result.results.add(
            seq_id=sid,
            token_id=o.token_id,
            logprob=o.logprob,
            top=top_to_proto(o.top),
            prompt_logprobs=[position_to_proto(p) for p in o.prompt],
        )
        if o.error is not None:
            r.error.CopyFrom(item_error(o.error))
    if timings is not None:
        result.timings.CopyFrom(timings_to_proto(timings))
    return result


def step_outcome_from_proto(result: dense_pb2.StepResult) -> StepOutcome:
    """The scheduler's side of a StepResult."""
    # (one item per sequence every step: the optional parts are read only where they are set)
    items = [
        ItemResult(
            r.seq_id,
            r.token_id,
            r.logprob,
            error_from_item(r.error) if r.HasField("error") and r.error.code else None,
            top_from_proto(r.top) if r.HasField("top") else (),
            [position_from_proto(p) for p in r.prompt_logprobs] if r.prompt_logprobs else [],
        )
        for r in result.results
    ]
    return StepOutcome(items, error_from_item(result.error) if result.error.code else None)


def dense_info_from_proto(i: dense_pb2.ModelInfo) -> DenseInfo:
    """What the scheduler's driver reads of gpu_dense's Info."""
    return DenseInfo(
        model_type=i.model_type,
        geometry=KVGeometry(
            i.num_layers, i.num_kv_heads, i.head_dim, tuple(i.layer_windows), i.attn_logit_softcap
        ),
        vocab_size=int(i.vocab_size),
        max_position_embeddings=int(i.max_position_embeddings),
        eos_token_ids=tuple(i.eos_token_ids),
        num_shards=len(i.shards),
        shard_addresses=tuple(i.shards),
        model=f"{i.model_path}|{i.dtype}",  # what the KV depends on: shards never mix prefixes of two
        removed_shards=tuple(i.removed_shards),
    )
