"""`fastdecode bench ...`: micro-benchmarks of the fleet's parts (the root group adds `bench`).

Adding a benchmark is one function: a `@bench.command()` that computes a flat dict and hands
it to `emit`, which prints a `key  value` table by default or one JSON object with --json.
Heavy imports (torch, grpc) stay inside the commands so `fastdecode --help` stays fast.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from fastdecode.cli.bench_speculation import speculative_options, split_device
from fastdecode.cli.errors import BenchGroup
from fastdecode.runtime.errors import ServiceError

KV_DTYPES = click.Choice(["float32", "float16", "bfloat16"])
ATTN_KV_DTYPES = click.Choice(["float32", "float16", "bfloat16", "int8", "float8_e4m3"])


def emit(result: dict[str, Any], as_json: bool, title: str | None = None) -> None:
    """Print a benchmark result: one JSON object with --json, else an aligned key/value table."""
    if as_json:
        click.echo(json.dumps(result))
        return
    from fastdecode.benchmarks.common import format_pairs

    if title:
        click.echo(title)
    click.echo(format_pairs(result))


def json_option(f: Callable[..., Any]) -> Callable[..., Any]:
    return click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")(f)


def run_bench(fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Run a benchmark, turning domain errors into a clean CLI error."""
    try:
        return fn()
    except ServiceError as e:
        raise click.ClickException(str(e)) from None


@click.group("bench", cls=BenchGroup)
def bench() -> None:
    """Micro-benchmarks: medians over repeats, ratios against baselines measured in the same run."""


@bench.command("transport")
@json_option
@click.option("--batch", "-B", type=int, default=32, show_default=True)
@click.option("--context", "-L", type=int, default=512, show_default=True, help="Tokens already cached.")
@click.option("--steps", "-n", type=int, default=10, show_default=True, help="Timed decode steps.")
@click.option("--warmup", type=int, default=2, show_default=True)
@click.option(
    "--model",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Checkpoint dir (default: the small llama preset, made once under .models/).",
)
@click.option("--pipeline/--no-pipeline", default=True, show_default=True, help="Two mini-batches.")
@click.option("--dense-threads", type=int, default=1, show_default=True, help="gpu_dense torch threads.")
@click.option("--shard-threads", type=int, default=1, show_default=True, help="kv_attention torch threads.")
@click.option("--local-threads", type=int, default=None, help="LocalEngine torch threads (default: torch's).")
@click.option("--kv-dtype", type=KV_DTYPES, default="float32", show_default=True)
@click.option(
    "--service-env",
    multiple=True,
    metavar="KEY=VALUE",
    help="Environment of both services (default GOMP_SPINCOUNT=1000: short OpenMP spin-waits).",
)
@click.option(
    "--breakdown",
    is_flag=True,
    help="Also time each part of one Attend round trip, and the dense side's CPU at 1, 2, 4, 8 shards "
    "(in order and with the concurrent fan-out).",
)
@click.option("--rt-repeats", type=int, default=200, show_default=True, help="Round trips per measurement.")
def transport_cmd(as_json: bool, service_env: tuple[str, ...], **kw: Any) -> None:
    """Fleet decode step (gpu_dense + 1 shard, gRPC on loopback) vs LocalEngine (target overhead <= 0.15);
    one Attend round trip (attend_rt_ms) vs a bare gRPC echo of the same bytes (echo_rt_ms)."""
    from fastdecode.benchmarks.transport import run_transport_bench

    env = None
    if service_env:
        bad = [e for e in service_env if "=" not in e]
        if bad:
            raise click.BadParameter(f"expected KEY=VALUE, got {bad}", param_hint="--service-env")
        env = dict(e.split("=", 1) for e in service_env)
    result = run_bench(lambda: run_transport_bench(service_env=env, **kw))
    emit(result, as_json, "decode step: fleet (gpu_dense + 1 kv_attention, gRPC) vs LocalEngine, medians")


