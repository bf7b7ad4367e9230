"""Discrete-event simulator: replays a workload against the real SchedulerCore and cost functions.

The "model" is a stub that emits EOS as each request's gen_len-th token, so generated lengths follow the
workload while the core applies its real stop rules. Time comes from cost functions, per layer:
  S-part of a mini-batch of n new tokens: T(n)                       (GPU, dense)
  R-part of a mini-batch on shard j:      R * attended_j / speed_j   (attended = cached tokens read)
Two mini-batches A and B in a pipeline (ARCHITECTURE.md, "The FastDecode idea"): the GPU runs
S_A, S_B, S_A', ...; each shard runs R_A, R_B, ...; A's next layer waits for R_A. The per-layer
period is therefore
  max(S_A + S_B, max_j(R_Aj + R_Bj), S_A + max_j R_Aj, S_B + max_j R_Bj)
(= max(S, R) for balanced halves), with one mini-batch S + R, and a step takes N layers x period (the
pipeline's fill and drain are ignored). Deterministic: no wall clock, no unseeded randomness.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from fastdecode.runtime.errors import InvalidInput, ResourceExhausted, ServiceError
from fastdecode.scheduling import (
    NaiveAdmission,
    Request,
    SchedulerCore,
    ShardSpec,
    StabilizedAdmission,
    Step,
    attention_cost,
)
from fastdecode.scheduling.migration import Move

EOS = 0  # the stub model's EOS id

# Paper setting used by default: B sequences generating S tokens each, short prompts, a backlog that
# never runs dry (all requests arrive at t=0), P shards.
DEFAULT_BATCH = 64
DEFAULT_GEN_LEN = 256
DEFAULT_PROMPT_LEN = 16
DEFAULT_SHARDS = 4
DEFAULT_LAYERS = 32
# Default affine S-part per layer: T(n) = 200 us + 4 us per token (an A10-class GPU on a 7B layer).
DEFAULT_T_FIXED = 2e-4
DEFAULT_T_PER_TOKEN = 4e-6


@dataclass(frozen=True)
class WorkItem:
    """One request of a workload: when it arrives, its prompt length and how many tokens it generates."""

    arrival_s: float
    prompt_len: int
    gen_len: int
    max_tokens: int | None = None  # default gen_len; larger makes the request stop early (by EOS)

    def limit(self) -> int:
        return self.max_tokens if self.max_tokens is not None else self.gen_len


@dataclass
class CostModel:
    """S-part seconds per layer for n tokens, R seconds per new token per cached token (one shard, one
    layer), and the layer count."""

    t_dense: Callable[[int], float]
    r_attn: float
    num_layers: int = DEFAULT_LAYERS

    @classmethod
    def affine(
        cls,
        t_fixed: float = DEFAULT_T_FIXED,
        t_per_token: float = DEFAULT_T_PER_TOKEN,
        r_attn: float | None = None,
        num_layers: int = DEFAULT_LAYERS,
        *,
        batch: int = DEFAULT_BATCH,
        seq_len: int = DEFAULT_GEN_LEN,
        prompt_len: int = DEFAULT_PROMPT_LEN,
        shards: int = DEFAULT_SHARDS,
    ) -> CostModel:
        """T(n) = t_fixed + t_per_token * n. R defaults to the value that balances the pipeline at the
        paper's average load: B * (prompt + S/2) / P cached tokens per shard take as long as the two
        mini-batches' S-parts, 2 * T(B/2)."""

        def t(n: int) -> float:
            return t_fixed + t_per_token * n

        if r_attn is None:
            r_attn = 2 * t(max(1, batch // 2)) * shards / (batch * (prompt_len + seq_len / 2))
        return cls(t_dense=t, r_attn=r_attn, num_layers=num_layers)

    @classmethod
    def from_profile(cls, profile: object) -> CostModel:
        """From a planner Profile (T(B) samples interpolated, R, layers)."""
        from fastdecode.planning.planner import Profile

        assert isinstance(profile, Profile)
        return cls(t_dense=profile.t_at, r_attn=profile.r_attn, num_layers=profile.num_layers)


@dataclass
class SimConfig:
    admission: str = "stabilized"  # naive | stabilized
    shards: int = DEFAULT_SHARDS
    max_running: int = DEFAULT_BATCH
    max_waiting: int = 1 << 20
    prefill_token_budget: int = 512
    capacity_tokens: int | None = None  # per shard; None: room for 1.5x the batch's prompt + max_tokens
    block_size: int = 16  # KV block: shards allocate blocks on demand, the core mirrors them
    kv_lookahead: int | None = None  # steps of growth admission leaves room for; None: the core's default
    shard_speeds: Sequence[float] | None = None
    micro_batch: int | None = None
    w_limit: float | None = None
    ramp_steps: int | None = None
    cost: CostModel = field(default_factory=CostModel.affine)
    # Live rebalancing (the scheduler's rebalance_factor; 0: off): a move copies the sequence's KV
    # at migrate_bytes_per_s while steps go on without it, then it decodes on its new shard; the
    # next move waits until moving has taken at most migrate_share of the time.
    rebalance_factor: float = 0.0
    kv_bytes_per_token: float = 2 * DEFAULT_LAYERS * 4096 * 2  # a 7B MHA model in fp16
    migrate_bytes_per_s: float = 1e9
    migrate_share: float = 0.3


@dataclass
class SimResult:
    admission: str
    requests: int
    tokens: int
    steps: int
    makespan_s: float
    tokens_per_s: float  # all generated tokens / (last finish - first arrival)
    sustained_tokens_per_s: float  # over the steps that began with requests still waiting (saturated)
    latency_p50_s: float  # per-token latency: gap between consecutive tokens of a sequence
    latency_p99_s: float
    ttft_p50_s: float  # arrival to first token (queueing included)
    ttft_p99_s: float
    peak_kv_load: int  # max over steps of the KV tokens held by all shards
    mean_kv_load: float  # time-weighted mean of the same
    imbalance_max_over_mean: float  # per step max/mean shard KV load, time-weighted mean over steps
    imbalance_peak: float  # ... and its maximum over steps
    mean_running: float  # time-weighted mean of sequences in a step
    w_limit: float | None
    peak_running: int = 0  # most sequences in one step
    migrations: int = 0  # live moves (rebalancing)
    migrated_bytes: float = 0.0
    migration_seconds: float = 0.0  # copy time, summed (each pauses only its sequence)
    preemptions: int = 0  # sequences preempted (KV freed, recomputed) because a shard was full

    def to_dict(self) -> dict:
        return asdict(self)


def load_workload(path: str | Path) -> list[WorkItem]:
    """A JSON list, or JSON lines, of {"arrival_s", "prompt_len", "gen_len"[, "max_tokens"]}."""
    text = Path(path).read_text()
    stripped = text.lstrip()
    if stripped.startswith("["):
        rows = json.loads(text)
    else:
        rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    items = []
    for i, row in enumerate(rows):
        try:
            item = WorkItem(
                arrival_s=float(row["arrival_s"]),
                prompt_len=int(row["prompt_len"]),
                gen_len=int(row["gen_len"]),
                max_tokens=int(row["max_tokens"]) if row.get("max_tokens") is not None else None,
            )
        except (KeyError, TypeError, ValueError) as e:
            raise InvalidInput(f"workload row {i}: {e!r}") from e
        if item.arrival_s < 0 or item.prompt_len < 1 or item.gen_len < 1 or item.limit() < item.gen_len:
            raise InvalidInput(
                f"workload row {i}: need arrival_s >= 0, prompt_len, gen_len >= 1, max_tokens >= gen_len"
            )
        items.append(item)
    return sorted(items, key=lambda w: w.arrival_s)


def paper_workload(
    seed: int = 0,
    *,
    batch: int = DEFAULT_BATCH,
    gen_len: int = DEFAULT_GEN_LEN,
    prompt_len: int = DEFAULT_PROMPT_LEN,
    requests: int | None = None,
) -> list[WorkItem]:
    """The paper's setting: every request generates gen_len tokens, all arrive at once (8 batches' worth
    by default, so arrivals never run dry); prompt lengths vary by +-50% with the seed."""
    rng = random.Random(seed)
    n = requests if requests is not None else 8 * batch
    lo, hi = max(1, prompt_len // 2), max(1, prompt_len + prompt_len // 2)
    return [WorkItem(0.0, rng.randint(lo, hi), gen_len) for _ in range(n)]


def step_seconds(step: Step, cost: CostModel, speeds: Sequence[float]) -> float:
    """Time of one step under the two-mini-batch pipeline (see module docstring)."""
    s_part = [0.0, 0.0]
    r_part: list[dict[int, float]] = [{}, {}]
    tokens = [0, 0]
    for p in step.seqs:
        tokens[p.mini_batch] += len(p.token_ids)
        a = attention_cost(len(p.token_ids), p.start_pos) * cost.r_attn / speeds[p.shard]
        r_part[p.mini_batch][p.shard] = r_part[p.mini_batch].get(p.shard, 0.0) + a
    for x in (0, 1):
        s_part[x] = cost.t_dense(tokens[x]) if tokens[x] else 0.0
    r_max = [max(r.values(), default=0.0) for r in r_part]
    if not tokens[0] or not tokens[1]:
        period = s_part[0] + s_part[1] + r_max[0] + r_max[1]
    else:
        shards = set(r_part[0]) | set(r_part[1])
        per_shard = max(r_part[0].get(j, 0.0) + r_part[1].get(j, 0.0) for j in shards)
        period = max(s_part[0] + s_part[1], per_shard, s_part[0] + r_max[0], s_part[1] + r_max[1])
    return cost.num_layers * period


def _percentile(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    ys = sorted(xs)
    k = (len(ys) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return ys[lo] + (ys[hi] - ys[lo]) * (k - lo)


def make_core(config: SimConfig, workload: Sequence[WorkItem]) -> SchedulerCore:
    if config.admission == "naive":
        policy = NaiveAdmission()
    elif config.admission == "stabilized":
        policy = StabilizedAdmission(config.w_limit, config.micro_batch, config.ramp_steps)
    else:
        raise InvalidInput(f"unknown admission {config.admission!r} (naive | stabilized)")
    if config.shards < 1:
        raise InvalidInput("need at least one shard")
    cap = config.capacity_tokens
    if cap is None:
        need = max((w.prompt_len + w.limit() for w in workload), default=1)
        cap = max(need, math.ceil(1.5 * need * config.max_running / config.shards))
    speeds = list(config.shard_speeds) if config.shard_speeds is not None else [1.0] * config.shards
    if len(speeds) != config.shards:
        raise InvalidInput("one speed per shard")
    if config.block_size < 1:
        raise InvalidInput("block_size must be >= 1")
    extra = {} if config.kv_lookahead is None else {"kv_lookahead": config.kv_lookahead}
    return SchedulerCore(
        [ShardSpec(cap, sp, config.block_size) for sp in speeds],
        [EOS],
        max_running=config.max_running,
        max_waiting=config.max_waiting,
        prefill_token_budget=config.prefill_token_budget,
        admission=policy,
        **extra,
    )


def simulate(workload: Sequence[WorkItem], config: SimConfig | None = None, *, seed: int = 0) -> SimResult:
    """Run the workload to completion and measure throughput, latency and KV load."""
    config = config or SimConfig()
    core = make_core(config, workload)
    speeds = list(config.shard_speeds) if config.shard_speeds is not None else [1.0] * config.shards
    items = sorted(workload, key=lambda w: w.arrival_s)
    rng = random.Random(seed)
    by_id: dict[str, WorkItem] = {}
    arrived: dict[str, float] = {}
    last_token: dict[str, float] = {}
    gaps: list[float] = []
    ttft: list[float] = []
    backlog: list[tuple[str, Request]] = []
    now = items[0].arrival_s if items else 0.0
    start = now
    nxt = 0
    tokens = steps = 0
    peak = peak_running = 0
    load_time = imb_time = busy_time = run_time = 0.0
    imb_peak = 1.0
    sat_tokens, sat_time = 0, 0.0
    moving: tuple[Move, float] | None = None  # the move under way and when its copy ends
    next_move = now
    moved, moved_bytes, moved_s = 0, 0.0, 0.0
    while True:
        if moving is not None and now >= moving[1]:
            moved += core.end_move(moving[0], ok=True)
            moving = None
        if moving is None and config.rebalance_factor > 0 and now >= next_move:
            move = core.rebalance_move(config.rebalance_factor)
            if move is not None:
                copy_s = move.tokens * config.kv_bytes_per_token / config.migrate_bytes_per_s
                moving = (move, now + copy_s)
                moved_bytes += move.tokens * config.kv_bytes_per_token
                moved_s += copy_s
                next_move = now + copy_s / config.migrate_share
        while nxt < len(items) and items[nxt].arrival_s <= now:
            w = items[nxt]
            sid = f"r{nxt}"
            prompt = [1 + rng.randrange(1000) for _ in range(w.prompt_len)]
            by_id[sid] = w
            arrived[sid] = w.arrival_s
            backlog.append((sid, Request(sid, prompt, w.limit())))
            nxt += 1
        while backlog:
            try:
                core.submit(backlog[0][1])
            except ResourceExhausted:
                break
            backlog.pop(0)
        saturated = bool(backlog) or core.waiting > 0
        step = core.next_step()
        if step is None:
            if moving is not None:  # only the moving sequence is left: its copy is the wait
                now = max(now, moving[1])
                continue
            if nxt < len(items):
                now = max(now, items[nxt].arrival_s)
                continue
            if core.running or core.waiting or backlog:
                raise RuntimeError("simulation stalled: requests left but nothing can run")
            break
        dt = step_seconds(step, config.cost, speeds)
        kv = core.kv_tokens_per_shard()
        total = sum(kv)
        peak = max(peak, total)
        load_time += total * dt
        if total > 0:
            imb = max(kv) / (total / len(kv))
            imb_time += imb * dt
            busy_time += dt
            imb_peak = max(imb_peak, imb)
        run_time += len(step.seqs) * dt
        peak_running = max(peak_running, len(step.seqs))
        now += dt
        steps += 1
        results: dict[str, tuple[int, float] | ServiceError] = {}
        for p in step.seqs:
            if p.sample:
                made = p.sample_index + 1  # this is the made-th generated token
                results[p.seq_id] = (EOS if made >= by_id[p.seq_id].gen_len else 1 + made % 997, 0.0)
        step_tokens = 0
        for ev in core.apply(step, results):
            if ev.error is not None:
                raise RuntimeError(f"{ev.seq_id}: {ev.error}")
            for _ in ev.token_ids:
                step_tokens += 1
                prev = last_token.get(ev.seq_id)
                if prev is None:
                    ttft.append(now - arrived[ev.seq_id])
                else:
                    gaps.append(now - prev)
                last_token[ev.seq_id] = now
        tokens += step_tokens
        if saturated:
            sat_tokens += step_tokens
            sat_time += dt
    makespan = now - start
    return SimResult(
        admission=config.admission,
        requests=len(items),
        tokens=tokens,
        steps=steps,
        makespan_s=makespan,
        tokens_per_s=tokens / makespan if makespan > 0 else 0.0,
        sustained_tokens_per_s=sat_tokens / sat_time if sat_time > 0 else 0.0,
        latency_p50_s=_percentile(gaps, 50),
        latency_p99_s=_percentile(gaps, 99),
        ttft_p50_s=_percentile(ttft, 50),
        ttft_p99_s=_percentile(ttft, 99),
        peak_kv_load=peak,
        mean_kv_load=load_time / makespan if makespan > 0 else 0.0,
        imbalance_max_over_mean=imb_time / busy_time if busy_time > 0 else 1.0,
        imbalance_peak=imb_peak,
        mean_running=run_time / makespan if makespan > 0 else 0.0,
        w_limit=core.admission.w_limit(core.steps),
        peak_running=peak_running,
        preemptions=core.preemptions,
        migrations=moved,
        migrated_bytes=moved_bytes,
        migration_seconds=moved_s,
    )
