"""Capacity planner: the paper's performance model (ARCHITECTURE.md, "The FastDecode idea").

Inputs come from micro-benchmarks (a `Profile`): T(B), the S-part seconds of one layer at batch B, and
R, the seconds one R-worker (shard) spends attending one new token against one cached token in one
layer. With S the expected sequence length, N layers, L a latency budget, C the KV tokens one shard
holds and P shards:
  latency:  2 * N * S * T(B) <= L                 (the largest B that fits)
  no bound: B where E(B) = B / T(B) stops improving (next measured B gains < 5%)
  memory:   B * S / 2 <= C * P                     (mean sequence holds S/2 tokens)
  balance:  P = B * S * R / (2 * T(B))             (R-part of the mean load = S-part)
Predicted step (two mini-batches pipelined, per layer the slower of the two sides):
  step = N * max(T(B), B * S * R / (2 * P)),  tokens/s = B / step.
The latency rule is the paper's; it counts the two mini-batches' S-parts back to back, so it is
stricter than S * step.
"""

from __future__ import annotations

import itertools
import json
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from fastdecode.runtime.errors import InvalidInput
from fastdecode.runtime.geometry import KVGeometry, check_windows, window_held, window_mean_held

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
EFFICIENCY_GAIN = 0.05  # "stops improving": the next measured batch size gains less than this


