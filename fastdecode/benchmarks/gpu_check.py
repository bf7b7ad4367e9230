"""`fastdecode bench gpu` / `make gpu-check`: a GPU host's checks in one run, under 8 minutes.

Without CUDA it prints one line and exits 0 (CI runs that path). With CUDA:
1. gpu_dense's model on CUDA against the CPU (DenseModel, fp32, TF32 off): greedy tokens of the
   default model equal, prompt for prompt;
2. T(B) in bf16 on the GPU (planner._dense_times, one layer's S-part per batch size);
3. `bench exchange --device cuda` (Llama-3-8B geometry, bf16, q, k, v on the GPU) with exchange
   workers off and on, shards on the host's cores (1, 2, 4, 8);
4. `bench split --device cuda`, when this tree has it (issue 27: `SPLIT_HOOK` runs it; until then the
   JSON says it was skipped).
One JSON (stdout's last line, and --out) and one plot (--plot: T(B) and the exchange's GB/s).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from fastdecode.errors import InvalidInput

NO_GPU = "gpu-check: no GPU found (torch.cuda.is_available() is False): nothing to check, exiting 0"
PROMPTS = ([1, 504, 3458, 314], [1, 9690, 30, 11, 1148], [1, 2, 3, 4, 5, 6, 7, 8])
BF16_BATCHES = (1, 8, 32, 64, 128, 256, 512, 1024)
# issue 27 adds `bench split`; this is how gpu-check runs it (argv after `fastdecode`).
SPLIT_HOOK = ["bench", "split", "--device", "cuda", "--json"]


def cuda_vs_cpu_tokens(model_dir: Path, max_tokens: int = 24) -> dict[str, Any]:
    from fastdecode.engine import LocalEngine

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    out: dict[str, list[list[int]]] = {}
    for device in ("cpu", "cuda"):
        engine = LocalEngine.from_pretrained(model_dir, device=device, dtype=torch.float32)
        gens = engine.generate([list(p) for p in PROMPTS], max_tokens=max_tokens, ignore_eos=True)
        out[device] = [g.token_ids for g in gens]
        del engine
    equal = [a == b for a, b in zip(out["cpu"], out["cuda"], strict=True)]
    return {"tokens_equal": all(equal), "prompts_equal": sum(equal), "prompts": len(equal), **out}


def bf16_t_of_b(model_dir: Path, batches: tuple[int, ...] = BF16_BATCHES) -> dict[str, float]:
    from fastdecode.model import DenseModel
    from fastdecode.planner import _dense_times

    m = DenseModel.from_pretrained(model_dir, device="cuda", dtype=torch.bfloat16)
    return {str(b): s * 1e3 for b, s in _dense_times(m, batches, "cuda").items()}


def _split(deadline: float) -> dict[str, Any]:
    have = subprocess.run(
        [sys.executable, "-m", "fastdecode.cli", *SPLIT_HOOK[:2], "--help"], capture_output=True, timeout=120
    )
    if have.returncode:
        return {"skipped": "bench split is not in this tree yet (issue 27); SPLIT_HOOK runs it"}
    left = max(30.0, deadline - time.monotonic())
    try:
        done = subprocess.run(
            [sys.executable, "-m", "fastdecode.cli", *SPLIT_HOOK],
            capture_output=True,
            text=True,
            timeout=left,
        )
    except subprocess.TimeoutExpired:
        return {"failed": f"bench split ran past the {left:.0f} s left"}
    if done.returncode:
        return {"failed": done.stderr.strip().splitlines()[-1:] or [f"exit {done.returncode}"]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_gpu_check(model_dir: Path | None = None, budget_s: float = 450.0) -> dict[str, Any] | None:
    """The checks' results, or None when there is no GPU (the caller prints NO_GPU)."""
    if not torch.cuda.is_available():
        return None
    from fastdecode.benchmarks.exchange import run_exchange_bench
    from fastdecode.checkpoint import ensure_default_model
    from fastdecode.geometry import GEOMETRIES

    t0 = time.monotonic()
    model_dir = model_dir or ensure_default_model()
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(0), "model": str(model_dir)}
    result["cuda_vs_cpu"] = cuda_vs_cpu_tokens(model_dir)
    result["t_of_b_ms_bf16"] = bf16_t_of_b(model_dir)
    result["exchange"] = run_exchange_bench(
        GEOMETRIES["llama-3-8b"],
        "bfloat16",
        batches=(256, 1024),
        shard_counts=(1, 2, 4, 8),
        worker_counts=(0, 1, 2, 4),
        context=64,
        repeats=20,
        device="cuda",
    )
    result["split"] = _split(t0 + budget_s)
    result["seconds"] = time.monotonic() - t0
    result["ok"] = bool(result["cuda_vs_cpu"]["tokens_equal"])
    return result


def plot_gpu_check(result: dict[str, Any], path: Path) -> Path:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4))
    ax1, ax2 = fig.subplots(1, 2)
    t = result["t_of_b_ms_bf16"]
    ax1.plot([int(b) for b in t], list(t.values()), marker="o")
    ax1.set(xscale="log", xlabel="batch B", ylabel="ms per layer", title="T(B), bf16, " + result["device"])
    for k in sorted({r["workers"] for r in result["exchange"]["rows"]}):
        rows = [r for r in result["exchange"]["rows"] if r["workers"] == k and r["batch"] == 256]
        ax2.plot([r["shards"] for r in rows], [r["gbps"] for r in rows], marker="o", label=f"{k} workers")
    ax2.set(xlabel="shards", ylabel="payload GB/s", title="exchange, Llama-3-8B B=256 bf16")
    ax2.legend()
    fig.savefig(path, format="png", dpi=100)
    return path


def main(out: Path | None, plot: Path | None) -> int:
    if plot is not None and not plot.resolve().parent.is_dir():
        raise InvalidInput(f"directory {plot.resolve().parent} does not exist")
    result = run_gpu_check()
    if result is None:
        print(NO_GPU)
        return 0
    line = json.dumps(result)
    if out is not None:
        out.write_text(line + "\n")
    if plot is not None:
        plot_gpu_check(result, plot)
    print(line)
    return 0 if result["ok"] else 1
