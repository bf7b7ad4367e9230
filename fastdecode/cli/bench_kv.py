"""`fastdecode bench attention` and `bench kv-agreement`: the shard's kernel and its KV dtypes
(registered on the `bench` group of fastdecode.cli.bench)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from fastdecode.cli.bench import ATTN_KV_DTYPES, bench, emit, json_option, run_bench


@bench.command("attention")
@json_option
@click.option("--batch", "-B", type=int, default=32, show_default=True, help="Decoding sequences.")
@click.option(
    "--context", "-L", type=int, default=1024, show_default=True, help="Tokens per sequence (mean if mixed)."
)
@click.option(
    "--lengths",
    type=click.Choice(["uniform", "mixed"]),
    default="mixed",
    show_default=True,
    help="uniform: all = context; mixed: drawn from [context/16, 2*context - context/16].",
)
@click.option("--kv-dtype", type=ATTN_KV_DTYPES, default="float32", show_default=True)
@click.option("--backend", type=click.Choice(["native", "torch"]), default="native", show_default=True)
@click.option("--repeats", "-n", type=int, default=11, show_default=True)
@click.option("--layers", type=int, default=1, show_default=True, help="Layers attended per timed step.")
@click.option("--heads", type=int, default=12, show_default=True, help="Query heads (small preset: 12).")
@click.option("--kv-heads", type=int, default=12, show_default=True)
@click.option("--head-dim", type=int, default=64, show_default=True)
@click.option("--threads", type=int, default=None, help="torch intra-op threads (default: torch's).")
@click.option(
    "--isa",
    default=None,
    help="Native kernel ISA level for the run: scalar, avx2, avx512, avx512_vnni, avx512_bf16, amx "
    "(default: the highest the CPU has).",
)
@click.option(
    "--clock",
    type=click.Choice(["wall", "thread"]),
    default="wall",
    show_default=True,
    help="thread: the calling thread's CPU time (needs --threads 1), for hosts shared with other work.",
)
@click.option(
    "--baseline-isa",
    default=None,
    help="Also time this ISA level, interleaved with --isa's runs: vs_baseline is the same-run time ratio.",
)
@click.option(
    "--positions",
    type=int,
    default=1,
    show_default=True,
    help="New positions per sequence (speculative decoding's k+1, causal among them); above 1, one "
    "position is timed too, interleaved: vs_one_position is the same-run time ratio.",
)
@click.option(
    "--memory-mib",
    type=int,
    default=1024,
    show_default=True,
    help="Yardstick buffer size.",
)
@click.option(
    "--kv-dir",
    type=click.Path(file_okay=False),
    default=None,
    help="Also time the same sequences in a pool mapped from a file here (a --kv-dir shard's), "
    "interleaved: vs_anonymous is the same-run ratio (tmpfs with huge=within_size: huge pages).",
)
def attention_cmd(as_json: bool, memory_mib: int, **kw: Any) -> None:
    """One shard's decode attention (KVStore.attend) vs a streaming-read bandwidth yardstick.

    effective_gbps = bytes of K and V read per layer / median time per layer; ratio =
    effective_gbps / memory_gbps (target >= 0.8), both measured interleaved with the same threads.
    --positions N attends N new positions per sequence (a speculative verification step) beside
    one, interleaved: vs_one_position (target <= 1.3 at 4: one pass over the KV for all of them).
    """
    from fastdecode.benchmarks.attention import run_attention_bench

    result = run_bench(lambda: run_attention_bench(memory_bytes=memory_mib << 20, **kw))
    emit(result, as_json, "decode attention, one shard (KVStore.attend), medians")


@bench.command("kv-crash")
@json_option
@click.option("--kills", type=click.IntRange(1, 100000), default=200, show_default=True)
@click.option("--kv-dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default="float32")
@click.option("--seed", type=int, default=0, show_default=True)
def kv_crash_cmd(as_json: bool, **kw: Any) -> None:
    """kill -9 a process appending to a persistent KV pool at random moments, --kills times: each
    restart re-attaches the pool and every committed KV row must be the one written (wrong_rows 0)."""
    from fastdecode.benchmarks.kv_crash import run_kv_crash

    result = run_bench(lambda: run_kv_crash(**kw))
    emit(result, as_json, "kv-crash: kill -9 during appends, re-attach, check every committed row")
    if not result["ok"]:
        raise SystemExit(1)


@bench.command("shard-kill")
@json_option
@click.option("--model", type=click.Path(file_okay=False), default=None, help="Default: SmolLM2 (imported).")
@click.option("--sequences", type=click.IntRange(2, 256), default=16, show_default=True)
@click.option("--context", type=click.IntRange(16, 32768), default=2048, show_default=True, help="Prompt.")
@click.option("--tokens", type=click.IntRange(4, 4096), default=32, show_default=True, help="Per stream.")
@click.option("--kv-dtypes", default="float32,float8_e4m3", show_default=True, help="Comma-separated.")
@click.option(
    "--shared-prefix",
    type=click.IntRange(0, 32767),
    default=0,
    show_default=True,
    help="Tokens every prompt starts with (a system prompt: prefix caching computes it once).",
)
@click.option(
    "--kv-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Where the kv-dir fleets keep their pools (default /dev/shm).",
)
def shard_kill_cmd(as_json: bool, model: str | None, kv_dtypes: str, **kw: Any) -> None:
    """kill -9 of a shard mid-decode, restarted at once: today's recovery (re-prefill) against a pool
    that outlives the process (--kv-dir: resume in place), per KV dtype: tokens equal to a run
    without the kill, the stall, what was re-prefilled."""
    from fastdecode.benchmarks.shard_kill import run_shard_kill
    from fastdecode.tools.gguf_import import ensure_default_model

    path = Path(model) if model else ensure_default_model()
    dtypes = tuple(d.strip() for d in kv_dtypes.split(",") if d.strip())
    result = run_bench(lambda: run_shard_kill(path, kv_dtypes=dtypes, **kw))
    emit(result, as_json, "shard-kill: today's re-prefill against a re-attached pool")
    if any(v is False for k, v in result.items() if k.endswith("_same_tokens")):
        raise SystemExit(1)


@bench.command("kv-agreement")
@json_option
@click.option("--model", type=click.Path(file_okay=False), default=None, help="Default: SmolLM2 (imported).")
@click.option(
    "--kv-dtypes",
    default="bfloat16,int8,float8_e4m3",
    show_default=True,
    help="Comma-separated KV dtypes compared with float32 KV.",
)
@click.option("--prompts", type=int, default=8, show_default=True, help="Prompts of random token ids.")
@click.option("--prompt-len", type=int, default=32, show_default=True)
@click.option("--tokens", type=int, default=64, show_default=True, help="Greedy tokens per prompt.")
@click.option("--seed", type=int, default=0, show_default=True)
def kv_agreement_cmd(as_json: bool, model: str | None, kv_dtypes: str, **kw: Any) -> None:
    """Greedy tokens and logits with each KV dtype against float32 KV (LocalEngine, native kernel)."""
    from fastdecode.benchmarks.kv_agreement import run_kv_agreement
    from fastdecode.tools.gguf_import import ensure_default_model

    path = Path(model) if model else ensure_default_model()
    dtypes = tuple(d.strip() for d in kv_dtypes.split(",") if d.strip())
    result = run_bench(lambda: run_kv_agreement(path, dtypes, **kw))
    emit(result, as_json, "KV dtype vs float32 KV: greedy agreement and logit error")