@bench.command("fleet")
@json_option
@click.option("--model", type=click.Path(file_okay=False), default=None, help="Default: the small preset.")
@click.option("--shards", "-P", type=int, default=2, show_default=True)
@click.option("--batch", "-B", type=int, default=32, show_default=True)
@click.option("--prompt-len", type=int, default=128, show_default=True)
@click.option("--gen-len", type=int, default=256, show_default=True)
@click.option("--device", default="cpu", show_default=True)
@click.option("--pipeline", type=click.Choice(["auto", "on", "off"]), default="auto", show_default=True)
@click.option("--skip-hf", is_flag=True, help="Leave out the transformers baseline.")
@click.option("--kv-dtype", type=KV_DTYPES, default="float32", show_default=True, help="Fleet and local KV.")
@click.option(
    "--plot",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Also draw throughput and latency per system into this PNG.",
)
def fleet_cmd(as_json: bool, model: str | None, plot: Path | None, **kw: Any) -> None:
    """One workload against transformers generate, LocalEngine and the fleet (`fastdecode up`).

    Prints tokens/s, time to first token and inter-token latency p10/p50/p90/p99 for each, the
    ratios fleet/transformers and fleet/local, and the planner's predicted step time against the
    measured. --plot FILE.png draws tokens/s and latency per system.
    """
    from fastdecode.benchmarks.fleet_bench import run_fleet_bench

    if plot is not None and not plot.resolve().parent.is_dir():  # fail now, not after the bench
        raise click.BadParameter(f"directory {plot.resolve().parent} does not exist", param_hint="--plot")
    result = run_bench(lambda: run_fleet_bench(Path(model) if model else None, **kw))
    emit(result, as_json, "fleet vs transformers vs LocalEngine (medians; ITL in ms)")
    if plot is not None:
        from fastdecode.benchmarks.plot import plot_fleet_bench

        click.echo(f"plot written to {plot_fleet_bench(result, plot)}", err=True)  # stdout stays JSON


@bench.command("structured")
@json_option
@click.option("--model", type=click.Path(file_okay=False), default=None, help="Default: SmolLM2 (imported).")
@click.option("--batch", "-B", type=int, default=32, show_default=True)
@click.option("--steps", "-n", type=int, default=24, show_default=True, help="Timed decode steps per set.")
@click.option("--device", default="cpu", show_default=True)
def structured_cmd(as_json: bool, model: str | None, **kw: Any) -> None:
    """Per-step cost of the JSON-schema token mask (llguidance) at batch B, against the plain step."""
    from fastdecode.benchmarks.structured import run
    from fastdecode.tools.gguf_import import default_model_dir

    path = Path(model) if model else default_model_dir()
    emit(run_bench(lambda: run(path, **kw)), as_json, "structured outputs: mask cost per decode step")


@bench.command("load")
@json_option
@click.option("--model", type=click.Path(file_okay=False), default=None, help="Default: the small preset.")
@click.option("--clients", type=int, default=128, show_default=True, help="Concurrent streaming clients.")
@click.option("--requests-per-client", type=int, default=1, show_default=True)
@click.option("--prompt-len", type=int, default=32, show_default=True)
@click.option("--gen-len", type=int, default=32, show_default=True)
@click.option("--shards", type=int, default=2, show_default=True)
@click.option("--device", default="cpu", show_default=True)
@click.option("--bound-s", type=float, default=300.0, show_default=True, help="Per-request time bound.")
@click.option(
    "--chat",
    is_flag=True,
    help="Chat-style: max_tokens = the rest of the context, EOS honoured; reports peak running, KV in use "
    "vs capacity and preemptions (--gen-len is ignored).",
)
@click.option("--context", type=int, default=None, help="Chat: cut the model's context to this many tokens.")
@click.option(
    "--kv-contexts",
    type=float,
    default=2.0,
    show_default=True,
    help="Chat: KV per shard, in full contexts (what full-context reservations would run per shard).",
)
@click.option(
    "--shared-prefix",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="Every request starts with the same N tokens, then its own --prompt-len question; runs the "
    "load with prefix sharing on and off in one go and compares KV peak, TTFT and tokens.",
)
def load_cmd(as_json: bool, model: str | None, **kw: Any) -> None:
    """Many concurrent streaming clients on the fleet: lost/hung requests, throughput, p99, peak RSS."""
    from fastdecode.benchmarks.load_bench import run_load_bench

    result = run_bench(lambda: run_load_bench(Path(model) if model else None, **kw))
    emit(result, as_json, "load: concurrent streaming clients on one fleet")
    if result["lost_or_hung"]:
        raise SystemExit(1)


