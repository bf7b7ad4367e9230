"""`fastdecode simulate` and `fastdecode plan` (the root group adds these with add_command)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import click

from fastdecode.runtime.errors import ServiceError

if TYPE_CHECKING:  # annotations only: the commands import what they run when run
    from fastdecode.planning.spec_plan import SpecPlan, SpecPoint

SIM_KEYS = (
    "tokens_per_s",
    "sustained_tokens_per_s",
    "latency_p50_s",
    "latency_p99_s",
    "ttft_p50_s",
    "peak_kv_load",
    "mean_kv_load",
    "imbalance_max_over_mean",
    "mean_running",
    "peak_running",
    "preemptions",
    "migrations",
    "migrated_bytes",
    "steps",
)


def _fmt(v: object) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "-" if v is None else str(v)


@click.command("simulate")
@click.option(
    "--admission", type=click.Choice(["naive", "stabilized"]), default="stabilized", show_default=True
)
@click.option("--compare", is_flag=True, help="Run naive and stabilized on the same workload, side by side.")
@click.option("--workload", type=click.Path(exists=True, dir_okay=False), help="JSON list or JSON lines.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--shards", "-P", type=int, default=4, show_default=True)
@click.option("--batch", "-B", type=int, default=64, show_default=True, help="Max running sequences.")
@click.option("--gen-len", "-S", type=int, default=256, show_default=True, help="Default workload.")
@click.option("--prompt-len", type=int, default=16, show_default=True, help="Default workload (mean).")
@click.option("--requests", type=int, default=None, help="Default workload size (default 8 x batch).")
@click.option("--micro-batch", type=int, default=None, help="Stabilized: sequences per micro-batch.")
@click.option("--w-limit", type=float, default=None, help="Stabilized: load limit in KV tokens.")
@click.option("--prefill-budget", type=int, default=512, show_default=True)
@click.option("--profile", type=click.Path(exists=True, dir_okay=False), help="Planner profile for T(B), R.")
@click.option(
    "--rebalance-factor",
    type=float,
    default=0.0,
    show_default=True,
    help="Live rebalancing as the scheduler does it (its default is 1.1); 0: off.",
)
@click.option(
    "--migrate-mb-per-s", type=float, default=1000.0, show_default=True, help="KV copy speed of a move."
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def simulate_cmd(
    admission: str,
    compare: bool,
    workload: str | None,
    seed: int,
    shards: int,
    batch: int,
    gen_len: int,
    prompt_len: int,
    requests: int | None,
    micro_batch: int | None,
    w_limit: float | None,
    prefill_budget: int,
    profile: str | None,
    rebalance_factor: float,
    migrate_mb_per_s: float,
    as_json: bool,
) -> None:
    """Replay a workload against the real scheduler core with modelled S- and R-part costs."""
    from fastdecode.planning.sim import CostModel, SimConfig, load_workload, paper_workload, simulate

    try:
        if workload:
            items = load_workload(workload)
        else:
            items = paper_workload(
                seed, batch=batch, gen_len=gen_len, prompt_len=prompt_len, requests=requests
            )
        if profile:
            from fastdecode.planning.planner import Profile

            cost = CostModel.from_profile(Profile.load(profile))
        else:
            cost = CostModel.affine(batch=batch, seq_len=gen_len, prompt_len=prompt_len, shards=shards)
        results = {}
        for adm in ("naive", "stabilized") if compare else (admission,):
            cfg = SimConfig(
                admission=adm,
                shards=shards,
                max_running=batch,
                prefill_token_budget=prefill_budget,
                micro_batch=micro_batch,
                w_limit=w_limit,
                cost=cost,
                rebalance_factor=rebalance_factor,
                migrate_bytes_per_s=migrate_mb_per_s * 1e6,
            )
            results[adm] = simulate(items, cfg, seed=seed).to_dict()
    except ServiceError as e:
        raise click.ClickException(str(e)) from e
    if as_json:
        out = results if compare else results[admission]
        click.echo(json.dumps(out, indent=2))
        return
    names = list(results)
    click.echo(f"{'metric':<26}" + "".join(f"{n:>14}" for n in names))
    for key in SIM_KEYS:
        click.echo(f"{key:<26}" + "".join(f"{_fmt(results[n][key]):>14}" for n in names))
    if compare:
        nv, st = results["naive"], results["stabilized"]
        if nv["peak_kv_load"] and nv["tokens_per_s"]:
            click.echo(
                f"stabilized/naive: peak load {st['peak_kv_load'] / nv['peak_kv_load']:.2f}x,"
                f" throughput {st['tokens_per_s'] / nv['tokens_per_s']:.2f}x,"
                f" p99 token latency {st['latency_p99_s'] / max(nv['latency_p99_s'], 1e-12):.2f}x"
            )


@click.command("plan")
@click.option(
    "--model", "model_dir", type=click.Path(exists=True, file_okay=False), help="HF model dir to measure."
)
@click.option(
    "--profile", type=click.Path(exists=True, dir_okay=False), help="A saved profile (no measuring)."
)
@click.option("--save-profile", type=click.Path(dir_okay=False), help="Write the measured profile here.")
@click.option("--device", default="cpu", show_default=True, help="Where to measure T(B).")
@click.option("--batch-sizes", default="1,2,4,8,16,32,64,128,256", show_default=True)
@click.option("--seq-len", "-S", type=int, default=1024, show_default=True, help="Expected sequence length.")
@click.option("--latency-budget", type=float, default=None, help="Seconds to generate S tokens.")
@click.option("--shard-memory", type=int, default=None, help="KV bytes one shard holds.")
@click.option("--shards", "-P", type=int, default=None, help="Fix P instead of choosing it.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.option("--plot", type=click.Path(dir_okay=False), help="Draw throughput vs P and B to this PNG.")
@click.option(
    "--dense-step-ms",
    default=None,
    help="GPU host mode: the S-part's whole step per batch, BATCH=MS[,...] (e.g. 256=10,1024=31); "
    "plans shards and exchange workers from --exchange (docs/exchange.md).",
)
@click.option(
    "--exchange",
    "exchange_file",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="GPU host mode: a `bench exchange --json` result (its last line) giving the costs per MB.",
)
@click.option(
    "--geometry",
    type=click.Choice(["llama-3-8b", "llama-3-70b", "smollm2", "small"]),
    default="llama-3-8b",
    show_default=True,
    help="GPU host mode: the model's shape.",
)
@click.option("--cores", type=int, default=16, show_default=True, help="GPU host mode: the host's cores.")
@click.option(
    "--gpu",
    default=None,
    help="Pace mode: a GPU profile (h100, h200, a10, l4, FILE.json); with --pace, where the split beats "
    "the same GPU holding its own KV, and the dense-host cores it needs (docs/emulated-gpu.md).",
)
@click.option(
    "--pace",
    "pace_file",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="Pace mode: a `bench pace --json` result (its last line): the measured unit costs.",
)
@click.option(
    "--tensor-parallel",
    type=click.IntRange(1, 64),
    default=1,
    show_default=True,
    help="Pace mode: the S-part over this many GPUs (the GPU-alone baseline on as many).",
)
@click.option("--contexts", default="1024,2048,4096,8192", show_default=True, help="Pace mode: contexts S.")
@click.option("--batches", default="256,512,1024,2048", show_default=True, help="Pace mode: batches B.")
@click.option("--shard-counts", default="4,8,16,32", show_default=True, help="Pace mode: shard hosts P.")
@click.option(
    "--shard-gbps",
    type=float,
    default=150.0,
    show_default=True,
    help="Pace mode: KV GB/s one shard host attends.",
)
@click.option("--dtype-bytes", type=int, default=2, show_default=True, help="GPU host mode: 2 = bf16.")
@click.option(
    "--layer-windows",
    default=None,
    help="Attention window per layer, repeated over the layers (0 = full), e.g. 512,512,512,512,512,0 "
    "for Gemma 3's five windowed layers to one global; overrides the model's own.",
)
@click.option(
    "--acceptance",
    default=None,
    help="Speculative drafts: per draft position, the share of rows offering a draft there that keep "
    "it (bench spec's 'kept at draft position'; comma-separated, positions past the list keep the "
    "last): the operating point with the k in 0..K that pays most, against none (docs/speculative.md).",
)
@click.option(
    "--acceptance-length",
    type=click.FloatRange(1.0),
    default=None,
    help="Speculative drafts: tau, the tokens a row with K drafts yields a step (bench spec's tau): "
    "the operating point at K drafts against none.",
)
@click.option(
    "--num-speculative-tokens",
    "-k",
    type=click.IntRange(1, 16),
    default=3,
    show_default=True,
    help="Speculative drafts: K, the most drafts a row carries (with --acceptance or --acceptance-length).",
)
def plan_cmd(
    model_dir: str | None,
    profile: str | None,
    save_profile: str | None,
    device: str,
    batch_sizes: str,
    seq_len: int,
    latency_budget: float | None,
    shard_memory: int | None,
    shards: int | None,
    as_json: bool,
    plot: str | None,
    dense_step_ms: str | None,
    exchange_file: str | None,
    geometry: str,
    cores: int,
    dtype_bytes: int,
    layer_windows: str | None,
    gpu: str | None,
    pace_file: str | None,
    tensor_parallel: int,
    contexts: str,
    batches: str,
    shard_counts: str,
    shard_gbps: float,
    acceptance: str | None,
    acceptance_length: float | None,
    num_speculative_tokens: int,
) -> None:
    """Choose batch size B and shard count P from measured T(B) and R (the paper's model); with
    --dense-step-ms, the exchange workers and shards a GPU host needs per batch (--exchange); with
    --acceptance or --acceptance-length, the same with speculative drafts and without."""
    from fastdecode.planning import planner, spec_plan

    speculating = acceptance is not None or acceptance_length is not None
    if speculating and (acceptance is None) == (acceptance_length is None):
        raise click.UsageError("give --acceptance or --acceptance-length, not both")
    if speculating and (gpu, pace_file, dense_step_ms, exchange_file) != (None,) * 4:
        raise click.UsageError(
            "--acceptance and --acceptance-length plan from a profile (--model or --profile)"
        )
    if gpu is not None or pace_file is not None:
        ints = [[int(x) for x in v.split(",") if x.strip()] for v in (batches, contexts, shard_counts)]
        _plan_pace(gpu, pace_file, geometry, cores, dtype_bytes, shard_gbps, *ints, as_json, tensor_parallel)
        return
    if dense_step_ms is not None or exchange_file is not None:
        _plan_gpu_host(dense_step_ms, exchange_file, geometry, cores, dtype_bytes, shards, as_json)
        return

    try:
        if profile and model_dir:
            raise click.UsageError("give --model or --profile, not both")
        if profile:
            prof = planner.Profile.load(profile)
        else:
            if not model_dir:
                try:
                    from fastdecode.tools.checkpoint import ensure_default_model
                except ImportError as e:
                    raise click.ClickException(f"no --model/--profile and no default model: {e}") from e
                model_dir = str(ensure_default_model())
            sizes = [int(x) for x in batch_sizes.split(",") if x.strip()]
            prof = planner.measure_profile(model_dir, sizes, device)
        if layer_windows is not None:
            prof.layer_windows = _windows(layer_windows, prof.num_layers)
        if save_profile:
            prof.save(save_profile)
        result = planner.plan(
            prof,
            seq_len,
            latency_budget_s=latency_budget,
            shard_memory_bytes=shard_memory,
            shards=shards,
        )
        spec = None
        if speculating:
            spec = spec_plan.plan_speculative(
                prof,
                seq_len,
                num_speculative_tokens,
                rates=spec_plan.parse_rates(acceptance) if acceptance is not None else None,
                tau=acceptance_length,
                latency_budget_s=latency_budget,
                shard_memory_bytes=shard_memory,
                shards=shards,
            )
        if plot:
            planner.plot_plan(prof, result, plot)
    except ServiceError as e:
        raise click.ClickException(str(e)) from e
    except ValueError as e:
        raise click.ClickException(f"bad option: {e}") from e
    d = result.to_dict()
    if spec is not None:
        d["speculation"] = spec.to_dict()
    if as_json:
        click.echo(json.dumps(d, indent=2))
        return
    click.echo(f"batch size B      {result.batch_size}")
    click.echo(f"shards P          {result.shards}  (set by {result.shards_set_by})")
    click.echo(f"step              {result.predicted_step_ms:.3f} ms  = N x max(T(B), B*S*R/(2P))")
    click.echo(f"  T(B) per layer  {result.t_dense_ms:.4f} ms, R-part per layer {result.r_part_ms:.4f} ms")
    click.echo(f"tokens/s          {result.predicted_tokens_per_s:.1f}")
    click.echo(f"limiting factor   {result.limiting_factor}")
    click.echo(f"latency, S tokens {result.predicted_latency_s:.3f} s  (S={seq_len})")
    click.echo(f"  paper's bound   2*N*S*T(B) = {result.paper_latency_s:.3f} s")
    if any(prof.layer_windows):
        click.echo(
            f"KV held / seq    {result.kv_held_ratio:.3f} of full attention at S "
            f"({result.kv_held_ratio * seq_len:.0f} of {seq_len} tokens; "
            f"{result.mean_held_tokens:.0f} on average over its life)"
        )
    if spec is not None:
        _echo_speculation(spec, num_speculative_tokens, shards is not None)
    if plot:
        click.echo(f"plot              {Path(plot)}")


def _echo_speculation(spec: SpecPlan, max_k: int, shards_given: bool) -> None:
    def at(p: SpecPoint) -> str:
        step = f"{p.predicted_step_ms:.3f} ms a step"
        return f"B {p.batch_size}, P {p.shards}, {step}, {p.tokens_per_s:.1f} tokens/s"

    c = spec.chosen
    click.echo(f"without drafts    {at(spec.plain)}")
    paid = f"k {c.k} of {max_k} pays most" if c.k else f"no k of 1..{max_k} pays"
    click.echo(f"with drafts       {paid}: tau {c.tau:.3f}, {at(c)}, {spec.ratio:.2f}x")
    per_k = (
        f"{p.k}: {p.tokens_per_s:.1f} (P {p.shards}, {p.tokens_per_s_per_shard:.1f} a shard)"
        for p in spec.points
    )
    click.echo("  tokens/s per k  " + "; ".join(per_k))
    if not c.k and not shards_given:  # with P free the planner balances it: drafts save shards instead
        click.echo("  (P chosen by the planner: compare tokens/s a shard, or fix P with --shards)")


def _windows(spec: str, num_layers: int) -> list[int]:
    """A comma-separated window pattern repeated over the layers (its length must divide them)."""
    try:
        pattern = [int(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter(
            f"{spec!r} is not a list of integers", param_hint="--layer-windows"
        ) from None
    if not pattern or min(pattern) < 0 or num_layers % len(pattern):
        raise click.BadParameter(
            f"needs windows >= 0, a pattern whose length divides the model's {num_layers} layers",
            param_hint="--layer-windows",
        )
    return pattern * (num_layers // len(pattern))


def _plan_gpu_host(
    step_spec: str | None,
    exchange_file: str | None,
    geometry: str,
    cores: int,
    dtype_bytes: int,
    shards: int | None,
    as_json: bool,
) -> None:
    from fastdecode.planning.exchange_plan import ExchangeCosts, parse_step_ms, plan_hosts
    from fastdecode.runtime.geometry import GEOMETRIES

    if step_spec is None or exchange_file is None:
        raise click.UsageError("GPU host mode needs both --dense-step-ms and --exchange")
    try:
        lines = Path(exchange_file).read_text().strip().splitlines()
        try:
            bench = json.loads(lines[-1]) if lines else None
        except json.JSONDecodeError as e:
            raise click.ClickException(f"{exchange_file}: last line is not JSON ({e})") from None
        costs = ExchangeCosts.from_bench(bench, source=exchange_file)
        plans = plan_hosts(
            GEOMETRIES[geometry], parse_step_ms(step_spec), costs, cores, dtype_bytes, min_shards=shards or 1
        )
    except ServiceError as e:
        raise click.ClickException(str(e)) from e
    if as_json:
        click.echo(json.dumps({"costs": costs.__dict__, "plans": [p.to_dict() for p in plans]}, indent=2))
        return
    click.echo(
        f"exchange costs ({costs.source}): in process {costs.inproc_ms_per_mb:.3f} ms/MB of dense CPU; "
        f"with workers {costs.dense_ms_per_mb:.3f} ms/MB dense + {costs.worker_ms_per_mb:.3f} ms/MB "
        f"workers; one worker {costs.worker_gbps:.2f} GB/s"
    )
    for p in plans:
        click.echo(
            f"B={p.batch}: {p.payload_mb_per_layer:.2f} MB/layer x {p.layers} layers; "
            f"GPU {p.gpu_layer_ms:.3f} ms/layer; in process {p.inproc_step_ms:.1f} ms/step; "
            f"{p.exchange_workers} exchange workers, "
            f"{p.shards} shards -> {p.predicted_step_ms:.1f} ms/step, {p.predicted_tokens_per_s:.0f} tok/s; "
            f"limit: {p.limiting_factor}"
        )


def _plan_pace(
    gpu: str | None,
    pace_file: str | None,
    geometry: str,
    cores: int,
    dtype_bytes: int,
    shard_gbps: float,
    batches: list[int],
    contexts: list[int],
    shard_counts: list[int],
    as_json: bool,
    tensor_parallel: int = 1,
) -> None:
    from fastdecode.dense.emulated import load_profile
    from fastdecode.planning.pace_plan import UnitCosts, plan_pace
    from fastdecode.runtime.geometry import GEOMETRIES

    if gpu is None or pace_file is None:
        raise click.UsageError("pace mode needs both --gpu and --pace (a `bench pace --json` result)")
    try:
        lines = Path(pace_file).read_text().strip().splitlines()
        try:
            bench = json.loads(lines[-1]) if lines else None
        except json.JSONDecodeError as e:
            raise click.ClickException(f"{pace_file}: last line is not JSON ({e})") from None
        costs = UnitCosts.from_pace(bench, source=pace_file)
        points = plan_pace(
            load_profile(gpu),
            GEOMETRIES[geometry],
            costs,
            batches,
            contexts,
            shard_counts,
            shard_gbps,
            cores,
            dtype_bytes,
            tensor_parallel,
        )
    except ServiceError as e:
        raise click.ClickException(str(e)) from e
    wins = [p for p in points if p.speedup > 1 and p.dense_host_cores_needed <= cores]
    best = max(wins, key=lambda p: (p.speedup, -p.dense_host_cores_needed), default=None)
    if as_json:
        click.echo(
            json.dumps(
                {
                    "costs": costs.__dict__,
                    "points": [p.to_dict() for p in points],
                    "best": best.to_dict() if best else None,
                }
            )
        )
        return
    click.echo(
        f"unit costs ({costs.source}): {costs.ms_per_mb:.3f} ms/MB and {costs.us_per_round_trip:.1f} us per "
        f"round trip of dense-host CPU; scheduler {costs.scheduler_us_per_seq:.2f} us per sequence per step"
    )
    for p in points:
        mark = "  <- split wins" if p in wins else ""
        click.echo(
            f"S={p.context} B={p.batch} P={p.shards}: split {p.split_step_ms:.1f} ms/step "
            f"{p.split_tokens_per_s:.0f} tok/s (limit {p.limit}), {p.dense_host_cores_needed:.1f} dense-host "
            f"cores; GPU alone B={p.gpu_alone_batch} {p.gpu_alone_tokens_per_s:.0f} tok/s; "
            f"{p.speedup:.2f}x{mark}"
        )
    if best is None:
        click.echo(f"no point where the split beats {gpu} alone within {cores} dense-host cores")
    else:
        click.echo(
            f"best: S={best.context} B={best.batch} P={best.shards}: {best.speedup:.2f}x {gpu} alone, "
            f"{best.dense_host_cores_needed:.1f} dense-host cores"
        )
