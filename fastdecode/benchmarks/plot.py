"""`fastdecode bench fleet --plot`: throughput and latency of the compared systems as one PNG.

Takes run_fleet_bench's result dict as it is (systems found by their `<name>_tokens_per_s` keys,
so a --skip-hf run simply has two bars). Draws with matplotlib's object API on the Agg canvas:
no pyplot state, no display needed.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.figure import Figure

# Result-key prefix -> label, in plotting order.
SYSTEMS = (("hf", "transformers"), ("local", "LocalEngine"), ("fleet", "fleet"))
COLORS = {"hf": "#8c8c8c", "local": "#4c72b0", "fleet": "#dd8452"}


def _num(result: dict[str, Any], key: str) -> float:
    value = result.get(key)
    return float(value) if isinstance(value, int | float) else math.nan


def _png(fig: Figure, path: str | Path) -> Path:
    out = Path(path)
    fig.savefig(out, format="png", dpi=100)
    return out


def plot_title(result: dict[str, Any]) -> str:
    model = Path(str(result.get("model", "?"))).name
    context = f"{result.get('prompt_len', '?')}+{result.get('gen_len', '?')}"
    return (
        f"bench fleet: {model}, batch {result.get('batch', '?')}, context {context} tokens, "
        f"{result.get('shards', '?')} shards, {result.get('device', '?')}"
    )


def fleet_bench_figure(result: dict[str, Any]) -> Figure:
    """Tokens/s per system (left), inter-token latency p50 with p10-p90 and p99 (right)."""
    from matplotlib.figure import Figure

    systems = [(key, label) for key, label in SYSTEMS if f"{key}_tokens_per_s" in result]
    if not systems:
        raise ValueError("no system results to plot (expected keys like 'fleet_tokens_per_s')")
    labels = [label for _, label in systems]
    colors = [COLORS[key] for key, _ in systems]
    xs = range(len(systems))

    fig = Figure(figsize=(10, 4.5), layout="constrained")
    throughput, latency = fig.subplots(1, 2)

    tps = [_num(result, f"{key}_tokens_per_s") for key, _ in systems]
    bars = throughput.bar(xs, tps, color=colors)
    throughput.bar_label(bars, fmt="%.0f", padding=2)
    throughput.margins(y=0.1)  # room for the labels above the bars
    throughput.set_title("throughput")
    throughput.set_ylabel("tokens / s (all sequences)")

    p50 = [_num(result, f"{key}_itl_p50_ms") for key, _ in systems]
    p10 = [_num(result, f"{key}_itl_p10_ms") for key, _ in systems]
    p90 = [_num(result, f"{key}_itl_p90_ms") for key, _ in systems]
    p99 = [_num(result, f"{key}_itl_p99_ms") for key, _ in systems]
    latency.bar(xs, p50, color=colors, label="p50")
    # Error bars need p10 <= p50 <= p90; a result without them (older runs) just has no bars.
    lower = [m - lo if lo <= m else math.nan for m, lo in zip(p50, p10, strict=True)]
    upper = [hi - m if hi >= m else math.nan for m, hi in zip(p50, p90, strict=True)]
    latency.errorbar(xs, p50, yerr=[lower, upper], fmt="none", ecolor="black", capsize=6, label="p10–p90")
    latency.scatter(xs, p99, marker="x", color="black", zorder=3, label="p99")
    latency.set_title("inter-token latency")
    latency.set_ylabel("ms per token")
    finite = [v for v in (*p50, *p90, *p99) if math.isfinite(v)]
    if finite:  # headroom above the tallest mark for the legend
        latency.set_ylim(0, max(finite) * 1.3)
    latency.legend(loc="upper center", ncols=3, fontsize="small")

    for ax in (throughput, latency):
        ax.set_xticks(list(xs), labels)
        ax.set_ylim(bottom=0)  # keeps the latency panel's top
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(plot_title(result))
    return fig


def plot_fleet_bench(result: dict[str, Any], path: str | Path) -> Path:
    """Write fleet_bench_figure(result) as a PNG at `path`."""
    return _png(fleet_bench_figure(result), path)


def split_bench_figure(result: dict[str, Any]) -> Figure:
    """`bench split`: tokens/s of LocalEngine (dense host alone) and of the fleet against context,
    the crossover marked; ratio and ideal ratio on the right."""
    from matplotlib.figure import Figure

    points = result.get("points") or []
    if not points:
        raise ValueError("no points to plot")
    ctx = [p["context"] for p in points]
    fig = Figure(figsize=(10, 4.5), layout="constrained")
    tps, ratio = fig.subplots(1, 2)
    for key, label in (("local", "LocalEngine (dense host alone)"), ("fleet", "fleet (dense + shard hosts)")):
        tps.plot(ctx, [p[f"{key}_tokens_per_s"] for p in points], "o-", color=COLORS[key], label=label)
    cross = result.get("crossover_context")
    if cross is not None:
        tps.axvline(cross, color="gray", ls="--", lw=1, label=f"crossover: {cross}")
    tps.set_xscale("log", base=2)
    tps.set_xlabel("context (tokens cached per sequence)")
    tps.set_ylabel("tokens / s (all sequences)")
    tps.set_title("throughput")
    tps.set_ylim(bottom=0)
    tps.legend(fontsize="small")
    ratio.plot(ctx, [p["ratio"] for p in points], "o-", color=COLORS["fleet"], label="fleet / local")
    ratio.plot(ctx, [p["ideal_ratio"] for p in points], "--", color="black", label="ideal (S+R)/max(S,R)")
    ratio.axhline(1.0, color="gray", lw=1)
    ratio.set_xscale("log", base=2)
    ratio.set_xlabel("context")
    ratio.set_title("ratio")
    ratio.legend(fontsize="small")
    for ax in (tps, ratio):
        ax.grid(alpha=0.3)
    model = Path(str(result.get("model", "?"))).name
    shards = ", ".join(result.get("shard_cpus", []))
    fig.suptitle(
        f"bench split: {model}, B={result.get('batch')}, {result.get('kv_dtype')} KV, dense CPUs "
        f"{result.get('dense_cpus')}, shard CPUs {shards} ({result.get('isolation')})"
    )
    return fig


def plot_split_bench(result: dict[str, Any], path: str | Path) -> Path:
    return _png(split_bench_figure(result), path)


def spec_bench_figure(result: dict[str, Any]) -> Figure:
    """`bench spec`: tokens/s per mode (left), the share of drafts kept at each draft position (right)."""
    from matplotlib.figure import Figure

    modes = [m for m in ("off", "off_ahead", "ngram", "suffix") if f"{m}_tokens_per_s" in result]
    fig = Figure(figsize=(11, 4.2))
    left, right = fig.subplots(1, 2)
    left.bar(modes, [_num(result, f"{m}_tokens_per_s") for m in modes], color="#4c72b0")
    left.set_ylabel("tokens/s")
    left.set_title("throughput")
    for m in modes:
        kept = result.get(f"{m}_kept_at_position")
        if kept:
            right.plot(
                range(1, len(kept) + 1), [math.nan if k is None else k for k in kept], marker="o", label=m
            )
            right.set_xticks(range(1, len(kept) + 1))
    right.set_xlabel("draft position")
    right.set_ylabel("share kept")
    right.set_ylim(0, 1)
    right.set_title("acceptance per position")
    if right.lines:
        right.legend()
    fig.suptitle(
        f"bench spec: {result.get('model', '?')}, batch {result.get('batch', '?')}, "
        f"{result.get('max_tokens', '?')} tokens, k = {result.get('k', '?')}"
    )
    return fig


def plot_spec_bench(result: dict[str, Any], path: str | Path) -> Path:
    return _png(spec_bench_figure(result), path)