@bench.command("chaos")
@json_option
@click.option("--model", type=click.Path(file_okay=False), default=None, help="Default: the tiny preset.")
@click.option("--clients", type=int, default=6, show_default=True, help="Concurrent greedy streams.")
@click.option("--requests-per-client", type=int, default=3, show_default=True)
@click.option("--prompt-len", type=int, default=16, show_default=True)
@click.option("--gen-len", type=int, default=48, show_default=True)
@click.option("--shards", type=int, default=2, show_default=True)
@click.option("--kills", type=int, default=3, show_default=True, help="Services killed, one at a time.")
@click.option(
    "--interval-s", type=float, default=4.0, show_default=True, help="Between one comeback and the next kill."
)
@click.option("--seed", type=int, default=0, show_default=True, help="Picks the kill order and the prompts.")
@click.option("--bound-s", type=float, default=300.0, show_default=True, help="Per-request deadline.")
@click.option(
    "--probes/--no-probes",
    default=True,
    show_default=True,
    help="Also hostile internal calls, the grammar crash, a pool rebuild, a huge geometry, a "
    "slow-building grammar, specs up to the size limit, heavy grammars looped on, huge bad_words "
    "under load, an emptied keys file, and gpu_dense or every shard staying down.",
)
@click.option(
    "--down-timeout-s",
    type=float,
    default=3.0,
    show_default=True,
    help="The stays-down probes' scheduler --dense-down-timeout and --shards-down-timeout.",
)
def chaos_cmd(as_json: bool, model: str | None, **kw: Any) -> None:
    """kill -9 shards, gpu_dense and the scheduler under load (`up` restarts them): requests sent,
    completed, failed, tokens equal to a fault-free run, and the longest pause a client saw; per
    probe (repeated kills, hostile internal calls, a service that stays down, the grammar crash, a
    shard pool rebuild, every shard down): requests, completed, failed with a clear status, hung,
    lost, services crashed (the last three), and the longest time to an answer."""
    from fastdecode.benchmarks.chaos import run_chaos_bench

    result = run_bench(lambda: run_chaos_bench(Path(model) if model else None, **kw))
    emit(result, as_json, "chaos: kill -9 under load")
    if not as_json:
        for k in result["kills"]:
            back = "not back" if k["back_after_s"] is None else f"back after {k['back_after_s']:.2f}s"
            click.echo(f"killed {k['service']} at {k['at_s']:.2f}s, {back}")
        for p in result["probes"]:
            click.echo(
                f"probe {p['name']}: {p['requests']} requests, {p['completed']} completed, "
                f"{p['failed_clear']} failed clearly, {p['hung']} hung, {p['lost']} lost, "
                + (f"{p['crashed']} crashed, " if "crashed" in p else "")
                + f"longest answer {p['max_answer_s']:.2f}s"
            )
    if result["failed"] or result["tokens_equal_fault_free"] != result["requests_sent"]:
        raise SystemExit(1)
    if any(p["hung"] or p["lost"] or p.get("crashed") for p in result["probes"]):
        raise SystemExit(1)


def _contexts(text: str) -> list[int]:
    out = _int_list(text, "--contexts")
    if min(out) < 1:
        raise click.BadParameter("contexts must be positive integers", param_hint="--contexts")
    return out


