"""`fastdecode bench scheduler-step` and `bench pace`: the host work around a GPU's step, the
scheduler's alone and the whole fleet's on an emulated GPU (registered on the `bench` group of
fastdecode.cli.bench)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from fastdecode.cli.bench import bench, emit, json_option, run_bench
from fastdecode.cli.bench_speculation import speculative_options
from fastdecode.protocol import MAX_DECODE_STEPS


@bench.command("scheduler-step")
@json_option
@click.option("--batch", "-B", type=int, default=256, show_default=True, help="Running sequences.")
@click.option("--shards", "-P", type=int, default=4, show_default=True)
@click.option("--steps", "-n", type=int, default=200, show_default=True, help="Timed decode steps.")
@click.option("--prompt-len", type=int, default=32, show_default=True)
@click.option("--prefix-sharing/--no-prefix-sharing", default=True, show_default=True)
@click.option(
    "--decode-steps",
    type=click.IntRange(1, MAX_DECODE_STEPS),
    default=1,
    show_default=True,
    help="Decode steps a plan runs each sequence for (the scheduler's --decode-steps); figures are per "
    "decode step.",
)
def scheduler_step_cmd(as_json: bool, **kw: Any) -> None:
    """The scheduler's own CPU per decode step (real driver, core and wire code; in-process peers
    that answer at once, no transport): medians of plan, exchange, apply and the event streams
    (the gateway's Session against a Submit stream per request, same run)."""
    from fastdecode.benchmarks.scheduler_step import run_scheduler_step_bench

    result = run_bench(lambda: run_scheduler_step_bench(**kw))
    emit(result, as_json, "scheduler-step: the scheduler process's CPU per decode step")


@bench.command("pace")
@json_option
@click.option(
    "--gpu", default="h100", show_default=True, help="Emulated GPU: h100, h200, a10, l4 or a profile file."
)
@click.option(
    "--geometry",
    default="llama-3-8b",
    show_default=True,
    help="Model shape (llama-3-8b, llama-3-70b, smollm2, small), or checkpoint: the --model's own "
    "(the tiny default's steps are tens of ms: the scheduler and gateway read at a fast pace).",
)
@click.option(
    "--tensor-parallel",
    type=click.IntRange(1, 64),
    default=1,
    show_default=True,
    help="GPUs the S-part is split over: each holds 1/N of the weights, the ranks' collectives at the "
    "profile's link bandwidth (docs/scaling.md).",
)
@click.option("--batch", "-B", "batches", type=int, multiple=True, default=(256,), show_default=True)
@click.option("--shards", "-P", type=click.IntRange(1, 64), default=4, show_default=True)
@click.option(
    "--workers",
    "-K",
    type=click.IntRange(0, 64),
    multiple=True,
    default=(1,),
    show_default=True,
    help="Exchange worker processes (0: the Attend streams in gpu_dense's process); repeat for points.",
)
@click.option("--prompt-len", type=int, default=8, show_default=True)
@click.option(
    "--gen-len",
    type=int,
    default=48,
    show_default=True,
    help="Context = prompt + gen (short: shards keep pace).",
)
@click.option(
    "--model",
    type=click.Path(file_okay=False),
    default=None,
    help="Tokenizer and config (default: tiny llama).",
)
@click.option("--echo-repeats", type=int, default=200, show_default=True)
@click.option(
    "--idle-seconds",
    "idle_s",
    type=click.FloatRange(0.2, 60),
    default=5.0,
    show_default=True,
    help="Each of the two warm, idle windows (before the load, after it) that measure each part's "
    "background CPU per second; the lower reading is taken.",
)
@click.option(
    "--event-loop",
    "loops",
    type=click.Choice(["uvloop", "asyncio"]),
    multiple=True,
    default=("uvloop",),
    show_default=True,
    help="The services' event loop (FASTDECODE_EVENT_LOOP); repeat for an A/B in one run.",
)
@click.option(
    "--plan-ahead",
    "plan_ahead",
    type=click.Choice(["on", "off"]),
    multiple=True,
    default=("on",),
    show_default=True,
    help="The scheduler plans step n+1 while step n runs; repeat for an A/B in one run.",
)
@click.option(
    "--exchange-worker",
    "worker_kinds",
    type=click.Choice(["auto", "native", "python"]),
    multiple=True,
    default=("auto",),
    show_default=True,
    help="gpu_dense's exchange workers: native (C++), python, auto (native when built); repeat for an A/B.",
)
@click.option(
    "--stream-interval",
    "stream_intervals",
    type=click.IntRange(1, 64),
    multiple=True,
    default=(1,),
    show_default=True,
    help="The gateway's tokens per stream message after the first; repeat for an A/B in one run.",
)
@click.option(
    "--decode-steps",
    "decode_steps",
    type=click.IntRange(1, MAX_DECODE_STEPS),
    multiple=True,
    default=(1,),
    show_default=True,
    help="The scheduler's decode steps per plan (figures stay per decode step); repeat for an A/B.",
)
@speculative_options
@click.option(
    "--plot", type=click.Path(dir_okay=False, path_type=Path), default=None, help="Stacked-bar PNG."
)
def pace_cmd(as_json: bool, model: str | None, plot: Path | None, **kw: Any) -> None:
    """A real fleet on an emulated GPU: the host CPU each decode step costs, per part.

    The last line (--json) is one object with `points`; each point has the GPU step (the profile's
    roofline), the wall step, the CPU per step of the scheduler, gpu_dense's main process, the
    exchange workers, the shards outside attention and the gateway, the dense host's CPU per MB
    and per round trip next to a bare grpc.aio echo of the same bytes, and the cores it needs.
    """
    from fastdecode.benchmarks.pace import plot_pace, run_pace

    if plot is not None and not plot.resolve().parent.is_dir():
        raise click.BadParameter(f"directory {plot.resolve().parent} does not exist", param_hint="--plot")
    # (each option's name is run_pace's: batches, workers, loops, plan_ahead, worker_kinds,
    # stream_intervals, decode_steps)
    result = run_bench(lambda: run_pace(model=Path(model) if model else None, **kw))
    if plot is not None:
        click.echo(f"plot written to {plot_pace(result, plot)}", err=True)
    if as_json:
        click.echo(json.dumps(result))
        return
    from fastdecode.benchmarks.common import format_table

    rows = [
        {
            **{k: v for k, v in p.items() if not isinstance(v, dict | list)},
            **p["cpu_ms_per_step"],
            **{f"{k}_at_gpu_pace": v for k, v in p["cpu_ms_per_step_at_gpu_pace"].items()},
        }
        for p in result["points"]
    ]
    if result.get("acceptance") == "emulated":
        click.echo("ACCEPTANCE EMULATED: the drafts kept are drawn at the --acceptance rates")
    click.echo(format_table(rows))
