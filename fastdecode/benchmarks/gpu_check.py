"""`fastdecode bench gpu` / `make gpu-check`: a GPU host's checks in one run, under 8 minutes.

Without CUDA it prints one line and exits 0 (CI runs that path). With CUDA:
1. gpu_dense's model on CUDA against the CPU (DenseModel, fp32, TF32 off): greedy tokens of the
   default model equal, prompt for prompt;
2. T(B) in bf16 on the GPU (planner._dense_times, one layer's S-part per batch size);
3. `bench exchange --device cuda` (Llama-3-8B geometry, bf16, q, k, v on the GPU) with exchange
   workers off and on, shards on the host's cores (1, 2, 4, 8);
4. `bench split --device cuda`: the dense half (gpu_dense, LocalEngine) on the GPU and the dense
   host's first CPUs, shards on the rest of the host's cores as 1, 2, 4 and 8 shard hosts (counts
   the cores cannot hold are skipped), short contexts and few steps to stay in the budget.
One JSON (stdout's last line, and --out) and one plot (--plot: T(B), the exchange's GB/s, and the
split's ratio against shard hosts).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from fastdecode.benchmarks.hosts import cpu_list
from fastdecode.runtime.errors import InvalidInput

NO_GPU = "gpu-check: no GPU found (torch.cuda.is_available() is False): nothing to check, exiting 0"
PROMPTS = ([1, 504, 3458, 314], [1, 9690, 30, 11, 1148], [1, 2, 3, 4, 5, 6, 7, 8])
BF16_BATCHES = (1, 8, 32, 64, 128, 256, 512, 1024)
SPLIT_SHARD_HOSTS = (1, 2, 4, 8)
# Short: two contexts either side of a GPU dense host's crossover, few steps (each context also
# starts a fresh gpu_dense, whose CUDA start-up dominates at these sizes).
SPLIT_ARGS = ["--contexts", "1024,4096", "--steps", "4", "--warmup", "2"]
_SPLIT_MIN_S = 45.0  # a split run is not started with less of the budget left


def cuda_vs_cpu_tokens(model_dir: Path, max_tokens: int = 24) -> dict[str, Any]:
    from fastdecode.dense.engine import LocalEngine

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
    from fastdecode.model.dense import DenseModel
    from fastdecode.planning.planner import _dense_times

    m = DenseModel.from_pretrained(model_dir, device="cuda", dtype=torch.bfloat16)
    return {str(b): s * 1e3 for b, s in _dense_times(m, batches, "cuda").items()}


def geometry_model(geometry: str, device: str, dtype: torch.dtype, layers: int = 2) -> Any:
    """A DenseModel of a named geometry's layer shapes with random weights (`layers` layers, a small
    vocabulary: the layers are what T(B) times)."""
    from dataclasses import replace

    from fastdecode.model.config import ModelConfig, RopeConfig
    from fastdecode.model.dense import DenseModel
    from fastdecode.runtime.geometry import GEOMETRIES

    g = GEOMETRIES[geometry]
    c = ModelConfig(
        "llama",
        g.hidden,
        g.intermediate,
        layers,
        g.heads,
        g.kv_heads,
        g.head_dim,
        1e-5,
        RopeConfig(),
        8192,
        1024,
        True,
        False,
        False,
        False,
        1,
    )
    gen = torch.Generator().manual_seed(0)
    required, _ = DenseModel.tensor_names(c)
    shapes = {"embed_tokens": (c.vocab_size, c.hidden_size), "norm": (c.hidden_size,)}
    q, kv = g.heads * g.head_dim, g.kv_heads * g.head_dim
    per = {
        "q_proj": (q, g.hidden),
        "k_proj": (kv, g.hidden),
        "v_proj": (kv, g.hidden),
        "o_proj": (g.hidden, q),
        "gate_proj": (g.intermediate, g.hidden),
        "up_proj": (g.intermediate, g.hidden),
        "down_proj": (g.hidden, g.intermediate),
        "layernorm": (g.hidden,),
    }
    tensors = {}
    for name in required:
        key = next(k for k in (*per, *shapes) if f"{k}." in name or name.endswith(f"{k}.weight"))
        shape = per.get(key) or shapes[key]
        tensors[name] = (torch.randn(shape, generator=gen) * 0.02).to(device=device, dtype=dtype)
    return DenseModel(replace(c), tensors, torch.device(device), dtype)


def profile_vs_measured(
    geometry: str = "llama-3-8b", batches: tuple[int, ...] = (64, 128, 256, 512), device: str = "cuda"
) -> dict[str, Any]:
    """The emulated profile's T(B) for this GPU next to the measured one (one layer's S-part, bf16), so
    the profile's efficiency and kernel floor can be corrected (docs/emulated-gpu.md)."""
    from fastdecode.dense.emulated import PROFILES, Roofline
    from fastdecode.planning.planner import _dense_times
    from fastdecode.runtime.geometry import GEOMETRIES

    name = torch.cuda.get_device_name(0).lower() if device.startswith("cuda") else "h100"
    profile = next((p for k, p in PROFILES.items() if k in name.replace(" ", "")), PROFILES["h100"])
    m = geometry_model(geometry, device, torch.bfloat16)
    measured = _dense_times(m, batches, device)
    roof = Roofline(profile, GEOMETRIES[geometry], 2)
    rows = [
        {
            "batch": b,
            "profile_ms": roof.layer_seconds(b) * 1e3,
            "measured_ms": s * 1e3,
            "measured_over_profile": s / roof.layer_seconds(b),
        }
        for b, s in sorted(measured.items())
    ]
    return {"profile": profile.name, "geometry": geometry, "rows": rows}


