"""dense.proto: sampling settings and logprobs (shared by the scheduler's messages), the step plan
gpu_dense runs and the result it answers, its model info."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from fastdecode.contract import LAST_SAMPLE, LoraInfo, PlannedSeq, SamplingParams, TokenLogprob
from fastdecode.protocol import MAX_DECODE_STEPS
from fastdecode.runtime.errors import InternalError, InvalidInput
from fastdecode.runtime.geometry import KVGeometry
from fastdecode.scheduling.ports import DenseInfo, ItemResult, StepOutcome, StepTimes
from fastdecode.scheduling.types import SampledRun, Step
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
        lora=s.lora,
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
        lora=sp.lora,
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
    return plan_to_proto(step.step, step.seqs, pipeline, step.ended)


# settings objects converted lately, by identity (each entry holds its object, so the id stays its)
_converted: dict[int, tuple[SamplingParams, dense_pb2.SamplingParams]] = {}
_CONVERTED_MAX = 256


def _converted_sampling(s: SamplingParams) -> dense_pb2.SamplingParams:
    hit = _converted.get(id(s))
    if hit is not None and hit[0] is s:
        return hit[1]
    if len(_converted) >= _CONVERTED_MAX:
        _converted.clear()  # settings come and go with requests: start over rather than keep them
    out = _converted[id(s)] = (s, sampling_to_proto(s))
    return out[1]


def plan_to_proto(
    step: int, seqs: Sequence[PlannedSeq], pipeline: bool, ended: Sequence[str] = ()
) -> dense_pb2.StepPlan:
    """A step's PlannedSeqs as StepPlan's columns."""
    # Sequences mostly share a few sampling settings (greedy, a client's defaults): the scheduler's
    # core gives requests with equal settings one object, so each object is one entry of the step's
    # table, found by identity (hashing the frozen dataclass's 17 fields was most of a small step's
    # plan), and converted once while it lives (_converted), not once a step.
    by_id: dict[int, int] = {}
    table: list[dense_pb2.SamplingParams] = []
    index: list[int] = []
    tokens: list[int] = []
    counts: list[int] = []
    next_tokens: dict[int, int] = {}
    for row, p in enumerate(seqs):
        i = by_id.get(id(p.sampling))
        if i is None:
            i = by_id[id(p.sampling)] = len(table)
            table.append(_converted_sampling(p.sampling))
        index.append(i)
        if p.use_last_sample:
            counts.append(0)
        else:
            counts.append(len(p.token_ids))
            tokens += p.token_ids
        if p.next_token is not None:
            next_tokens[row] = p.next_token
    steps = [p.steps for p in seqs]
    drafts = [p.drafts for p in seqs]
    return dense_pb2.StepPlan(
        step=step,
        pipeline=pipeline,
        ended=ended,
        seq_ids=[p.seq_id for p in seqs],
        shards=[p.shard for p in seqs],
        mini_batches=[p.mini_batch for p in seqs],
        start_pos=[p.start_pos for p in seqs],
        token_counts=counts,
        token_ids=tokens,
        sample=[p.sample for p in seqs],
        sample_index=[p.sample_index for p in seqs],
        use_last_sample=[p.use_last_sample for p in seqs],
        samplings=table,
        sampling_index=index,
        next_token_ids=next_tokens,
        steps=steps if any(n > 1 for n in steps) else (),
        drafts=drafts if any(drafts) else (),
    )


def planned_seqs_from_proto(plan: dense_pb2.StepPlan) -> list[PlannedSeq]:
    """StepPlan's columns as PlannedSeqs; a plan whose columns disagree is InvalidInput."""
    ids = list(plan.seq_ids)
    n = len(ids)
    cols = (
        plan.shards,
        plan.mini_batches,
        plan.start_pos,
        plan.token_counts,
        plan.sample,
        plan.sample_index,
        plan.use_last_sample,
        plan.sampling_index,
    )
    if any(len(c) != n for c in cols):
        raise InvalidInput(f"step plan {plan.step}: its columns have different lengths")
    counts = list(plan.token_counts)
    flat = list(plan.token_ids)
    if sum(counts) != len(flat) or min(counts, default=0) < 0:
        raise InvalidInput(f"step plan {plan.step}: token_counts do not add up to its token_ids")
    table = [sampling_from_proto(sp) for sp in plan.samplings]
    index = list(plan.sampling_index)
    if index and not 0 <= min(index) <= max(index) < len(table):
        raise InvalidInput(f"step plan {plan.step}: a sampling_index outside its samplings")
    next_tokens = dict(plan.next_token_ids)
    steps = list(plan.steps) or [1] * n
    if len(steps) != n or (n and not 1 <= min(steps) <= max(steps) <= MAX_DECODE_STEPS):
        raise InvalidInput(f"step plan {plan.step}: steps must be one per row, in [1, {MAX_DECODE_STEPS}]")
    drafts = list(plan.drafts) or [0] * n
    if len(drafts) != n or any(not 0 <= d < c for d, c in zip(drafts, counts, strict=True) if d):
        raise InvalidInput(f"step plan {plan.step}: drafts must be one per row, each below its token count")
    last = list(plan.use_last_sample)
    out = []
    pos = 0
    rows = zip(
        ids,
        plan.shards,
        plan.mini_batches,
        plan.start_pos,
        counts,
        plan.sample,
        plan.sample_index,
        last,
        index,
        steps,
        drafts,
        strict=True,
    )
    for row, (sid, shard, mb, start, count, sample, s_index, ahead, si, k, d) in enumerate(rows):
        toks = [LAST_SAMPLE] if ahead else flat[pos : pos + count]
        pos += count
        nxt = next_tokens.get(row)
        out.append(PlannedSeq(sid, shard, mb, toks, start, table[si], sample, s_index, nxt, ahead, k, d))
    return out


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
    weights_id: str = "",
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
        weights_id=weights_id,
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
    result.seq_ids.extend(outcomes)
    if any(o.after for o in outcomes.values()):  # rows run several decode steps: tokens per row
        flat: list[Outcome] = []
        for o in outcomes.values():
            flat.append(o)
            flat += o.after
        result.token_counts.extend([1 + len(o.after) for o in outcomes.values()])
    else:
        flat = list(outcomes.values())
    result.token_ids.extend([o.token_id for o in flat])
    result.logprobs.extend([o.logprob for o in flat])
    for i, o in enumerate(flat):
        if o.top:
            result.top[i].CopyFrom(top_to_proto(o.top))
    for row, o in enumerate(outcomes.values()):  # the sparse parts: most rows have none
        if o.error is not None:
            result.errors[row].CopyFrom(item_error(o.error))
        if o.prompt:
            result.prompt_logprobs[row].positions.extend(position_to_proto(p) for p in o.prompt)
    if timings is not None:
        result.timings.CopyFrom(timings_to_proto(timings))
    return result


