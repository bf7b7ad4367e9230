"""What several decode steps a plan (the scheduler's --decode-steps k) cost a request in latency, and
what they give in throughput, on a real fleet at a GPU's pace.

A real fleet (the tiny default model, gpu_dense on the emulated H100, 4 shards, 1 exchange worker)
keeps `--background` streams decoding without end. Probe requests then arrive one at a time, each
after the one before finished: per point (a k), the probes' time to first token and their time per
token after the first (medians and p90), and the tokens per second all streams received meanwhile.
The first point's k is the baseline: each other point has its ratios to it, from the same run. A
point may be `auto` (--decode-steps auto: up to 8 steps a plan while no request waits, 1 while one
does). Each background stream starts again after `--background-tokens`, so newcomers keep arriving
besides the probes (48 streams of 256: one every ~5 decode steps); the most the tiny model holds,
1016, leaves about one restart a stream a point.

    .venv/bin/python bench/decode_steps_latency.py [--background 48] [--probes 30]
        [--background-tokens 256] [--decode-steps 1 4 8 auto] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fastdecode.benchmarks.common import bench_workdir  # noqa: E402
from fastdecode.benchmarks.fleet_bench import prompts_for  # noqa: E402
from fastdecode.benchmarks.pace import kv_capacity_per_shard  # noqa: E402
from fastdecode.benchmarks.transport import ensure_model  # noqa: E402
from fastdecode.client import AsyncClient  # noqa: E402
from fastdecode.model.config import ModelConfig  # noqa: E402
from fastdecode.runtime.settings import parse_decode_steps  # noqa: E402
from fastdecode.tools.fleet import Fleet  # noqa: E402

PROBE_TOKENS = 32
BACKGROUND_TOKENS = 256  # each background stream starts again when it ends (--background-tokens)


def _p90(xs: list[float]) -> float:
    return sorted(xs)[min(len(xs) - 1, int(0.9 * len(xs)))]


async def _measure(address: str, background: int, probes: int, vocab: int, tokens: int) -> dict[str, Any]:
    received = 0
    stop = asyncio.Event()
    async with AsyncClient(address) as client:
        await client.generate(token_ids=[1, 2, 3], max_tokens=2)  # warm the path

        async def keep_decoding(p: list[int]) -> None:
            nonlocal received
            while not stop.is_set():
                async for chunk in client.stream(token_ids=p, max_tokens=tokens, ignore_eos=True):
                    received += len(chunk.token_ids)
                    if stop.is_set():
                        break

        tasks = [asyncio.create_task(keep_decoding(p)) for p in prompts_for(background, 8, vocab)]
        await asyncio.sleep(3.0)  # every background stream admitted and decoding
        ttft: list[float] = []
        per_token: list[float] = []
        got0, t0 = received, time.perf_counter()
        for p in prompts_for(probes, 8, vocab):
            start = time.perf_counter()
            first = last = 0.0
            async for chunk in client.stream(token_ids=p, max_tokens=PROBE_TOKENS, ignore_eos=True):
                last = time.perf_counter() - start
                if not first and chunk.token_ids:
                    first = last
            ttft.append(first)
            per_token.append((last - first) / (PROBE_TOKENS - 1))
        tokens_per_s = (received - got0) / (time.perf_counter() - t0)
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
    return {
        "ttft_ms_p50": statistics.median(ttft) * 1e3,
        "ttft_ms_p90": _p90(ttft) * 1e3,
        "ms_per_token_after_first_p50": statistics.median(per_token) * 1e3,
        "ms_per_token_after_first_p90": _p90(per_token) * 1e3,
        "background_tokens_per_s": tokens_per_s,
    }


def run_point(background: int, probes: int, k: int | str, tokens: int = BACKGROUND_TOKENS) -> dict[str, Any]:
    model = ensure_model("llama", "tiny")
    config = ModelConfig.from_pretrained(model)
    shards = 4
    capacity = kv_capacity_per_shard(config, background + 1, shards, 8 + tokens)
    with bench_workdir("decode-steps") as workdir:
        fleet = Fleet(
            model=model,
            shards=shards,
            device="emulated:h100",
            kv_capacity=capacity,
            kv_dtype="bfloat16",
            pipeline=True,
            dense_args=["--dtype", "bfloat16", "--exchange-workers", "1"],
            scheduler_args=["--max-running", str(background + 1), "--decode-steps", str(k)],
            workdir=workdir,
        )
        fleet.start()
        try:
            assert fleet.gateway is not None
            point = asyncio.run(
                _measure(fleet.gateway.address, background, probes, config.vocab_size, tokens)
            )
        finally:
            fleet.stop()
    return {
        "decode_steps": k,
        "background": background,
        "background_tokens": tokens,
        "probes": probes,
        **point,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--background", type=int, default=48)
    ap.add_argument("--probes", type=int, default=30)
    ap.add_argument("--background-tokens", type=int, default=BACKGROUND_TOKENS)
    ap.add_argument("--decode-steps", nargs="+", default=["1", "4", "8"], help="points: K or auto")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if a.background < 1 or a.probes < 1:
        print("error: --background and --probes must be >= 1", file=sys.stderr)
        return 2
    try:
        ks = [parse_decode_steps(k) for k in a.decode_steps]
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    most = ModelConfig.from_pretrained(ensure_model("llama", "tiny")).max_position_embeddings - 8
    if not 1 <= a.background_tokens <= most:  # (8-token prompts)
        print(f"error: --background-tokens must be in [1, {most}]", file=sys.stderr)
        return 2
    points = [run_point(a.background, a.probes, k, a.background_tokens) for k in ks]
    base = points[0]
    for p in points:  # against the first point, measured in the same run
        for key in ("ttft_ms_p50", "ms_per_token_after_first_p50", "background_tokens_per_s"):
            p[f"{key}_ratio"] = p[key] / base[key] if base[key] else float("nan")
    if a.json:
        print(json.dumps({"points": points}))
    else:
        for p in points:
            print(json.dumps(p))
    return 0


if __name__ == "__main__":
    sys.exit(main())
