"""`fastdecode bench migrate`: shards that come and go while serving.

Drain: a `fastdecode up` fleet of 3 shards (fp32 KV, rebalancing off) serves 12 concurrent greedy
streams twice: once untouched (the reference), once with shard 1 drained (RemoveShard) as soon as
every stream has its first tokens. Reported: requests completed, tokens equal to the reference,
sequences migrated and re-prefilled, the drain's wall time, the copies' MB/s, and whether the
drained shard's process exited by itself.

Skew: the same load of mixed lengths (12 clients x 3 requests: prompts and generations drawn from
wide ranges) on two fresh fleets, rebalancing on (the default factor) and off. The scheduler's
per-shard KV tokens are sampled every 50 ms while at least two thirds of the streams run; the
busiest shard over the mean, at p50 and p90, and the tokens/s of each run are reported.
"""

from __future__ import annotations

import os
import random
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from fastdecode.benchmarks.fleet_bench import percentile, prompts_for
from fastdecode.benchmarks.transport import ensure_model
from fastdecode.runtime.settings import TLSFiles
from fastdecode.tools.fleet import launch_up


def _streams(
    target: str, jobs: list[tuple[list[int], int]], clients: int
) -> tuple[dict[int, list[int]], float]:
    """Run jobs (prompt, max_tokens) on `clients` threads, each taking its jobs in turn; returns
    the tokens of every job that completed and the wall time."""
    from fastdecode.client import Client, FastDecodeError

    out: dict[int, list[int]] = {}

    def client(c: int) -> None:
        with Client(target, timeout=600) as cl:
            for i in range(c, len(jobs), clients):
                prompt, n = jobs[i]
                toks: list[int] = []
                try:
                    for chunk in cl.stream(token_ids=prompt, max_tokens=n, ignore_eos=True):
                        toks += chunk.token_ids
                except FastDecodeError:
                    continue
                out[i] = toks

    t0 = time.monotonic()
    threads = [threading.Thread(target=client, args=(c,), daemon=True) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(900)
    return out, time.monotonic() - t0


def _stats(address: str, creds: TLSFiles) -> Any:
    """The scheduler's GetStats, with the fleet's credential (an internal service: it refuses a
    call without it)."""
    from fastdecode.runtime.rpc import sync_channel
    from fastdecode.v1 import scheduler_pb2, scheduler_pb2_grpc

    with sync_channel(address, creds) as ch:
        return scheduler_pb2_grpc.SchedulerStub(ch).GetStats(
            scheduler_pb2.SchedulerStatsRequest(), timeout=10
        )


def _remove(address: str, shard: int, creds: TLSFiles) -> Any:
    from fastdecode.runtime.rpc import sync_channel
    from fastdecode.v1 import scheduler_pb2, scheduler_pb2_grpc

    with sync_channel(address, creds) as ch:
        req = scheduler_pb2.RemoveShardRequest(shard=shard, timeout_seconds=300)
        return scheduler_pb2_grpc.SchedulerStub(ch).RemoveShard(req, timeout=330)


def _exited(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
            if "State:\tZ" in Path(f"/proc/{pid}/status").read_text():
                return True
        except (ProcessLookupError, FileNotFoundError):
            return True
        time.sleep(0.1)
    return False


def run_drain(model: Path, streams: int, prompt_len: int, gen_len: int, seed: int) -> dict[str, Any]:
    from fastdecode.model.config import ModelConfig

    vocab = ModelConfig.from_pretrained(model).vocab_size
    jobs = [(p, gen_len) for p in prompts_for(streams, prompt_len, vocab, seed)]
    with tempfile.TemporaryDirectory(prefix="fastdecode-migrate-") as tmp:
        up = launch_up(model, Path(tmp), shards=3, env={"FASTDECODE_REBALANCE_FACTOR": "0"})
        try:
            reference, _ = _streams(up.target, jobs, streams)
            scheduler, creds = up.state["scheduler"]["address"], up.peer_credentials
            pid = int(up.state["kv_attention"][1]["pid"])
            result: dict[str, Any] = {}
            drainer = threading.Thread(
                target=lambda: result.update(_drain_when_running(scheduler, creds, streams))
            )
            drainer.start()
            got, _ = _streams(up.target, jobs, streams)
            drainer.join(400)
            exited = _exited(pid, 60)
            st = _stats(scheduler, creds)
        finally:
            up.stop()
    r = result.get("response")
    equal = sum(1 for i, t in got.items() if reference.get(i) == t and len(t) == gen_len)
    return {
        "requests": streams,
        "completed": sum(len(t) == gen_len for t in got.values()),
        "equal_to_reference": equal,
        "migrated_sequences": r.migrated_sequences if r else 0,
        "reprefilled_sequences": r.reprefilled_sequences if r else -1,
        "drain_s": r.seconds if r else float("nan"),
        "held_when_drained": result.get("held", 0),
        "migrated_bytes": st.migrated_bytes,
        "migrate_mb_per_s": st.migrated_bytes / st.migration_seconds / 1e6 if st.migration_seconds else 0.0,
        "drained_shard_exited": exited,
        "drain_error": result.get("error", ""),
    }


def _drain_when_running(scheduler: str, creds: TLSFiles, streams: int) -> dict[str, Any]:
    """Wait until the streams run (every one admitted, shard 1 holds some), then drain shard 1."""
    import grpc

    deadline = time.monotonic() + 120
    held, finished_before = 0, None
    while time.monotonic() < deadline:
        st = _stats(scheduler, creds)
        held = st.shards[1].sequences
        if st.running >= streams and held and st.shards[1].tokens > 0:
            break
        if finished_before is None:
            finished_before = st.finished  # the reference run's
        elif st.finished - finished_before >= streams:  # short streams ended first: drain it idle
            break
        time.sleep(0.02)
    try:
        return {"response": _remove(scheduler, 1, creds), "held": held}
    except grpc.RpcError as e:
        return {"error": f"{e.code().name}: {e.details()}", "held": held}


def _skewed_jobs(vocab: int, n: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    prompts = prompts_for(n, 512, vocab, seed)
    return [(p[: rng.choice([8, 32, 128, 384])], rng.choice([32, 96, 192, 384])) for p in prompts]


def _skew_run(model: Path, jobs: list[tuple[list[int], int]], clients: int, factor: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="fastdecode-skew-") as tmp:
        up = launch_up(model, Path(tmp), shards=3, env={"FASTDECODE_REBALANCE_FACTOR": str(factor)})
        try:
            scheduler, creds = up.state["scheduler"]["address"], up.peer_credentials
            ratios: list[float] = []
            done = threading.Event()

            def sample() -> None:
                while not done.wait(0.05):
                    st = _stats(scheduler, creds)
                    if st.running < clients * 2 // 3:
                        continue  # the tail of the run: a few sequences cannot balance three shards
                    kv = [s.tokens for s in st.shards if s.healthy]
                    if sum(kv) > 0:
                        ratios.append(max(kv) / (sum(kv) / len(kv)))

            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            got, wall = _streams(up.target, jobs, clients)
            done.set()
            sampler.join(5)
            st = _stats(scheduler, creds)
        finally:
            up.stop()
    return {
        "p50": percentile(ratios, 50),
        "p90": percentile(ratios, 90),
        "tokens_per_s": sum(len(t) for t in got.values()) / wall,
        "completed": len(got),
        "migrations": st.migrations,
        "samples": len(ratios),
    }


def run_migrate_bench(
    model: Path | None = None,
    *,
    streams: int = 12,
    prompt_len: int = 64,
    gen_len: int = 256,
    skew_clients: int = 12,
    skew_requests: int = 36,
    rebalance_factor: float = 1.1,
    seed: int = 0,
) -> dict[str, Any]:
    from fastdecode.model.config import ModelConfig

    model = model or ensure_model("llama", "tiny")
    out = run_drain(model, streams, prompt_len, gen_len, seed)
    jobs = _skewed_jobs(ModelConfig.from_pretrained(model).vocab_size, skew_requests, seed)
    on = _skew_run(model, jobs, skew_clients, rebalance_factor)
    off = _skew_run(model, jobs, skew_clients, 0.0)
    out.update(
        {
            "kv_max_over_mean_p50": on["p50"],
            "kv_max_over_mean_p90": on["p90"],
            "kv_max_over_mean_p50_off": off["p50"],
            "kv_max_over_mean_p90_off": off["p90"],
            "skew_tokens_per_s": on["tokens_per_s"],
            "skew_tokens_per_s_off": off["tokens_per_s"],
            "skew_tokens_per_s_ratio": on["tokens_per_s"] / off["tokens_per_s"],
            "skew_completed": on["completed"],
            "skew_completed_off": off["completed"],
            "skew_requests": skew_requests,
            "rebalance_migrations": on["migrations"],
            "rebalance_factor": rebalance_factor,
        }
    )
    return out