@bench.command("split")
@json_option
@click.option("--model", type=click.Path(), default=None, help="Checkpoint dir or .gguf (default: SmolLM2).")
@click.option(
    "--contexts", default="512,1024,2048,4096,8192", show_default=True, help="Tokens cached per sequence."
)
@click.option("--batch", "-B", type=int, default=32, show_default=True)
@click.option("--kv-dtype", type=KV_DTYPES, default="bfloat16", show_default=True)
@click.option("--dense-cpus", default=None, help="The dense host's CPUs, e.g. 0-3 (default: the first CPU).")
@click.option(
    "--shard-cpus",
    default=None,
    help="Shard hosts' CPUs, hosts separated by ',' and ranges within one joined by '+', e.g. 4-7,8-11 "
    "(default: the CPUs the dense host leaves, one shard host).",
)
@click.option("--link-rate", default=None, help="tbf rate on each veth (e.g. 10gbit), with namespaces.")
@click.option("--pipeline", type=click.Choice(["auto", "on", "off"]), default="auto", show_default=True)
@click.option(
    "--isolation",
    type=click.Choice(["auto", "netns", "loopback"]),
    default="auto",
    show_default=True,
    help="auto: network namespaces + veth where permitted, else pinned loopback.",
)
@click.option(
    "--nice",
    type=int,
    default=0,
    show_default=True,
    help="Scheduling priority of every emulated host's processes (LocalEngine's too); on a shared "
    "machine -10 keeps other work from taking their CPUs (root).",
)
@click.option("--steps", "-n", type=int, default=8, show_default=True, help="Timed decode steps per context.")
@click.option("--warmup", type=int, default=3, show_default=True)
@click.option(
    "--device",
    default="cpu",
    show_default=True,
    callback=split_device,
    help="Where the dense half (gpu_dense and LocalEngine) runs: cpu or cuda; shards stay on their CPUs. "
    "emulated:NAME (h100, ...): gpu_dense on an emulated GPU, no LocalEngine; needs --speculative and "
    "compares the fleet with drafts against it without. --speculative on cpu or cuda: the same "
    "comparison with the real model verifying (its own acceptance).",
)
@speculative_options
@click.option(
    "--host-share",
    default="auto",
    show_default=True,
    help="Share of the batch whose attention the dense host does itself, in a shard gpu_dense hosts "
    "(--host-shard): auto (the planner balances both hosts from parts measured at each context), "
    "0 (off: the shard hosts attend everything), or a fraction below 1.",
)
@click.option(
    "--plot",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Also draw tokens/s of both systems against context (crossover marked) into this PNG.",
)
def split_cmd(as_json: bool, model: str | None, contexts: str, plot: Path | None, **kw: Any) -> None:
    """Does the split pay? LocalEngine on a dense host's CPUs against the fleet with its attention on
    shard hosts' CPUs (emulated on this machine), at each context: tokens/s, ratio, the measured parts
    S and R, the exchange's CPU, the ideal ratio (S + R) / max(S, R), the efficiency, and the planner's
    predicted step against the measured one. --json: one JSON object on the last line."""
    from fastdecode.benchmarks.common import format_table
    from fastdecode.benchmarks.split import POINT_KEYS, run_split_bench
    from fastdecode.cli.gguf import resolve_model

    ctx = _contexts(contexts)
    kw["host_share"] = _host_share(kw["host_share"])
    if plot is not None and not plot.resolve().parent.is_dir():
        raise click.BadParameter(f"directory {plot.resolve().parent} does not exist", param_hint="--plot")
    if plot is not None and (kw["device"].startswith("emulated:") or kw["speculative"] != "off"):
        raise click.BadParameter("no plot for the speculative comparison (use --json)", param_hint="--plot")
    result = run_bench(lambda: run_split_bench(resolve_model(model), ctx, **kw))
    if plot is not None:
        from fastdecode.benchmarks.plot import plot_split_bench

        click.echo(f"plot written to {plot_split_bench(result, plot)}", err=True)
    if as_json:
        click.echo(json.dumps(result))
        return
    click.echo(f"ISOLATION: {result['isolation']}: {result['isolation_detail']}")
    click.echo(f"dense CPUs {result['dense_cpus']}, shard CPUs {' | '.join(result['shard_cpus'])}")
    if "speculative" in result:
        from fastdecode.benchmarks.split_spec import POINT_KEYS as SPEC_KEYS

        if result["acceptance"] == "emulated":
            rates = ", ".join(f"{r:g}" for r in result["acceptance_rates"])
            how = f"ACCEPTANCE EMULATED at per-position rates {rates}"
        else:
            how = "ACCEPTANCE REAL: the model verified the drafts (greedy) on these synthetic sequences"
        click.echo(
            f"{result['speculative']}, k={result['num_speculative_tokens']} on {result['device']}: {how}"
        )
        click.echo(format_table(result["points"], list(SPEC_KEYS)))
        for p in result["points"]:
            click.echo(
                f"context {p['context']}: auto's k per timed step {p['auto_k_steps']}, last {p['auto_k']} "
                f"({p['auto_decisions']} decisions, the first after {result['auto_first_decision']} steps)"
            )
        return
    click.echo(format_table(result["points"], [*POINT_KEYS, "pipelined", "host_sequences"]))
    cross = result["crossover_context"]
    click.echo(f"crossover context: {cross if cross is not None else 'none (the fleet never won)'}")
    before, after = result["load_avg_1m_before"], result["load_avg_1m_after"]
    click.echo(f"load average (1 min) before/after: {before:.2f}/{after:.2f}")


def _host_share(value: str) -> float | None:
    if value.strip().lower() == "auto":
        return None
    try:
        share = float(value)
    except ValueError:
        share = -1.0
    if not 0 <= share < 1:
        raise click.BadParameter("auto, or a fraction in [0, 1)", param_hint="--host-share")
    return share


