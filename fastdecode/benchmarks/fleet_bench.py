"""`fastdecode bench fleet`: one fixed workload against transformers, LocalEngine and the fleet.

All three run in one process tree, one after the other, on the same checkpoint and prompts:
(a) HuggingFace transformers `generate` (batched, greedy, exactly gen_len new tokens),
(b) LocalEngine in-process, (c) the fleet started by `fastdecode up` with P shards, driven by
B concurrent SDK streams. For each: tokens/s, time to first token, inter-token latency
p10/p50/p90/p99 (`--plot` draws them; fastdecode.benchmarks.plot).
The planner's predicted step time (from T(B) and R measured here) is set against the measured one.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from fastdecode.benchmarks.common import bench_workdir, median, run_async
from fastdecode.benchmarks.transport import ensure_model, process_cpu_seconds
from fastdecode.runtime.metrics import metric_total, scrape

if TYPE_CHECKING:
    from fastdecode.planning.planner import Profile


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


def _summary(name: str, tokens: int, seconds: float, ttft: list[float], itl: list[float]) -> dict[str, float]:
    return {
        f"{name}_tokens_per_s": tokens / seconds,
        f"{name}_ttft_s": median(ttft),
        # p10/p90 with p50/p99: enough of the distribution for `--plot`'s error bars.
        **{f"{name}_itl_p{q}_ms": percentile(itl, q) * 1e3 for q in (10, 50, 90, 99)},
    }


def prompts_for(batch: int, prompt_len: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    # ids >= 3 skip <s>, </s>, <pad>; the first token is <s> as a tokenizer would put it
    return [[0] + torch.randint(3, vocab, (prompt_len - 1,), generator=g).tolist() for _ in range(batch)]


def run_hf(model: Path, prompts: list[list[int]], gen_len: int) -> dict[str, float]:
    try:
        from transformers import AutoModelForCausalLM
        from transformers.generation.streamers import BaseStreamer
    except ImportError as e:  # the runtime never needs transformers; this baseline does
        raise RuntimeError("bench fleet needs transformers (pip install '.[test]')") from e

    class Clock(BaseStreamer):
        def __init__(self) -> None:
            self.times: list[float] = []

        def put(self, value: torch.Tensor) -> None:
            self.times.append(time.perf_counter())

        def end(self) -> None:
            pass

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    ids = torch.tensor(prompts)
    clock = Clock()
    t0 = time.perf_counter()
    with torch.no_grad():
        hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=gen_len,
            min_new_tokens=gen_len,
            do_sample=False,
            streamer=clock,
        )
    total = time.perf_counter() - t0
    token_times = clock.times[1:]  # the first put is the prompt
    itl = [b - a for a, b in zip(token_times, token_times[1:], strict=False)]
    return _summary("hf", len(prompts) * gen_len, total, [token_times[0] - t0], itl)


def run_local(
    model: Path, prompts: list[list[int]], gen_len: int, device: str, kv_dtype: str = "float32"
) -> dict[str, float]:
    from fastdecode.dense.engine import LocalEngine

    engine = LocalEngine.from_pretrained(model, device=device, kv_dtype=getattr(torch, kv_dtype))
    times: list[float] = []
    t0 = time.perf_counter()
    tokens = 0
    for events in engine.generate_stream(prompts, gen_len, ignore_eos=True):
        times.append(time.perf_counter())
        tokens += len(events)
    total = time.perf_counter() - t0
    itl = [b - a for a, b in zip(times, times[1:], strict=False)]
    return _summary("local", tokens, total, [times[0] - t0], itl)


async def _drive(
    target: str, prompts: list[list[int]], gen_len: int, window: Callable[[int], bool] | None = None
) -> tuple[int, float, list[float], list[float]]:
    """`window(tokens)` is called when the streams have produced a quarter and three quarters of
    their tokens: the steady decode between those marks, without prefill or the last stragglers.
    A mark it refuses (False) is asked for again at the next message."""
    from fastdecode.client import AsyncClient

    marks = [len(prompts) * gen_len // 4, 3 * len(prompts) * gen_len // 4]

    ttft: list[float] = []
    itl: list[float] = []
    tokens = 0
    async with AsyncClient(target) as client:
        await client.generate(token_ids=prompts[0][:4], max_tokens=2)  # warm the path

        async def one(p: list[int]) -> None:
            nonlocal tokens
            t0 = last = time.perf_counter()
            first = True
            async for chunk in client.stream(token_ids=p, max_tokens=gen_len, ignore_eos=True):
                now = time.perf_counter()
                if chunk.token_ids:
                    (ttft if first else itl).append(now - (t0 if first else last))
                    first, last = False, now
                    tokens += len(chunk.token_ids)
                    while marks and tokens >= marks[0]:
                        if window is not None and not window(tokens):
                            break
                        marks.pop(0)

        t0 = time.perf_counter()
        await asyncio.gather(*(one(p) for p in prompts))
        return tokens, time.perf_counter() - t0, ttft, itl


def run_fleet(
    model: Path,
    prompts: list[list[int]],
    gen_len: int,
    shards: int,
    device: str,
    kv_capacity: int,
    pipeline: str = "auto",
    kv_dtype: str = "float32",
) -> dict[str, float]:
    from fastdecode.tools.fleet import launch_up

    with bench_workdir("fleet") as workdir:
        up = launch_up(
            model,
            workdir,
            "--admission",
            "naive",
            "--pipeline",
            pipeline,
            kv_dtype=kv_dtype,
            shards=shards,
            device=device,
            kv_capacity=kv_capacity,
        )
        pids = up.pids()
        dense_metrics = up.state["gpu_dense"].get("metrics")
        marks: list[tuple[int, float, list[float]]] = []
        dense_marks: list[tuple[float, float, float, float]] = []

        def window(tokens: int) -> bool:  # the bench process itself is the fleet's client
            wall, cpu = time.perf_counter(), [process_cpu_seconds(p) for p in pids] + [time.process_time()]
            if dense_metrics:
                m = scrape(dense_metrics)
                mark = (
                    time.perf_counter(),
                    metric_total(m, "fastdecode_dense_step_seconds_sum"),
                    metric_total(m, "fastdecode_dense_step_seconds_count"),
                    metric_total(m, "fastdecode_dense_s_part_seconds_sum"),
                )
                if dense_marks and mark[2] <= dense_marks[0][2]:
                    # a loaded host delivers a small run's window in one burst of messages: the
                    # window closes at a later message, once gpu_dense has counted a step in it
                    return False
                dense_marks.append(mark)
            marks.append((tokens, wall, cpu))
            return True

        try:
            tokens, total, ttft, itl = run_async(_drive(up.target, prompts, gen_len, window))
            steps = scrape(dense_metrics) if dense_metrics else {}
        finally:
            up.stop()
    out = _summary("fleet", tokens, total, ttft, itl)
    if steps:  # what `--pipeline auto` chose: its probes run both modes, then the faster
        for mode in ("piped", "plain"):
            out[f"fleet_{mode}_steps"] = metric_total(steps, "fastdecode_dense_steps_total", mode=mode)
    if len(marks) == 2:
        out.update(cpu_per_step(marks[0], marks[1], len(prompts), len(pids) - 3))
    if len(dense_marks) == 2:
        out.update(dense_step_gap(dense_marks[0], dense_marks[1]))
    return out


def dense_step_gap(
    start: tuple[float, float, float, float], end: tuple[float, float, float, float]
) -> dict[str, float]:
    """Between two marks of (wall seconds, gpu_dense's summed step seconds, its step count, its
    summed S-part seconds): the wall time per step, the part gpu_dense spent in its steps, of that
    the S-part (dense compute and sampling), and the rest of the wall time, when gpu_dense sat idle
    between steps waiting for the scheduler's next plan (the step round trip, the scheduler's work)."""
    steps = end[2] - start[2]
    if steps <= 0:
        return {}
    wall = (end[0] - start[0]) * 1e3 / steps
    dense = (end[1] - start[1]) * 1e3 / steps
    return {
        "fleet_window_step_ms": wall,
        "fleet_dense_step_ms": dense,
        "fleet_s_part_ms": (end[3] - start[3]) * 1e3 / steps,
        "fleet_between_steps_ms": wall - dense,
    }


def cpu_per_step(
    start: tuple[int, float, list[float]], end: tuple[int, float, list[float]], batch: int, shards: int
) -> dict[str, float]:
    """CPU ms each process spent per decode step (`batch` tokens) between two marks of
    (tokens so far, wall seconds, CPU seconds of gateway, scheduler, gpu_dense, each shard, client),
    and how many cores they kept busy together: on a host the services share, where the step goes."""
    steps = (end[0] - start[0]) / batch
    cpu = [(b - a) * 1e3 / steps for a, b in zip(start[2], end[2], strict=True)]
    names = ["gateway", "scheduler", "gpu_dense"]
    out = {f"fleet_cpu_ms_{n}": c for n, c in zip(names, cpu, strict=False)}
    out["fleet_cpu_ms_shards"] = sum(cpu[3 : 3 + shards])
    out["fleet_cpu_ms_client"] = cpu[-1]
    out["fleet_cpu_ms_per_step"] = sum(cpu)
    out["fleet_cores_busy"] = sum(b - a for a, b in zip(start[2], end[2], strict=True)) / (end[1] - start[1])
    return out


def planner_profile(model: str, batch: int, shards: int, device: str, context: int, kv_dtype: str) -> Profile:
    """T(B) around B; R at the threads each co-located shard gets (the fleet splits the cores between
    its shards), on one shard's share of the batch at the step's mean `context` in `kv_dtype`; and
    the layer round trip through gpu_dense's own links to `shards` real shard processes. On a CPU
    host each round trip follows one layer's S-part of compute on the cores the shards share, as in
    a step (the shards' threads have gone idle and wake on busy cores)."""
    from fastdecode.benchmarks.breakdown import layer_transport_s
    from fastdecode.model import ModelConfig
    from fastdecode.planning.planner import measure_profile
    from fastdecode.tools.fleet import CO_LOCATED_ENV, shard_threads

    threads = shard_threads(shards)
    profile = measure_profile(
        model,
        sorted({max(1, batch // 2), batch, batch * 2}),
        device,
        context=context,
        attn_batch=max(1, batch // shards),
        attn_threads=threads,
        kv_dtype=kv_dtype,
    )
    busy = profile.t_at(batch) if device.startswith("cpu") else 0.0
    cfg = ModelConfig.from_pretrained(model)
    profile.rtt_s = layer_transport_s(cfg, batch, shards, threads, env=CO_LOCATED_ENV, busy_s=busy)
    return profile


def planner_profile_as_services(
    model: Path, batch: int, shards: int, device: str, context: int, kv_dtype: str
) -> Profile:
    """planner_profile in a child process started with the environment `fastdecode up` gives its
    services (CO_LOCATED_ENV, where the user has not set those variables): libgomp reads
    GOMP_SPINCOUNT once when it loads. With the short spin gpu_dense's S-part measured 12% and more
    slower than with the default one, and a long-spinning thread left over from the S-part stand-in
    would take a core from the shards during the round trip (0.4-1.1 ms more per layer, 0.2-0.5
    with the services' spin)."""
    from fastdecode.planning.planner import Profile
    from fastdecode.tools.fleet import co_located_env

    args = [str(model), batch, shards, device, context, kv_dtype]
    code = (
        "import json, sys\n"
        "from fastdecode.benchmarks.fleet_bench import planner_profile\n"
        "print(json.dumps(planner_profile(*json.loads(sys.argv[1])).to_dict()))"
    )
    env = {**os.environ, **co_located_env()}
    res = subprocess.run(
        [sys.executable, "-c", code, json.dumps(args)], env=env, capture_output=True, text=True, timeout=900
    )
    if res.returncode != 0:
        raise RuntimeError(f"measuring the planner's profile failed: {res.stderr.strip()[-2000:]}")
    return Profile.from_dict(json.loads(res.stdout.strip().splitlines()[-1]))


def run_fleet_bench(
    model: Path | None = None,
    shards: int = 2,
    batch: int = 32,
    prompt_len: int = 128,
    gen_len: int = 256,
    device: str = "cpu",
    skip_hf: bool = False,
    pipeline: str = "auto",
    kv_dtype: str = "float32",
) -> dict[str, Any]:
    from fastdecode.model import ModelConfig
    from fastdecode.planning.planner import predicted_step_s
    from fastdecode.tools.fleet import shard_threads

    path = model or ensure_model("llama", "small")
    cfg = ModelConfig.from_pretrained(path)
    if prompt_len + gen_len > cfg.max_position_embeddings:
        raise ValueError(f"prompt_len + gen_len exceeds the model's context {cfg.max_position_embeddings}")
    prompts = prompts_for(batch, prompt_len, cfg.vocab_size)
    per_seq = (prompt_len + gen_len + 16) * cfg.kv_bytes_per_token(4)
    kv_capacity = int(per_seq * batch / shards * 1.25) + (64 << 20)
    out: dict[str, Any] = {
        "model": str(path),
        "batch": batch,
        "shards": shards,
        "prompt_len": prompt_len,
        "gen_len": gen_len,
        "device": device,
        "pipeline": pipeline,
        "kv_dtype": kv_dtype,
    }
    if not skip_hf:
        out.update(run_hf(path, prompts, gen_len))
    out.update(run_local(path, prompts, gen_len, device, kv_dtype))
    out.update(run_fleet(path, prompts, gen_len, shards, device, kv_capacity, pipeline, kv_dtype))
    # Planner: the mean context of a decode step is prompt + gen/2, which the planner's B * S / 2
    # load expresses with S = 2 * prompt + gen.
    threads = shard_threads(shards)
    profile = planner_profile_as_services(path, batch, shards, device, prompt_len + gen_len // 2, kv_dtype)
    # S and R overlap only on separate hardware: where gpu_dense computes on the cores the shards
    # attend on (a CPU-only host), a layer costs S + R whichever way the pipeline runs.
    overlap = not device.startswith("cpu") and pipeline != "off"
    seq = 2 * prompt_len + gen_len
    out["predicted_step_ms"] = predicted_step_s(profile, batch, shards, seq, overlap=overlap) * 1e3
    out["measured_step_ms"] = out["fleet_itl_p50_ms"]
    out["predicted_vs_measured"] = out["predicted_step_ms"] / out["measured_step_ms"]
    if not skip_hf:
        out["ratio_fleet_vs_hf"] = out["fleet_tokens_per_s"] / out["hf_tokens_per_s"]
    out["ratio_fleet_vs_local"] = out["fleet_tokens_per_s"] / out["local_tokens_per_s"]
    out["t_dense_layer_ms"] = profile.t_at(batch) * 1e3
    out["r_attn_ns_per_token_pair"] = profile.r_attn * 1e9
    out["rtt_ms_per_layer"] = profile.rtt_s * 1e3
    out["shard_threads"] = threads
    return out
