"""`fastdecode plan --acceptance R1,R2,... | --acceptance-length TAU`: the operating point with and
without speculative drafts, from the planner's performance model (planner.py).

With k drafts on every decode row (as `bench split` runs them) a step's S-part runs B * (k + 1)
positions: T(B * (k + 1)) per layer and the head at B * (k + 1), the profile's T interpolated (flat
where a GPU's GEMMs stay memory-bound, growing with every token on a CPU); a shard reads each
sequence's KV once for its k + 1 queries, at (1 + ATTEND_PER_POSITION * k) times one's attention.
A step yields B * tau(k) tokens. B and P are chosen as `planner.plan` chooses them, on the profile
those costs make (the knee of B / T(B * (k + 1)), P balanced against the costlier attention, the
same KV per sequence for memory; a latency budget counts S / tau steps). k is the one in 0..K with
the most tokens/s (`controller.best_k`, ties to fewer drafts): the scheduler's --speculative-k auto
scores k the same way from the steps it measures (fastdecode/spec/controller.py). With
--acceptance-length the tau is given at K and only K is scored against none.

Rates mean what `bench split --acceptance` means: per draft position, the share of rows offering a
draft there that keep it (`controller.expected_tau`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace

from fastdecode.planning.planner import Plan, Profile, plan
from fastdecode.runtime.errors import InvalidInput
from fastdecode.spec.controller import ATTEND_PER_POSITION, best_k, expected_tau


def parse_rates(text: str) -> list[float]:
    """'0.65,0.6,0.5': rates in [0, 1], one per draft position."""
    try:
        rates = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        rates = []
    if not rates or not all(0.0 <= r <= 1.0 for r in rates):
        raise InvalidInput(
            f"acceptance: comma-separated rates in [0, 1], one per draft position, got {text!r}"
        )
    return rates


def drafted_profile(profile: Profile, k: int) -> Profile:
    """The profile a batch of rows each carrying k drafts sees: B rows cost the S-part and the head of
    B * (k + 1) positions, and the shards (1 + ATTEND_PER_POSITION * k) times the attention."""
    if k == 0:
        return profile
    return replace(
        profile,
        t_dense={b: profile.t_at(b * (k + 1)) for b in profile.batch_sizes},
        t_head={b: profile.head_at(b * (k + 1)) for b in profile.t_head},
        r_attn=profile.r_attn * (1 + ATTEND_PER_POSITION * k),
        notes={**profile.notes, "drafts_per_row": k},
    )


@dataclass
class SpecPoint:
    """One k's operating point: the plan on its drafted profile, and what its steps yield."""

    k: int
    tau: float
    batch_size: int
    shards: int
    predicted_step_ms: float
    tokens_per_s: float
    latency_s: float  # S tokens at S / tau steps
    tokens_per_s_per_shard: float  # where P is free, drafts pay in shards: fewer for the tokens/s


@dataclass
class SpecPlan:
    chosen: SpecPoint  # the k with the most tokens/s
    plain: SpecPoint  # k = 0
    ratio: float  # chosen tokens/s over plain's
    points: list[SpecPoint]  # each k scored

    def to_dict(self) -> dict:
        return asdict(self)


def point(
    profile: Profile,
    seq_len: int,
    k: int,
    tau: float,
    *,
    latency_budget_s: float | None = None,
    shard_memory_bytes: int | None = None,
    shards: int | None = None,
) -> tuple[SpecPoint, Plan]:
    """The planner's choice at k drafts a row, each row yielding tau tokens a step."""
    p = plan(
        drafted_profile(profile, k),
        seq_len,
        latency_budget_s=latency_budget_s * tau if latency_budget_s is not None else None,
        shard_memory_bytes=shard_memory_bytes,
        shards=shards,
    )
    return SpecPoint(
        k=k,
        tau=tau,
        batch_size=p.batch_size,
        shards=p.shards,
        predicted_step_ms=p.predicted_step_ms,
        tokens_per_s=p.predicted_tokens_per_s * tau,
        latency_s=p.predicted_latency_s / tau,
        tokens_per_s_per_shard=p.predicted_tokens_per_s * tau / p.shards,
    ), p


def plan_speculative(
    profile: Profile,
    seq_len: int,
    max_k: int,
    *,
    rates: Sequence[float] | None = None,
    tau: float | None = None,
    latency_budget_s: float | None = None,
    shard_memory_bytes: int | None = None,
    shards: int | None = None,
) -> SpecPlan:
    """Score k = 0..max_k with `rates` (tau(k) from them), or only 0 and max_k with `tau` at max_k."""
    if max_k < 1:
        raise InvalidInput("speculation needs at least one draft a row")
    if (rates is None) == (tau is None):
        raise InvalidInput("give the acceptance rates or the acceptance length, one of them")
    if tau is not None and not 1.0 <= tau <= max_k + 1:
        raise InvalidInput(f"an acceptance length at {max_k} drafts is in [1, {max_k + 1}], got {tau:g}")
    taus = (
        {0: 1.0, max_k: tau}
        if tau is not None
        else {k: expected_tau(rates or [], k) for k in range(max_k + 1)}
    )
    bounds = {
        "latency_budget_s": latency_budget_s,
        "shard_memory_bytes": shard_memory_bytes,
        "shards": shards,
    }
    points = {k: point(profile, seq_len, k, t, **bounds)[0] for k, t in taus.items()}
    ks = sorted(points)
    best = ks[best_k(lambda i: points[ks[i]].tokens_per_s, len(ks) - 1)]
    chosen, plain = points[best], points[0]
    return SpecPlan(chosen, plain, chosen.tokens_per_s / plain.tokens_per_s, [points[k] for k in ks])
