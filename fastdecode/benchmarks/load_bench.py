"""`fastdecode bench load`: many concurrent streaming clients against a fleet, bounded in time.

Every request must end in exactly one way: its tokens or a clear error status; a request that
does neither within the time bound counts as hung. Reports throughput, latency percentiles and
the peak RSS of every fleet process (VmHWM from /proc).
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from fastdecode.benchmarks.fleet_bench import percentile, prompts_for
from fastdecode.benchmarks.transport import ensure_model


def peak_rss_bytes(pid: int) -> int | None:
    """The process's resident-set high-water mark (Linux), None when it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


async def _load(
    target: str,
    clients: int,
    requests_per_client: int,
    prompts: list[list[int]],
    gen_len: int,
    bound_s: float,
) -> dict[str, Any]:
    from fastdecode.client import AsyncClient, FastDecodeError

    outcomes: Counter[str] = Counter()
    latencies: list[float] = []
    ttft: list[float] = []
    itl: list[float] = []
    tokens = 0

    async with AsyncClient(target) as client:

        async def one(i: int) -> None:
            nonlocal tokens
            for r in range(requests_per_client):
                t0 = last = time.perf_counter()
                got = 0
                try:
                    async for chunk in client.stream(
                        token_ids=prompts[(i + r) % len(prompts)],
                        max_tokens=gen_len,
                        ignore_eos=True,
                        timeout=bound_s,
                    ):
                        now = time.perf_counter()
                        if chunk.token_ids:
                            (ttft if got == 0 else itl).append(now - last)
                            got += len(chunk.token_ids)
                            last = now
                    outcomes["ok" if got == gen_len else "short"] += 1
                    latencies.append(time.perf_counter() - t0)
                    tokens += got
                except FastDecodeError as e:
                    outcomes[e.code.name] += 1

        t0 = time.perf_counter()
        try:
            await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(clients))), bound_s + 30)
        except TimeoutError:
            pass
        wall = time.perf_counter() - t0
    total = clients * requests_per_client
    hung = total - sum(outcomes.values())
    return {
        "requests": total,
        "completed": outcomes.get("ok", 0),
        "errors": {k: v for k, v in outcomes.items() if k != "ok"},
        "lost_or_hung": hung,
        "tokens_per_s": tokens / wall,
        "wall_s": wall,
        "latency_p50_s": percentile(latencies, 50),
        "latency_p99_s": percentile(latencies, 99),
        "ttft_p99_s": percentile(ttft, 99),
        "itl_p99_ms": percentile(itl, 99) * 1e3,
    }


def run_load_bench(
    model: Path | None = None,
    clients: int = 128,
    requests_per_client: int = 1,
    prompt_len: int = 32,
    gen_len: int = 32,
    shards: int = 2,
    device: str = "cpu",
    bound_s: float = 300.0,
) -> dict[str, Any]:
    from fastdecode.fleet import launch_up
    from fastdecode.model import ModelConfig

    path = model or ensure_model("llama", "small")
    cfg = ModelConfig.from_pretrained(path)
    prompts = prompts_for(min(clients, 64), prompt_len, cfg.vocab_size, seed=1)
    kv_capacity = int((prompt_len + gen_len + 16) * cfg.kv_bytes_per_token(4) * clients / shards * 1.25) + (
        64 << 20
    )
    workdir = Path(tempfile.mkdtemp(prefix="fastdecode-bench-load-"))
    up = launch_up(
        path, workdir, "--admission", "naive", shards=shards, device=device, kv_capacity=kv_capacity
    )
    try:
        result = asyncio.run(_load(up.target, clients, requests_per_client, prompts, gen_len, bound_s))
        rss = {name: peak_rss_bytes(pid) for name, pid in _pids(up.state)}
    finally:
        up.stop()
    result.update(
        {
            "clients": clients,
            "shards": shards,
            "prompt_len": prompt_len,
            "gen_len": gen_len,
            "model": str(path),
        }
    )
    for name, value in rss.items():
        result[f"peak_rss_mib_{name}"] = round(value / 2**20, 1) if value else None
    return result


def _pids(state: dict[str, Any]) -> list[tuple[str, int]]:
    out = [(n, state[n]["pid"]) for n in ("gateway", "scheduler", "gpu_dense")]
    return out + [(f"kv_attention_{i}", k["pid"]) for i, k in enumerate(state["kv_attention"])]