def _int_list(value: str, name: str) -> list[int]:
    try:
        out = [int(x) for x in value.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter(
            f"expected comma-separated integers, got {value!r}", param_hint=name
        ) from None
    if not out:
        raise click.BadParameter("expected at least one integer", param_hint=name)
    return out


@bench.command("exchange")
@json_option
@click.option(
    "--geometry",
    type=click.Choice(["llama-3-8b", "llama-3-70b", "smollm2", "small"]),
    default=None,
    help="A named layer shape (default llama-3-8b unless explicit dims are given).",
)
@click.option("--hidden", type=int, default=None, help="Explicit dims: hidden size.")
@click.option("--heads", type=int, default=None, help="Explicit dims: query heads.")
@click.option("--kv-heads", type=int, default=None, help="Explicit dims: KV heads (default: heads).")
@click.option("--head-dim", type=int, default=None, help="Explicit dims: head dim (default hidden/heads).")
@click.option("--dtype", type=click.Choice(["bfloat16", "float32"]), default="bfloat16", show_default=True)
@click.option("--batch", "-B", default="256", show_default=True, help="Batch sizes, comma-separated.")
@click.option("--shards", "-P", default="2", show_default=True, help="Shard counts, comma-separated.")
@click.option(
    "--workers", "-K", default="0,1", show_default=True, help="Exchange worker counts (0 = in process)."
)
@click.option(
    "--context", "-L", type=int, default=128, show_default=True, help="KV tokens held per sequence."
)
@click.option("--repeats", "-n", type=int, default=50, show_default=True, help="Timed round trips per row.")
@click.option("--shard-threads", type=int, default=1, show_default=True)
@click.option("--device", default="cpu", show_default=True, help="Where q, k, v live (cuda on a GPU host).")
@click.option(
    "--exchange-worker",
    "worker_kinds",
    default="auto",
    show_default=True,
    help="Which exchange worker for the K>0 rows: native, python, auto (native when built); "
    "comma-separated for an A/B in one run.",
)
def exchange_cmd(
    as_json: bool, geometry: str | None, batch: str, shards: str, workers: str, worker_kinds: str, **kw: Any
) -> None:
    """One layer's Attend exchange at a model's shapes through gpu_dense's own shard plane, against a
    raw TCP echo and a bare gRPC echo of the same bytes (same run). Last line with --json: one object."""
    from fastdecode.benchmarks.common import format_table
    from fastdecode.benchmarks.exchange import COLUMNS, run_exchange_bench
    from fastdecode.runtime.geometry import geometry as resolve

    dims = {k: kw.pop(k) for k in ("hidden", "heads", "kv_heads", "head_dim")}
    explicit = any(v is not None for v in dims.values())
    result = run_bench(
        lambda: run_exchange_bench(
            resolve(geometry or (None if explicit else "llama-3-8b"), **dims),
            batches=_int_list(batch, "--batch"),
            shard_counts=_int_list(shards, "--shards"),
            worker_counts=_int_list(workers, "--workers"),
            worker_kinds=tuple(filter(None, (x.strip() for x in worker_kinds.split(",")))),
            **kw,
        )
    )
    if as_json:
        click.echo(json.dumps(result))
        return
    click.echo(
        f"exchange, {result['geometry']} {result['dtype']}, context {result['context']}: "
        "medians; GB/s of payload over the transport time (rt - shard attention)"
    )
    click.echo(format_table(result["rows"], COLUMNS))


@bench.command("gpu")
@click.option(
    "--out", type=click.Path(dir_okay=False, path_type=Path), default=None, help="Also write the JSON here."
)
@click.option(
    "--plot", type=click.Path(dir_okay=False, path_type=Path), default=None, help="T(B) and exchange PNG."
)
def gpu_cmd(out: Path | None, plot: Path | None) -> None:
    """A GPU host's checks (CUDA vs CPU greedy tokens, bf16 T(B), bench exchange and bench split on
    CUDA), under 8 minutes; without CUDA one line saying so, exit 0 (`make gpu-check`)."""
    from fastdecode.benchmarks.gpu_check import main

    try:
        code = main(out, plot)
    except ServiceError as e:
        raise click.ClickException(str(e)) from None
    raise SystemExit(code)


@bench.command("migrate")
@json_option
@click.option("--model", type=click.Path(file_okay=False), default=None, help="Default: the tiny preset.")
@click.option("--streams", type=int, default=12, show_default=True, help="Greedy streams in the drain run.")
@click.option("--prompt-len", type=int, default=64, show_default=True)
@click.option("--gen-len", type=int, default=256, show_default=True)
@click.option("--skew-clients", type=int, default=12, show_default=True)
@click.option("--skew-requests", type=int, default=36, show_default=True)
@click.option("--rebalance-factor", type=float, default=1.1, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
def migrate_cmd(as_json: bool, model: str | None, **kw: Any) -> None:
    """3 shards: drain one mid-decode (tokens vs a run without the drain, sequences migrated and
    re-prefilled, drain time, copy MB/s), then a skewed load with and without rebalancing."""
    from fastdecode.benchmarks.migrate import run_migrate_bench

    result = run_bench(lambda: run_migrate_bench(Path(model) if model else None, **kw))
    emit(result, as_json, "migrate: drain mid-decode, skewed load with and without rebalancing")
    if result["completed"] != result["requests"] or result["equal_to_reference"] != result["requests"]:
        raise SystemExit(1)
