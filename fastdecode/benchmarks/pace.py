"""`fastdecode bench pace`: the fleet at a GPU's pace, and the host CPU each decode step costs.

A real fleet (gateway, scheduler, gpu_dense with K exchange workers, P kv_attention shards, all
processes) whose gpu_dense runs on an emulated GPU (`--device emulated:NAME`,
fastdecode/dense/emulated.py): each layer's S-part lasts the profile's roofline and q, k, v are
synthetic, so everything around the arithmetic runs and is measured. B streams decode with a short
context (so that the shards, one core each, keep pace); between a quarter and three quarters of
their tokens (steady decode, no prefill) the bench reads every process's CPU and the services'
metrics. Per point:

- gpu_step_ms: the profile's roofline for this step (two mini-batches: each layer's weights read
  twice; plus the LM head); wall_step_ms: the measured wall time per step. `--tensor-parallel N`:
  the roofline of one of N GPUs each holding 1/N of the weights, plus the ranks' collectives at the
  profile's link bandwidth (fastdecode/dense/emulated.py `Roofline`).
- cpu_ms_per_step: scheduler, dense_main (gpu_dense's process, all its threads, less the host's
  stand-in for on-device sampling: `dense_stand_in_ms`), exchange_workers, shards_outside_attention
  (the shards' CPU less their attention time), gateway. dense_main_kernel_ms: the kernel's part of
  dense_main (its sends, reads and waits on the control sockets and the network).
- round_trips_per_step (Attend items gpu_dense sent, counted at step ends), payload_mb_per_step
  (q, k, v out and o back), dense_host_cpu_ms_per_mb and dense_cpu_us_per_round_trip (main process
  and exchange workers), next to a bare grpc.aio echo of one item's bytes in the same run (echo_*),
  measured twice: with the fleet idle, and again while the fleet decodes its last quarter
  (echo_loaded_*: its client on the same shared cores as the exchange workers), so the dense host's
  figure can be read against the yardstick under the same contention as well as idle.
- tokens_per_message: tokens per stream message the clients read (1 while the gateway keeps pace;
  a gateway that falls behind writes what waited for a request as one message).
- dense_host_cores_needed = dense host CPU per step / gpu_step_ms; exposed_host_ms = wall - GPU
  step - one shard's attention per step (the most the shards can keep on the critical path) - the
  stand-in's sampling time (which a GPU spends inside gpu_step_ms).
- background_cpu_ms_per_s: each part's CPU per second with the fleet warm and idle, read in the same
  run just before the load and again just after it, the lower of the two (health probes, readiness
  polls, timers, gRPC's poller). That CPU accrues
  per second, not per step: on this host a step lasts the shards' attention (hundreds of ms), so it
  lands in cpu_ms_per_step many times over what it costs at a GPU's pace.
  cpu_ms_per_step_at_gpu_pace moves it to the GPU's step: cpu_ms_per_step - background x (wall -
  gpu_step_ms), a projection, labelled as one. `--geometry checkpoint` runs the --model's own
  shape instead (the tiny default: 4 layers, tens of ms a step), where the background is a tenth of
  a ms a step and the scheduler's and the gateway's CPU per step at a fast pace is read, not projected.
- decode_tokens_per_s, tokens_per_step, round_trips_per_token; with `--speculative` each point runs
  twice, without drafts and with the scheduler's drafter, the emulated device keeping drafts at the
  `--acceptance` rates (ACCEPTANCE IS EMULATED, docs/speculative.md "At a GPU's pace"): tau,
  drafts_per_row, rows_with_drafts_per_step, and on the second point speedup and
  round_trips_per_token_ratio against the first.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

from fastdecode.benchmarks.common import bench_workdir, run_async
from fastdecode.benchmarks.transport import ensure_model, process_cpu_seconds, process_kernel_seconds
from fastdecode.dense.handoff import worker_kind
from fastdecode.runtime.metrics import metric_total, scrape
from fastdecode.runtime.rpc import sync_channel
from fastdecode.v1.scheduler_pb2 import SchedulerStatsRequest
from fastdecode.v1.scheduler_pb2_grpc import SchedulerStub

# --geometry's name for the --model checkpoint's own shape: at the tiny default's, one-core shards keep
# a step of tens of ms, where the scheduler's and the gateway's CPU per step are read directly
# instead of projected from a 500 ms step.
CHECKPOINT = "checkpoint"
PARTS = ("scheduler", "dense_main", "exchange_workers", "shards_outside_attention", "gateway")


def kv_capacity_per_shard(config: Any, batch: int, shards: int, context: int) -> int:
    """bf16 KV bytes a shard needs for its share of `batch` sequences of `context` tokens, with room
    to spare (placement is not exactly even)."""
    per_seq = (context + 32) * config.kv_bytes_per_token(2)
    return int(per_seq * batch / shards * 1.5) + (16 << 20)


def _children(pid: int) -> list[int]:
    """The processes `pid` started (gpu_dense's exchange workers)."""
    try:
        return [int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


class _Mark:
    """CPU seconds of every process and the counters the point needs, at one instant."""

    def __init__(self, fleet: Any) -> None:
        self.wall = time.perf_counter()
        self.client = (0, 0)  # (tokens, stream messages) the load's clients had received
        self.cpu = {
            "gateway": process_cpu_seconds(fleet.gateway.pid),
            "scheduler": process_cpu_seconds(fleet.scheduler.pid),
            "dense_main": process_cpu_seconds(fleet.dense.pid),
            "exchange_workers": sum(process_cpu_seconds(p) for p in _children(fleet.dense.pid)),
            "shards": sum(process_cpu_seconds(s.pid) for s in fleet.kv),
        }
        self.dense_kernel = process_kernel_seconds(fleet.dense.pid)
        d = scrape(fleet.dense.metrics)
        self.steps = metric_total(d, "fastdecode_dense_steps_total")
        self.head_cpu = metric_total(d, "fastdecode_dense_head_cpu_seconds_total")
        # counted with steps_total at each step's end: a mark taken mid-step counts neither
        self.items = metric_total(d, "fastdecode_dense_attend_items_total")
        self.in_step = metric_total(d, "fastdecode_dense_step_seconds_sum")  # each step's wall, summed
        self.device = metric_total(d, "fastdecode_dense_emulated_device_seconds", engine="compute")
        self.copy = metric_total(d, "fastdecode_dense_emulated_device_seconds", engine="copy")
        # speculative rows (--speculative): rows that carried drafts, the drafts, the tokens they
        # yielded. From GetStats, counted at every step: the scheduler's metrics are refreshed every
        # 0.1 s, longer than a small run's whole decode window
        with sync_channel(fleet.scheduler.address, fleet.peer_credentials) as ch:
            st = SchedulerStub(ch).GetStats(SchedulerStatsRequest(), timeout=10)
        self.spec_rows, self.spec_drafts, self.spec_emitted = st.spec_rows, st.spec_drafts, st.spec_emitted
        shards = [scrape(s.metrics) for s in fleet.kv]
        # CPU, not wall: on a busy host an item's wall time counts the other processes' turns too
        self.attention = sum(metric_total(m, "fastdecode_kv_attention_cpu_seconds_total") for m in shards)


class _LoadedEcho:
    """The bare echo run again while the fleet decodes (its client and server in processes of their
    own, sharing the cores with the fleet as the exchange workers do): the same yardstick under the
    same contention. `during_decode` says whether the fleet was still decoding when it ended."""

    def __init__(self, out_b: int, back_b: int, repeats: int) -> None:
        self.args = (out_b, back_b, repeats)
        self.cpu_s = float("nan")
        self.during_decode = False


async def _drive(
    target: str,
    prompts: list[list[int]],
    gen_len: int,
    fleet: Any,
    idle_s: float,
    echo: _LoadedEcho | None = None,
) -> tuple[list[_Mark], list[_Mark]]:
    """(the idle windows' marks, two before the load and two after it; the decode window's two
    marks). With `echo`, the echo runs once the decode window closes, while the last quarter of the
    tokens decodes."""
    from fastdecode.benchmarks.echo import grpc_echo_cpu_s_apart
    from fastdecode.client import AsyncClient

    marks: list[_Mark] = []
    total = len(prompts) * gen_len
    want = [total // 4, 3 * total // 4]
    tokens = messages = 0
    marking = False
    echo_task: asyncio.Task[None] | None = None

    async def run_echo(e: _LoadedEcho) -> None:
        _, e.cpu_s = await grpc_echo_cpu_s_apart(*e.args)
        e.during_decode = tokens < total

    async with AsyncClient(target) as client:
        await client.generate(token_ids=prompts[0][:4], max_tokens=2)  # warm the path
        idle = [await asyncio.to_thread(_Mark, fleet)]
        await asyncio.sleep(idle_s)
        idle.append(await asyncio.to_thread(_Mark, fleet))

        async def one(p: list[int]) -> None:
            nonlocal tokens, messages, echo_task, marking
            async for chunk in client.stream(token_ids=p, max_tokens=gen_len, ignore_eos=True):
                tokens += len(chunk.token_ids)
                messages += 1
                while want and tokens >= want[0] and not marking:
                    marking = True  # one stream at a time takes a mark (it awaits the scrape)
                    seen = (tokens, messages)  # the client's count when the mark is asked for: the
                    try:  # other streams go on while the scrape runs
                        mark = await asyncio.to_thread(_Mark, fleet)
                    finally:
                        marking = False
                    if marks and mark.steps <= marks[0].steps:
                        # a loaded host delivers a small run's window in one burst of messages: the
                        # window closes at a later message, once gpu_dense has counted a step in it
                        break
                    want.pop(0)
                    marks.append(mark)
                    mark.client = seen
                    if not want and echo is not None:
                        echo_task = asyncio.create_task(run_echo(echo))

        await asyncio.gather(*(one(p) for p in prompts))
        if echo_task is not None:
            await echo_task
        idle.append(await asyncio.to_thread(_Mark, fleet))  # the idle window again, after the load
        await asyncio.sleep(idle_s)
        idle.append(await asyncio.to_thread(_Mark, fleet))
    return idle, marks


def _parts(a: _Mark, b: _Mark, stand_in_s: float = 0.0) -> dict[str, float]:
    """CPU seconds each part spent between two marks (dense_main less the stand-in's sampling)."""
    return {
        "scheduler": b.cpu["scheduler"] - a.cpu["scheduler"],
        "dense_main": b.cpu["dense_main"] - a.cpu["dense_main"] - stand_in_s,
        "exchange_workers": b.cpu["exchange_workers"] - a.cpu["exchange_workers"],
        "shards_outside_attention": b.cpu["shards"] - a.cpu["shards"] - (b.attention - a.attention),
        "gateway": b.cpu["gateway"] - a.cpu["gateway"],
    }


def run_point(
    gpu: str,
    geometry: str,
    batch: int,
    shards: int,
    workers: int,
    prompt_len: int,
    gen_len: int,
    model: Path,
    echo_repeats: int = 200,
    loop: str = "uvloop",
    plan_ahead: str = "on",
    idle_s: float = 5.0,
    worker_kind_setting: str = "auto",
    stream_interval: int = 1,
    decode_steps: int = 1,
    speculative: str = "off",
    num_speculative_tokens: int = 3,
    acceptance: str | None = None,
    tensor_parallel: int = 1,
) -> dict[str, Any]:
    import torch

    from fastdecode.benchmarks.echo import grpc_echo_cpu_s
    from fastdecode.benchmarks.fleet_bench import prompts_for
    from fastdecode.dense.emulated import apply_geometry, load_emulated
    from fastdecode.model.config import ModelConfig
    from fastdecode.tools.fleet import Fleet

    device = f"emulated:{gpu}"
    shape = None if geometry == CHECKPOINT else geometry
    # errors before any process
    emulated = load_emulated(model, device, torch.bfloat16, shape, acceptance, tensor_parallel)
    # the k asked for on every step: the planner's own choice (auto) would measure another k
    spec_args = ["--speculative", speculative, "--num-speculative-tokens", str(num_speculative_tokens)]
    spec_args += ["--speculative-k", "fixed"]
    rates = ",".join(f"{r:g}" for r in emulated.acceptance.rates)
    # native or python: which one `auto` takes here (an unbuilt native one fails before any process)
    kind = worker_kind(worker_kind_setting) if workers else "none"
    c = apply_geometry(ModelConfig.from_pretrained(model), shape)
    roof = emulated.roofline.step_seconds(batch, pipelined=True)
    kv_capacity = kv_capacity_per_shard(c, batch, shards, prompt_len + gen_len)
    prompts = prompts_for(batch, prompt_len, ModelConfig.from_pretrained(model).vocab_size)
    with bench_workdir("pace") as workdir:  # the services' logs, kept if the run fails
        fleet = Fleet(
            model=model,
            shards=shards,
            device=device,
            kv_capacity=kv_capacity,
            kv_dtype="bfloat16",
            pipeline=True,
            dense_args=[
                *("--dtype", "bfloat16", *(("--geometry", shape) if shape else ())),
                *("--exchange-workers", str(workers), "--exchange-worker", kind if workers else "auto"),
                *("--emulated-acceptance", rates),
                *("--tensor-parallel", str(tensor_parallel)),
            ],
            scheduler_args=[
                *("--max-running", str(batch), "--plan-ahead", plan_ahead),
                *("--decode-steps", str(decode_steps)),
                *(spec_args if speculative != "off" else ()),
            ],
            gateway_args=["--stream-interval", str(stream_interval)],
            workdir=workdir,
            env={"FASTDECODE_EVENT_LOOP": loop},
        )
        # one item's bytes: a mini-batch's rows on one shard
        rows = max(1, batch // 2 // shards)
        out_b = rows * (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim * 2 + 64
        back_b = rows * c.num_attention_heads * c.head_dim * 2 + 32
        loaded = _LoadedEcho(out_b, back_b, echo_repeats)
        fleet.start()
        try:
            idle, marks = run_async(_drive(fleet.gateway.address, prompts, gen_len, fleet, idle_s, loaded))
            # the bare echo, in this process, while the fleet sits idle (the yardstick the issue names)
            _, echo_cpu = grpc_echo_cpu_s(out_b, back_b, echo_repeats)
        finally:
            fleet.stop()
        if len(marks) < 2:
            raise RuntimeError("the decode window was not reached")
        a, b = marks
        steps = b.steps - a.steps
        if steps <= 0:
            raise RuntimeError("no dense step in the decode window")

    def per_step(x: float, y: float) -> float:
        return (y - x) * 1e3 / steps

    stand_in = per_step(a.head_cpu, b.head_cpu)
    attention = per_step(a.attention, b.attention)
    cpu = {k: v * 1e3 / steps for k, v in _parts(a, b, b.head_cpu - a.head_cpu).items()}
    # each part's lower reading of the two idle windows: a neighbour's burst in one window once
    # doubled every part's reading (/proc's 10 ms ticks rule out many short windows instead)
    windows = (idle[:2], idle[2:])
    rates = [{k: v * 1e3 / (j.wall - i.wall) for k, v in _parts(i, j).items()} for i, j in windows]
    background = {k: min(r[k] for r in rates) for k in rates[0]}
    gpu_ms = roof["gpu_step_s"] * 1e3
    wall = (b.wall - a.wall) * 1e3 / steps
    # the background accrues over the wall step; at the GPU's pace it would accrue over gpu_ms
    at_pace = {k: cpu[k] - background[k] * max(0.0, wall - gpu_ms) / 1e3 for k in cpu}
    trips = (b.items - a.items) / steps
    payload_mb = c.num_hidden_layers * batch * (2 * c.num_attention_heads + 2 * c.num_key_value_heads)
    payload_mb = payload_mb * c.head_dim * 2 / 1e6
    dense_host = cpu["dense_main"] + cpu["exchange_workers"]
    load = os.getloadavg()[0]
    tokens = b.client[0] - a.client[0]
    rows = b.spec_rows - a.spec_rows
    spec = {  # decode tokens: with drafts a step yields more than one a row
        "speculative": speculative,
        "num_speculative_tokens": num_speculative_tokens if speculative != "off" else 0,
        "acceptance_rates": list(emulated.acceptance.rates) if speculative != "off" else [],
        "decode_tokens_per_s": tokens / (b.wall - a.wall),
        "tokens_per_step": tokens / steps,
        "round_trips_per_token": (b.items - a.items) / tokens if tokens else float("nan"),
        "tau": (b.spec_emitted - a.spec_emitted) / rows if rows else 1.0,
        "drafts_per_row": (b.spec_drafts - a.spec_drafts) / rows if rows else 0.0,
        "rows_with_drafts_per_step": rows / steps,
    }
    return {
        **spec,
        "gpu": gpu,
        "geometry": geometry,
        "tensor_parallel": tensor_parallel,
        "batch": batch,
        "shards": shards,
        "workers": workers,
        "exchange_worker": kind,
        "event_loop": loop,
        "plan_ahead": plan_ahead,
        "stream_interval": stream_interval,
        "decode_steps": decode_steps,
        "context": prompt_len + gen_len,
        "steps_measured": steps,
        "gpu_step_ms": gpu_ms,
        "emulated_device_ms": per_step(a.device, b.device),  # what the clock charged: = gpu_step_ms
        "pcie_copy_ms": per_step(a.copy, b.copy),
        "wall_step_ms": wall,
        "cpu_ms_per_step": cpu,
        "background_cpu_ms_per_s": background,
        "background_windows_cpu_ms_per_s": rates,  # before the load, after it
        "cpu_ms_per_step_at_gpu_pace": at_pace,
        "dense_stand_in_ms": stand_in,
        # of dense_main, the kernel's (its socket sends, reads and waits: on 2 shared cores, mostly
        # the context switches of a process that blocks 64 times a step)
        "dense_main_kernel_ms": per_step(a.dense_kernel, b.dense_kernel),
        "shard_attention_ms": attention,
        "round_trips_per_step": trips,
        # tokens per stream message the clients read: 1 while the gateway keeps pace; more where it
        # fell behind and wrote what waited as one message
        "tokens_per_message": (b.client[0] - a.client[0]) / max(1, b.client[1] - a.client[1]),
        "payload_mb_per_step": payload_mb,
        "dense_host_cpu_ms_per_mb": dense_host / payload_mb,
        "dense_cpu_us_per_round_trip": dense_host * 1e3 / trips if trips else float("nan"),
        "echo_cpu_us_per_round_trip": echo_cpu * 1e6,
        "echo_cpu_ms_per_mb": echo_cpu * 1e3 / ((out_b + back_b) / 1e6),
        "echo_loaded_cpu_us_per_round_trip": loaded.cpu_s * 1e6,
        "echo_loaded_cpu_ms_per_mb": loaded.cpu_s * 1e3 / ((out_b + back_b) / 1e6),
        "echo_loaded_during_decode": loaded.during_decode,
        "dense_host_cores_needed": dense_host / gpu_ms,
        "exposed_host_ms": wall - gpu_ms - attention / shards - stand_in,
        # the wall time gpu_dense had no step to run: what reaches the device between its steps
        # (the scheduler's turn, the step's messages); a step planned ahead is already there
        "dense_idle_ms": wall - per_step(a.in_step, b.in_step),
        "load_average": load,
    }


def run_pace(
    gpu: str = "h100",
    geometry: str = "llama-3-8b",
    batches: tuple[int, ...] = (256,),
    shards: int = 4,
    workers: tuple[int, ...] = (1,),
    prompt_len: int = 8,
    gen_len: int = 48,
    model: Path | None = None,
    echo_repeats: int = 200,
    loops: tuple[str, ...] = ("uvloop",),
    plan_ahead: tuple[str, ...] = ("on",),
    idle_s: float = 5.0,
    worker_kinds: tuple[str, ...] = ("auto",),
    stream_intervals: tuple[int, ...] = (1,),
    decode_steps: tuple[int, ...] = (1,),
    speculative: str = "off",
    num_speculative_tokens: int = 3,
    acceptance: str | None = None,
    tensor_parallel: int = 1,
) -> dict[str, Any]:
    """Each point; with `speculative`, each point twice, without drafts and with them (the emulated
    device keeps them at the `acceptance` rates), the second carrying `speedup` over the first."""
    from fastdecode.runtime.errors import InvalidInput

    if speculative != "off" and any(k != 1 for k in decode_steps):
        raise InvalidInput("--speculative needs --decode-steps 1: both give a row several tokens")
    path = model or ensure_model("llama", "tiny")  # its tokenizer and config; the geometry overrides
    modes = ("off", speculative) if speculative != "off" else ("off",)
    configs = [
        (b, k, loop, ahead, kind, interval, k_steps)
        for b in batches
        for k in workers
        for loop in loops
        for ahead in plan_ahead
        for kind in (worker_kinds if k else ("auto",))
        for interval in stream_intervals
        for k_steps in decode_steps
    ]
    points = []
    for b, k, loop, ahead, kind, interval, k_steps in configs:
        pair = [
            run_point(
                *(gpu, geometry, b, shards, k, prompt_len, gen_len, path, echo_repeats, loop, ahead, idle_s),
                *(kind, interval, k_steps, mode, num_speculative_tokens, acceptance, tensor_parallel),
            )
            for mode in modes
        ]
        if len(pair) == 2:  # the same fleet with drafts against it without, in this run
            off, spec = pair
            spec["speedup"] = spec["decode_tokens_per_s"] / off["decode_tokens_per_s"]
            spec["round_trips_per_token_ratio"] = spec["round_trips_per_token"] / off["round_trips_per_token"]
        points += pair
    result: dict[str, Any] = {
        "points": points,
        "cores": os.cpu_count(),
        "load_average_end": os.getloadavg()[0],
    }
    if speculative != "off":
        result["acceptance"] = "emulated"  # the drafts kept are drawn at the stated rates
    return result


def pace_figure(result: dict[str, Any]) -> Any:
    """One stacked bar per point: each part's CPU per step, beside the GPU step and the wall step."""
    from matplotlib.figure import Figure

    points = result["points"]
    fig = Figure(figsize=(max(6, 2.2 * len(points)), 4.5))
    ax = fig.add_subplot()
    colors = ["#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3"]
    x = list(range(len(points)))
    bottom = [0.0] * len(points)
    for part, color in zip(PARTS, colors, strict=True):
        vals = [max(0.0, p["cpu_ms_per_step"][part]) for p in points]
        ax.bar(x, vals, 0.5, bottom=bottom, label=part, color=color)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax.scatter(
        x, [p["gpu_step_ms"] for p in points], marker="_", s=900, color="black", label="GPU step (roofline)"
    )
    ax.scatter(x, [p["wall_step_ms"] for p in points], marker="x", color="black", label="wall step")
    ax.set_xticks(
        x,
        [
            f"{p['gpu']} {p['geometry']} TP={p.get('tensor_parallel', 1)}\n"
            f"B={p['batch']} P={p['shards']} K={p['workers']}\n"
            f"{p['event_loop']}, ahead {p['plan_ahead']}, k={p.get('decode_steps', 1)}"
            for p in points
        ],
    )
    ax.set_ylabel("ms per decode step (CPU per part, stacked)")
    ax.set_title("bench pace: host CPU per step at an emulated GPU's pace")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_pace(result: dict[str, Any], path: Path) -> Path:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    fig = pace_figure(result)
    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=110)
    return path