@dataclass
class Profile:
    """Measured costs of one model on one device (saved and loaded as JSON)."""

    t_dense: dict[int, float]  # batch size -> S-part seconds per layer
    r_attn: float  # seconds per new token per cached token, one shard, one layer
    num_layers: int
    kv_bytes_per_token: int  # KV bytes one token takes over all layers
    device: str = "cpu"
    model: str | None = None
    notes: dict[str, float | int | str] = field(default_factory=dict)
    # Per-layer cost of moving q, k, v out and o back (one Attend round trip beyond the attention
    # itself); measured on the real transport, 0 when unknown. The paper's iteration spent 10 of
    # 43 ms on copies and network.
    rtt_s: float = 0.0
    # Once per step, not per layer: embedding, final norm, LM head and sampling at batch B (seconds,
    # measured with T(B); empty when unknown). Small next to N layers on a 7B model, not on a
    # 12-layer one.
    t_head: dict[int, float] = field(default_factory=dict)
    # Attention window per layer (0 = full; empty = all full): S / 2 becomes what a sequence holds on average
    layer_windows: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.t_dense = {int(b): float(t) for b, t in self.t_dense.items()}
        self.t_head = {int(b): float(t) for b, t in self.t_head.items()}
        if not self.t_dense or any(b < 1 or t <= 0 for b, t in self.t_dense.items()):
            raise InvalidInput("profile needs T(B) > 0 samples at batch sizes >= 1")
        if self.r_attn <= 0 or self.num_layers < 1 or self.kv_bytes_per_token < 1:
            raise InvalidInput("profile needs r_attn > 0, num_layers >= 1, kv_bytes_per_token >= 1")
        self.layer_windows = check_windows([int(w) for w in self.layer_windows], self.num_layers)

    @property
    def batch_sizes(self) -> list[int]:
        return sorted(self.t_dense)

    def t_at(self, batch: int) -> float:
        """T(B): piecewise linear between samples, linear beyond the last two, flat below the first."""
        return _interpolate(self.t_dense, batch)

    def head_at(self, batch: int) -> float:
        """The per-step head time at batch B (0 when not measured)."""
        return _interpolate(self.t_head, batch) if self.t_head else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["t_dense"] = {str(b): t for b, t in sorted(self.t_dense.items())}
        d["t_head"] = {str(b): t for b, t in sorted(self.t_head.items())}
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Profile:
        try:
            return cls(
                t_dense={int(b): float(t) for b, t in d["t_dense"].items()},
                r_attn=float(d["r_attn"]),
                num_layers=int(d["num_layers"]),
                kv_bytes_per_token=int(d["kv_bytes_per_token"]),
                device=str(d.get("device", "cpu")),
                model=d.get("model"),
                notes=dict(d.get("notes", {})),
                rtt_s=float(d.get("rtt_s", 0.0)),
                t_head={int(b): float(t) for b, t in d.get("t_head", {}).items()},
                layer_windows=list(d.get("layer_windows", [])),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise InvalidInput(f"bad profile: {e!r}") from e

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        try:
            return cls.from_dict(json.loads(Path(path).read_text()))
        except json.JSONDecodeError as e:
            raise InvalidInput(f"{path}: not JSON: {e}") from e


def _interpolate(samples: dict[int, float], batch: int) -> float:
    bs = sorted(samples)
    if batch in samples:
        return samples[batch]
    if batch <= bs[0]:
        return samples[bs[0]]
    if len(bs) == 1:  # one sample: assume time proportional to the batch (pessimistic)
        return samples[bs[0]] * batch / bs[0]
    for lo, hi in zip(bs, bs[1:], strict=False):
        if lo <= batch <= hi:
            f = (batch - lo) / (hi - lo)
            return samples[lo] + f * (samples[hi] - samples[lo])
    lo, hi = bs[-2], bs[-1]
    slope = max(0.0, (samples[hi] - samples[lo]) / (hi - lo))
    return samples[hi] + slope * (batch - hi)


@dataclass
class Plan:
    batch_size: int
    shards: int
    predicted_step_ms: float
    predicted_tokens_per_s: float
    limiting_factor: str  # latency | gpu-efficiency | memory | balance
    shards_set_by: str  # balance | memory | given
    seq_len: int
    t_dense_ms: float  # T(B)
    r_part_ms: float  # B * S * R / (2P) per layer
    gpu_efficiency: float  # B / T(B), sequences per second per layer
    p_balance: float  # B * S * R / (2 * T(B))
    p_memory: float | None  # B * S / (2 * C)
    predicted_latency_s: float  # S * step
    paper_latency_s: float  # 2 * N * S * T(B)
    kv_tokens_per_shard: int | None
    # KV a sequence holds at S as a share of full attention; on average over its life (S/2 without windows)
    kv_held_ratio: float = 1.0
    mean_held_tokens: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


def r_part_s(profile: Profile, batch: int, shards: int, seq_len: int) -> float:
    """Per-layer R-part seconds at the mean load B * S / 2 spread over P, plus the round trip."""
    return batch * window_mean_held(profile.layer_windows, seq_len) * profile.r_attn / shards + profile.rtt_s


def predicted_step_s(profile: Profile, batch: int, shards: int, seq_len: int, overlap: bool = True) -> float:
    """N layers of max(S, R) when the pipeline overlaps them on separate hardware, else of S + R;
    plus the step's head (LM head and sampling) when measured."""
    s_part, r_part = profile.t_at(batch), r_part_s(profile, batch, shards, seq_len)
    layers = profile.num_layers * (max(s_part, r_part) if overlap else s_part + r_part)
    return layers + profile.head_at(batch)


@dataclass
class SplitParts:
    """One decode step's measured parts on separate hosts (seconds per step, all layers): the dense
    host's S-part compute as the fleet runs it (`dense_s`: two half batches when piped), the
    exchange's CPU on the dense host (`dense_exchange_s`: gRPC, codec, event loop), the shards'
    attention (`attention_s`, the slowest shard) and the shard process's CPU beyond it
    (`shard_exchange_s`: parsing q, k, v, encoding o)."""

    dense_s: float
    attention_s: float
    num_layers: int
    dense_exchange_s: float = 0.0
    shard_exchange_s: float = 0.0
    wire_s: float = 0.0  # per layer: network latency of one round trip beyond both sides' CPU
    # the dense host's own share of the attention (a shard gpu_dense hosts: --host-shard), on its
    # cores; `attention_s` is then the shard hosts' share alone
    host_attention_s: float = 0.0
    # the step's serial tail, not in `dense_s`: the LM head and sampling run once every layer's
    # attention is in, with the shard hosts idle (the next step's tokens come from them)
    tail_s: float = 0.0


def split_step_s(parts: SplitParts, pipelined: bool) -> float:
    """Predicted fleet step on separate dense and shard hardware. Per layer the dense host spends
    d = (S + X) / N, the shard host r = (R + Y) / N. Unpiped they run one after the other: d + r + wire.
    With two mini-batches each side works on one half while the other side works on the other, so
    a layer takes the busier side, but no less than one half's own chain: half of both sides plus
    the wire, ((d + r) / 2 + wire), which is what limits it when the sides are balanced.
    A hosted share h = H / N runs on the dense host while the shard hosts attend theirs: unpiped
    d + max(h, r + wire); piped it is part of the dense side's work, d + h. The tail comes after."""
    if (
        parts.num_layers < 1
        or min(parts.dense_s, parts.attention_s, parts.host_attention_s, parts.tail_s) < 0
    ):
        raise InvalidInput("split parts need num_layers >= 1 and non-negative times")
    n = parts.num_layers
    d = (parts.dense_s + max(0.0, parts.dense_exchange_s)) / n
    r = (parts.attention_s + max(0.0, parts.shard_exchange_s)) / n
    h = parts.host_attention_s / n
    if pipelined:
        layer = max(d + h, r, (d + h + r) / 2 + parts.wire_s)
    else:
        layer = d + max(h, r + parts.wire_s)
    return n * layer + parts.tail_s


@dataclass(frozen=True)
class HostShare:
    """How many of a step's sequences the dense host attends itself, and the step that gives."""

    sequences: int
    pipelined: bool
    predicted_step_s: float


def best_host_share(
    batch: int,
    num_layers: int,
    dense_s: float,
    dense_halves_s: float,
    host_attention_s: float,
    attention_s: float,
    exchange_rt_s: tuple[float, float] = (0.0, 0.0),
    modes: tuple[bool, ...] = (False, True),
    tail_s: float = 0.0,
) -> HostShare:
    """The share of a batch of equal sequences that a shard hosted on the dense host should hold.

    `dense_s` and `dense_halves_s`: the layers' S-part of one batch and of two half batches (on a
    CPU dense host at small B two passes read the weights twice), `tail_s` the LM head and sampling
    after them; `host_attention_s` and `attention_s`: the
    whole batch's attention on the dense host's cores and on the shard hosts'; `exchange_rt_s`: the
    exchange's CPU per round trip on the dense and on the shard side. Every count 0..batch-1 and
    every mode is scored with split_step_s; the fastest wins (ties: fewer hosted, unpiped)."""
    if batch < 2 or num_layers < 1:
        raise InvalidInput("a host share needs batch >= 2 and num_layers >= 1")
    best: HostShare | None = None
    for piped in modes:
        rts = num_layers * (2 if piped else 1)
        for k in range(batch):
            parts = SplitParts(
                dense_s=dense_halves_s if piped else dense_s,
                attention_s=attention_s * (batch - k) / batch,
                num_layers=num_layers,
                dense_exchange_s=exchange_rt_s[0] * rts,
                shard_exchange_s=exchange_rt_s[1] * rts,
                host_attention_s=host_attention_s * k / batch,
                tail_s=tail_s,
            )
            step = split_step_s(parts, piped)
            if best is None or step < best.predicted_step_s * (1 - 1e-9):
                best = HostShare(k, piped, step)
    assert best is not None
    return best


def split_ideal_ratio(dense_s: float, attention_s: float) -> float:
    """The most the split can gain over one host doing both: (S + R) / max(S, R)."""
    top = max(dense_s, attention_s)
    return (dense_s + attention_s) / top if top > 0 else float("nan")


def predicted_tokens_per_s(profile: Profile, batch: int, shards: int, seq_len: int) -> float:
    return batch / predicted_step_s(profile, batch, shards, seq_len)


def p_balance(profile: Profile, batch: int, seq_len: int) -> float:
    return batch * window_mean_held(profile.layer_windows, seq_len) * profile.r_attn / profile.t_at(batch)


def knee(profile: Profile, gain: float = EFFICIENCY_GAIN) -> int:
    """The smallest measured B that no larger B beats by more than `gain` in E(B) = B / T(B).

    Compared against every larger B, not just the next one, so one noisy sample (a slow B=2 on a
    busy machine) cannot stop the search early.
    """
    bs = profile.batch_sizes
    eff = {b: b / profile.t_at(b) for b in bs}
    for i, b in enumerate(bs):
        if all(eff[hi] < (1 + gain) * eff[b] for hi in bs[i + 1 :]):
            return b
    return bs[-1]


def plan(
    profile: Profile,
    seq_len: int,
    *,
    latency_budget_s: float | None = None,
    shard_memory_bytes: int | None = None,
    shards: int | None = None,
    gain: float = EFFICIENCY_GAIN,
) -> Plan:
    """Choose B and P from the profile (see the module docstring for the equations)."""
    if seq_len < 1:
        raise InvalidInput("seq_len must be >= 1")
    if shards is not None and shards < 1:
        raise InvalidInput("shards must be >= 1")
    N, S = profile.num_layers, seq_len
    held = window_mean_held(profile.layer_windows, S)  # S / 2 without windowed layers
    bs = profile.batch_sizes
    factor = "gpu-efficiency"
    batch = knee(profile, gain)
    if latency_budget_s is not None:
        fits = [b for b in bs if 2 * N * S * profile.t_at(b) <= latency_budget_s]
        if not fits:
            need = 2 * N * S * profile.t_at(bs[0])
            raise InvalidInput(f"no batch size meets the latency budget ({need:.3g} s needed at B={bs[0]})")
        batch = max(fits)
        if batch < bs[-1]:
            factor = "latency"
    cap = None
    if shard_memory_bytes is not None:
        if shard_memory_bytes < profile.kv_bytes_per_token:
            raise InvalidInput("shard memory holds less than one token")
        cap = shard_memory_bytes // profile.kv_bytes_per_token
    if shards is not None:
        P, by = shards, "given"
        if cap is not None and batch * held > cap * P:
            fits = [b for b in bs if b <= batch and b * held <= cap * P]
            if not fits:
                raise InvalidInput(f"{P} shards of {cap} tokens cannot hold B={bs[0]} sequences of {S}")
            batch, factor = max(fits), "memory"
        if factor != "memory" and r_part_s(profile, batch, P, S) > profile.t_at(batch):
            factor = "balance"
    else:
        p_bal = p_balance(profile, batch, S)
        p_mem = batch * held / cap if cap is not None else 0.0
        P = max(1, math.ceil(p_bal - 1e-9), math.ceil(p_mem - 1e-9))
        by = "memory" if p_mem > p_bal and P > 1 else "balance"
    step = predicted_step_s(profile, batch, P, S)
    return Plan(
        batch_size=batch,
        shards=P,
        predicted_step_ms=step * 1e3,
        predicted_tokens_per_s=batch / step,
        limiting_factor=factor,
        shards_set_by=by,
        seq_len=S,
        t_dense_ms=profile.t_at(batch) * 1e3,
        r_part_ms=r_part_s(profile, batch, P, S) * 1e3,
        gpu_efficiency=batch / profile.t_at(batch),
        p_balance=p_balance(profile, batch, S),
        p_memory=batch * held / cap if cap is not None else None,
        predicted_latency_s=S * step,
        paper_latency_s=2 * N * S * profile.t_at(batch),
        kv_tokens_per_shard=cap,
        kv_held_ratio=window_held(profile.layer_windows, S) / S,
        mean_held_tokens=held,
    )


def plot_plan(profile: Profile, chosen: Plan, path: str | Path) -> None:
    """Predicted tokens/s against P (for a few B) and against B (at the chosen P), chosen point marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    S = chosen.seq_len
    fig, (ax_p, ax_b) = plt.subplots(1, 2, figsize=(11, 4.2))
    ps = list(range(1, max(8, 2 * chosen.shards) + 1))
    for b in profile.batch_sizes:
        ax_p.plot(ps, [predicted_tokens_per_s(profile, b, p, S) for p in ps], label=f"B={b}", lw=1)
    ax_p.plot([chosen.shards], [chosen.predicted_tokens_per_s], "r*", ms=14, label="chosen")
    ax_p.set_xlabel("shards P")
    ax_p.set_ylabel("predicted tokens/s")
    ax_p.set_title(f"throughput vs P (S={S})")
    ax_p.legend(fontsize=7, ncol=2)
    bs = profile.batch_sizes
    at_p = [predicted_tokens_per_s(profile, b, chosen.shards, S) for b in bs]
    ax_b.plot(bs, at_p, "o-", label=f"P={chosen.shards}")
    balanced = [b / (profile.num_layers * profile.t_at(b)) for b in bs]
    ax_b.plot(bs, balanced, "--", color="gray", label="P balanced")
    ax_b.plot([chosen.batch_size], [chosen.predicted_tokens_per_s], "r*", ms=14, label="chosen")
    ax_b.set_xscale("log", base=2)
    ax_b.set_xlabel("batch B")
    ax_b.set_title(f"throughput vs B (limit: {chosen.limiting_factor})")
    ax_b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ------------------------------------------------------------------ measurement


def _median_time(
    fn: Callable[[], None], repeats: int, warmup: int, sync: Callable[[], None] | None = None
) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if sync is not None:
            sync()
        t0 = time.perf_counter()
        fn()
        if sync is not None:
            sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _sync_for(device: str) -> Callable[[], None] | None:
    if str(device).startswith("cuda"):
        import torch

        return torch.cuda.synchronize
    return None


def measure_dense(
    model_dir: str | Path,
    batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES,
    device: str = "cpu",
    *,
    repeats: int = 5,
    warmup: int = 2,
) -> dict[int, float]:
    """T(B): seconds of one layer's dense step (pre_attention + post_attention) at batch B, median."""
    import torch

    from fastdecode.model.dense import DenseModel

    m = DenseModel.from_pretrained(model_dir, device=device, dtype=torch.float32)
    return _dense_times(m, batch_sizes, device, repeats=repeats, warmup=warmup)


def _dense_times(
    m: Any, batch_sizes: Sequence[int], device: str, *, repeats: int = 5, warmup: int = 2, position: int = 64
) -> dict[int, float]:
    import torch

    cfg = m.config
    width = cfg.num_attention_heads * cfg.head_dim
    vocab = int(getattr(cfg, "vocab_size", 2))
    sync = _sync_for(device)
    gen = torch.Generator().manual_seed(0)
    out: dict[int, float] = {}
    layers = itertools.cycle(range(cfg.num_hidden_layers))
    with torch.inference_mode():
        for b in sorted(set(int(x) for x in batch_sizes)):
            if b < 1:
                raise InvalidInput("batch sizes must be >= 1")
            ids = torch.randint(0, vocab, (b,), generator=gen).to(device)
            pos = torch.full((b,), position, dtype=torch.long, device=device)
            h = m.embed(ids)
            attn = torch.randn(b, width, generator=gen).to(device=device, dtype=h.dtype)

            def once(h: torch.Tensor = h, pos: torch.Tensor = pos, attn: torch.Tensor = attn) -> None:
                # a different layer each call, as a step walks them: one layer's weights timed over
                # and over stay in a large L3 (38 MB of the small preset's in 260 MB) and read 5-15% fast
                layer = next(layers)
                m.pre_attention(layer, h, pos)
                m.post_attention(layer, h, attn)

            out[b] = _median_time(once, repeats, warmup, sync)
    return out


def _head_times(m: Any, batch_sizes: Sequence[int], device: str, *, repeats: int = 5) -> dict[int, float]:
    """Seconds of one step's head at each B: final norm, LM head and greedy sampling."""
    import torch

    from fastdecode.contract import SamplingParams
    from fastdecode.dense.sampling import sample

    sync = _sync_for(device)
    gen = torch.Generator().manual_seed(0)
    out: dict[int, float] = {}
    with torch.inference_mode():
        for b in sorted(set(int(x) for x in batch_sizes)):
            h = torch.randn(b, m.config.hidden_size, generator=gen).to(device)
            params = [SamplingParams()] * b
            idx = [0] * b

            def once(h: torch.Tensor = h, params: list = params, idx: list = idx) -> None:
                sample(m.logits(h), params, idx)

            out[b] = _median_time(once, repeats, 2, sync)
    return out


def measure_attention(
    num_kv_heads: int,
    num_heads: int,
    head_dim: int,
    context: int,
    batch: int,
    *,
    repeats: int = 5,
    warmup: int = 2,
    kv_dtype: Any = None,
    flush_bytes: int = 1 << 30,
) -> float:
    """R: seconds per new token per cached token for one KV store (one layer), from decode steps of
    `batch` sequences holding `context` tokens each, KV in `kv_dtype` (default float32).

    Before each timed step a `flush_bytes` buffer is read: in a real step a layer's KV was last read
    one step ago, with every other layer and the dense weights read since, so it comes from DRAM.
    Timed back to back, a small store stays in a large L3 and R reads 2-3x fast."""
    import torch

    from fastdecode.kv import AttendBatch, KVStore

    if min(num_kv_heads, num_heads, head_dim, context, batch) < 1:
        raise InvalidInput("measure_attention needs positive sizes")
    steps = repeats + warmup
    per_token = 2 * num_kv_heads * (head_dim + 1) * 4  # room for any KV dtype, int8's scales included
    capacity = int(per_token * batch * (context + steps + 1) * 2) + (1 << 20)
    kv = KVStore(KVGeometry(1, num_kv_heads, head_dim), capacity, dtype=kv_dtype or torch.float32)
    ids = [f"m{i}" for i in range(batch)]
    for s in ids:
        kv.reserve(s, context + steps + 1)
    gen = torch.Generator().manual_seed(0)

    def qkv(t: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return (
            torch.randn(t, num_heads, head_dim, generator=gen),
            torch.randn(t, num_kv_heads, head_dim, generator=gen),
            torch.randn(t, num_kv_heads, head_dim, generator=gen),
        )

    flush = torch.ones(max(1, flush_bytes // 4))
    times = []
    with torch.inference_mode():
        for s in ids:  # fill each cache with `context` tokens, one sequence at a time to bound memory
            q, k, v = qkv(context)
            kv.attend(0, AttendBatch([s], [context], [0], q, k, v))
        for step in range(steps):
            q, k, v = qkv(batch)
            flush.sum()
            t0 = time.perf_counter()
            kv.attend(0, AttendBatch(ids, [1] * batch, [context + step] * batch, q, k, v))
            if step >= warmup:
                times.append(time.perf_counter() - t0)
    return statistics.median(times) / (batch * (context + warmup + repeats / 2))


def measure_profile(
    model_dir: str | Path,
    batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES,
    device: str = "cpu",
    *,
    context: int = 256,
    attn_batch: int = 8,
    attn_threads: int | None = None,
    kv_dtype: str = "float32",
) -> Profile:
    """Measure T(B) on `device` and R on this host's CPU for the model in model_dir. `attn_threads`:
    the torch threads one shard runs with (co-located shards split the host's cores, and R per
    shard is what sets the step), default torch's; `kv_dtype`: the shards' KV storage type."""
    import torch

    from fastdecode.model.dense import DenseModel

    m = DenseModel.from_pretrained(model_dir, device=device, dtype=torch.float32)
    cfg = m.config
    t = _dense_times(m, batch_sizes, device)
    head = _head_times(m, batch_sizes, device)
    before = torch.get_num_threads()
    if attn_threads:
        torch.set_num_threads(attn_threads)
    try:
        r = measure_attention(
            cfg.num_key_value_heads,
            cfg.num_attention_heads,
            cfg.head_dim,
            context,
            attn_batch,
            kv_dtype=getattr(torch, kv_dtype),
        )
    finally:
        torch.set_num_threads(before)
    return Profile(
        t_dense=t,
        r_attn=r,
        num_layers=int(cfg.num_hidden_layers),
        kv_bytes_per_token=cfg.kv_bytes_per_token(4),
        device=str(device),
        model=str(model_dir),
        t_head=head,
        layer_windows=list(cfg.layer_windows),
        notes={
            "dtype": "float32",
            "kv_dtype": kv_dtype,
            "attn_context": context,
            "attn_batch": attn_batch,
            "attn_threads": attn_threads or before,
        },
    )