def step_outcome_from_proto(result: dense_pb2.StepResult) -> StepOutcome:
    """The scheduler's side of a StepResult, with the step's timings when gpu_dense sent them (what
    drafting's controller weighs drafts by)."""
    out = _outcome_from_proto(result)
    if not result.HasField("timings"):
        return out
    t = result.timings
    return replace(out, timings=StepTimes(t.s_part_seconds, t.attend_seconds, t.step_seconds))


def _outcome_from_proto(result: dense_pb2.StepResult) -> StepOutcome:
    if result.error.code:
        return StepOutcome([], error_from_item(result.error))
    ids, toks, lps = list(result.seq_ids), list(result.token_ids), list(result.logprobs)
    if result.token_counts:
        return _runs_from_proto(result, ids, toks, lps)
    if not len(ids) == len(toks) == len(lps):
        return StepOutcome([], InternalError(f"step {result.step}: its result's columns differ in length"))
    if not (result.errors or result.top or result.prompt_logprobs):  # a decode step, most often
        return StepOutcome([], sampled=dict(zip(ids, zip(toks, lps, strict=True), strict=True)))
    errors = {row: error_from_item(e) for row, e in result.errors.items() if e.code}
    top = {row: top_from_proto(t) for row, t in result.top.items()}
    prompt = {r: [position_from_proto(p) for p in pl.positions] for r, pl in result.prompt_logprobs.items()}
    items = [
        ItemResult(sid, tok, lp, errors.get(row), top.get(row, ()), prompt.get(row, []))
        for row, (sid, tok, lp) in enumerate(zip(ids, toks, lps, strict=True))
    ]
    return StepOutcome(items)