def split_layouts(
    available: Sequence[int], counts: Sequence[int] = SPLIT_SHARD_HOSTS
) -> list[tuple[int, str, str]]:
    """(shard hosts, --dense-cpus, --shard-cpus) for each count the CPUs can hold. The dense host
    takes a quarter of the CPUs (1 to 4: the S-part's thread, exchange workers, the driver); the
    rest is dealt to the shard hosts in equal contiguous sets, at least one CPU each."""
    cpus = sorted(available)
    dense_n = max(1, min(4, len(cpus) // 4))
    dense, rest = tuple(cpus[:dense_n]), cpus[dense_n:]
    out = []
    for n in counts:
        each = len(rest) // n
        if n < 1 or each < 1:
            continue
        hosts = [tuple(rest[i * each : (i + 1) * each]) for i in range(n)]
        # '+' joins one host's ranges, ',' separates hosts (fastdecode.benchmarks.hosts)
        spec = ",".join(cpu_list(h).replace(",", "+") for h in hosts)
        out.append((n, cpu_list(dense).replace(",", "+"), spec))
    return out


def _split_run(model_dir: Path, dense: str, shards: str, timeout: float, device: str) -> dict[str, Any]:
    argv = ["bench", "split", "--device", device, "--json", "--model", str(model_dir), *SPLIT_ARGS]
    argv += ["--dense-cpus", dense, "--shard-cpus", shards]
    try:
        done = subprocess.run(
            [sys.executable, "-m", "fastdecode.cli", *argv], capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return {"failed": f"bench split ran past the {timeout:.0f} s left of the budget"}
    lines = done.stdout.strip().splitlines()
    tail = done.stderr.strip().splitlines()[-1:] or [f"exit {done.returncode}"]
    if done.returncode or not lines:
        return {"failed": tail[0]}
    try:
        return json.loads(lines[-1])
    except ValueError:
        return {"failed": f"no JSON on bench split's last line: {lines[-1][:200]!r}"}


def split_on_gpu(model_dir: Path, deadline: float, device: str = "cuda") -> dict[str, Any]:
    """`bench split --device cuda` at each shard-host count the CPUs hold, while the budget lasts."""
    layouts = split_layouts(os.sched_getaffinity(0))
    runs: list[dict[str, Any]] = []
    for n, dense, shards in layouts:
        row: dict[str, Any] = {"shard_hosts": n, "dense_cpus_arg": dense, "shard_cpus_arg": shards}
        left = deadline - time.monotonic()
        if left < _SPLIT_MIN_S:
            row["skipped"] = f"{left:.0f} s of the budget left"
        else:
            row.update(_split_run(model_dir, dense, shards, left, device))
        runs.append(row)
    fitted = {n for n, _, _ in layouts}
    return {
        "args": SPLIT_ARGS,
        "runs": runs,
        "not_fitted": [n for n in SPLIT_SHARD_HOSTS if n not in fitted],
    }


def run_gpu_check(model_dir: Path | None = None, budget_s: float = 450.0) -> dict[str, Any] | None:
    """The checks' results, or None when there is no GPU (the caller prints NO_GPU)."""
    if not torch.cuda.is_available():
        return None
    from fastdecode.benchmarks.exchange import run_exchange_bench
    from fastdecode.runtime.geometry import GEOMETRIES
    from fastdecode.tools.checkpoint import ensure_default_model

    t0 = time.monotonic()
    model_dir = model_dir or ensure_default_model()
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(0), "model": str(model_dir)}
    result["cuda_vs_cpu"] = cuda_vs_cpu_tokens(model_dir)
    result["t_of_b_ms_bf16"] = bf16_t_of_b(model_dir)
    result["emulated_profile"] = profile_vs_measured()
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
    result["split"] = split_on_gpu(model_dir, t0 + budget_s)
    result["seconds"] = time.monotonic() - t0
    result["ok"] = bool(result["cuda_vs_cpu"]["tokens_equal"])
    return result


def plot_gpu_check(result: dict[str, Any], path: Path) -> Path:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(15, 4))
    ax1, ax2, ax3 = fig.subplots(1, 3)
    t = result["t_of_b_ms_bf16"]
    ax1.plot([int(b) for b in t], list(t.values()), marker="o")
    ax1.set(xscale="log", xlabel="batch B", ylabel="ms per layer", title="T(B), bf16, " + result["device"])
    for k in sorted({r["workers"] for r in result["exchange"]["rows"]}):
        rows = [r for r in result["exchange"]["rows"] if r["workers"] == k and r["batch"] == 256]
        ax2.plot([r["shards"] for r in rows], [r["gbps"] for r in rows], marker="o", label=f"{k} workers")
    ax2.set(xlabel="shards", ylabel="payload GB/s", title="exchange, Llama-3-8B B=256 bf16")
    ax2.legend()
    done = [r for r in result["split"]["runs"] if "points" in r]
    for ctx in sorted({p["context"] for r in done for p in r["points"]}):
        pts = [(r["shard_hosts"], p["ratio"]) for r in done for p in r["points"] if p["context"] == ctx]
        ax3.plot([n for n, _ in pts], [x for _, x in pts], marker="o", label=f"context {ctx}")
    ax3.axhline(1.0, color="grey", linewidth=0.8)
    ax3.set(xlabel="shard hosts", ylabel="fleet / LocalEngine tokens/s", title="bench split, dense on GPU")
    if done:
        ax3.legend()
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
