"""The gateway short of CPU: does it fall further behind the steps, or catch up?

A real fleet (the tiny default model, gpu_dense on the emulated H100, 4 shards, 1 exchange worker)
serves B streams; the gateway's process is held to `--quota-cores` of one core by a cgroup (cpu
controller, v1 or v2: root only), so that it cannot write a message per token per step. Per point
(a stream interval, with and without the quota): how long the clients took to receive every token
next to how long gpu_dense spent in its steps (`delivery_over_decode`: 1.0 when the gateway keeps
pace), tokens per stream message, the gateway's CPU per token, and the first token's latency.

    sudo .venv/bin/python bench/gateway_behind.py [--batch 256] [--gen-len 300]
        [--quota-cores 0.15] [--stream-interval 1 4] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fastdecode.benchmarks.common import bench_workdir  # noqa: E402
from fastdecode.benchmarks.fleet_bench import prompts_for  # noqa: E402
from fastdecode.benchmarks.pace import kv_capacity_per_shard  # noqa: E402
from fastdecode.benchmarks.transport import ensure_model, process_cpu_seconds  # noqa: E402
from fastdecode.client import AsyncClient  # noqa: E402
from fastdecode.model.config import ModelConfig  # noqa: E402
from fastdecode.runtime.metrics import metric_total, scrape  # noqa: E402
from fastdecode.tools.fleet import Fleet  # noqa: E402

PERIOD_US = 100_000
CGROUP_V1 = Path("/sys/fs/cgroup/cpu")
CGROUP_V2 = Path("/sys/fs/cgroup")


class CpuQuota:
    """A cgroup holding a process's threads to a share of one core; removed on exit."""

    def __init__(self, name: str, cores: float) -> None:
        quota = max(1000, int(cores * PERIOD_US))
        if (CGROUP_V1 / "cpu.cfs_quota_us").exists():
            self.path = CGROUP_V1 / name
            self.path.mkdir(exist_ok=True)
            (self.path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            (self.path / "cpu.cfs_quota_us").write_text(str(quota))
        elif "cpu" in (CGROUP_V2 / "cgroup.controllers").read_text().split():
            self.path = CGROUP_V2 / name
            self.path.mkdir(exist_ok=True)
            (self.path / "cpu.max").write_text(f"{quota} {PERIOD_US}")
        else:
            raise OSError("no cgroup cpu controller here")

    def hold(self, pid: int) -> None:
        (self.path / "cgroup.procs").write_text(str(pid))  # every thread of it, and those it starts

    def remove(self) -> None:
        try:
            self.path.rmdir()  # empty once the process it held has exited
        except OSError:
            pass


def available() -> str | None:
    """None where a quota can be set here, else why not."""
    if os.geteuid() != 0:
        return "needs root (a cgroup)"
    try:
        CpuQuota("fastdecode-probe", 1.0).remove()
    except OSError as e:
        return f"no cgroup cpu controller: {e}"
    return None


async def _stream_all(address: str, prompts: list[list[int]], gen_len: int, fleet: Fleet) -> dict[str, Any]:
    async with AsyncClient(address) as client:
        await client.generate(token_ids=prompts[0][:4], max_tokens=2)  # warm the path
        dense0 = scrape(fleet.dense.metrics)
        gateway0 = process_cpu_seconds(fleet.gateway.pid)
        t0 = time.perf_counter()
        tokens = messages = 0
        firsts: list[float] = []

        async def timed(p: list[int]) -> None:
            nonlocal tokens, messages
            first = None
            async for chunk in client.stream(token_ids=p, max_tokens=gen_len, ignore_eos=True):
                if first is None and chunk.token_ids:
                    first = time.perf_counter() - t0
                    firsts.append(first)
                tokens += len(chunk.token_ids)
                messages += 1

        await asyncio.gather(*(timed(p) for p in prompts))
        wall = time.perf_counter() - t0
        dense1 = scrape(fleet.dense.metrics)
        gateway_cpu = process_cpu_seconds(fleet.gateway.pid) - gateway0
    in_steps = metric_total(dense1, "fastdecode_dense_step_seconds_sum") - metric_total(
        dense0, "fastdecode_dense_step_seconds_sum"
    )
    firsts.sort()
    return {
        "tokens": tokens,
        "messages": messages,
        "tokens_per_message": tokens / max(1, messages),
        "delivery_wall_s": wall,
        "dense_in_steps_s": in_steps,
        "delivery_over_decode": wall / in_steps if in_steps > 0 else float("nan"),
        "gateway_cpu_us_per_token": gateway_cpu * 1e6 / max(1, tokens),
        "ttft_p50_s": firsts[len(firsts) // 2],
        "ttft_max_s": firsts[-1],
    }


def run_point(batch: int, gen_len: int, interval: int, quota: float | None) -> dict[str, Any]:
    model = ensure_model("llama", "tiny")
    config = ModelConfig.from_pretrained(model)
    shards, prompt_len = 4, 8
    prompts = prompts_for(batch, prompt_len, config.vocab_size)
    with bench_workdir("gateway-behind") as workdir:
        fleet = Fleet(
            model=model,
            shards=shards,
            device="emulated:h100",
            kv_capacity=kv_capacity_per_shard(config, batch, shards, prompt_len + gen_len),
            kv_dtype="bfloat16",
            pipeline=True,
            dense_args=["--dtype", "bfloat16", "--exchange-workers", "1"],
            scheduler_args=["--max-running", str(batch)],
            gateway_args=["--stream-interval", str(interval)],
            workdir=workdir,
        )
        fleet.start()
        held = CpuQuota(f"fastdecode-gateway-{os.getpid()}", quota) if quota is not None else None
        try:
            assert fleet.gateway is not None
            if held is not None:
                held.hold(fleet.gateway.pid)
            point = asyncio.run(_stream_all(fleet.gateway.address, prompts, gen_len, fleet))
        finally:
            fleet.stop()
            if held is not None:
                held.remove()
    return {"batch": batch, "gen_len": gen_len, "stream_interval": interval, "gateway_cores": quota, **point}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--gen-len", type=int, default=300)
    ap.add_argument("--quota-cores", type=float, default=0.15)
    ap.add_argument("--stream-interval", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if not (0.01 <= a.quota_cores <= 64) or a.batch < 1 or a.gen_len < 1:
        print("error: --quota-cores must be in [0.01, 64], --batch and --gen-len >= 1", file=sys.stderr)
        return 2
    if not all(1 <= i <= 64 for i in a.stream_interval):
        print("error: --stream-interval must be in [1, 64]", file=sys.stderr)
        return 2
    why = available()
    if why is not None:
        print(f"error: {why}", file=sys.stderr)
        return 1
    points = [
        run_point(a.batch, a.gen_len, interval, quota)
        for interval in a.stream_interval
        for quota in (None, a.quota_cores)
    ]
    if a.json:
        print(json.dumps({"points": points}))
    else:
        for p in points:
            print(json.dumps(p))
    return 0


if __name__ == "__main__":
    sys.exit(main())