def _runs_from_proto(
    result: dense_pb2.StepResult, ids: list[str], toks: list[int], lps: list[float]
) -> StepOutcome:
    """A result whose rows ran several decode steps: token_counts tokens per row, `top` keyed by the
    flat token index."""
    counts = list(result.token_counts)
    if len(counts) != len(ids) or sum(counts) != len(toks) or len(lps) != len(toks) or min(counts) < 1:
        return StepOutcome([], InternalError(f"step {result.step}: its token_counts disagree with it"))
    sparse = result.errors or result.top or result.prompt_logprobs
    errors = {row: error_from_item(e) for row, e in result.errors.items() if e.code}
    top = {i: top_from_proto(t) for i, t in result.top.items()}
    prompt = {r: [position_from_proto(p) for p in pl.positions] for r, pl in result.prompt_logprobs.items()}
    sampled: dict[str, tuple[int, float] | tuple[list[int], list[float]]] = {}
    items: list[ItemResult] = []
    pos = 0
    for row, (sid, c) in enumerate(zip(ids, counts, strict=True)):
        end = pos + c
        if not sparse:
            sampled[sid] = (toks[pos], lps[pos]) if c == 1 else (toks[pos:end], lps[pos:end])
        else:
            run = None
            if c > 1:
                run = SampledRun(toks[pos:end], lps[pos:end], [top.get(i, ()) for i in range(pos, end)])
            err, scored = errors.get(row), prompt.get(row, [])
            items.append(ItemResult(sid, toks[pos], lps[pos], err, top.get(pos, ()), scored, run))
        pos = end
    return StepOutcome(items) if sparse else StepOutcome([], sampled=sampled)


def step_tokens(result: dense_pb2.StepResult, ids: Sequence[str], what: str) -> list[int]:
    """The token each of `ids` sampled in a StepResult (benchmarks that drive gpu_dense's Run
    themselves); a failed step or sequence raises its error, prefixed with `what`."""
    outcome = step_outcome_from_proto(result)
    if outcome.error is not None:
        raise type(outcome.error)(f"{what}: {outcome.error.message}")
    by_id = {}
    for r in outcome.rows():
        if r.error is not None:
            raise type(r.error)(f"{what}, {r.seq_id}: {r.error.message}")
        by_id[r.seq_id] = r.token_id
    return [by_id[s] for s in ids]


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
        # what the KV depends on: shards never mix prefixes of two, nor keep a pool of other weights
        model=f"{i.model_path}|{i.dtype}|{i.weights_id}" if i.weights_id else f"{i.model_path}|{i.dtype}",
        removed_shards=tuple(i.removed_shards),
    )


# ---- LoRA adapters ---------------------------------------------------------------------------------
def loras_to_proto(adapters: Sequence[LoraInfo], enabled: bool) -> dense_pb2.LoraAdapterList:
    return dense_pb2.LoraAdapterList(
        adapters=[dense_pb2.LoraAdapter(name=a.name, path=a.path, rank=a.rank) for a in adapters],
        enabled=enabled,
    )


def loras_from_proto(m: dense_pb2.LoraAdapterList) -> list[LoraInfo]:
    return [LoraInfo(a.name, a.path, a.rank) for a in m.adapters]
