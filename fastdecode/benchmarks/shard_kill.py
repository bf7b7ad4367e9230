"""`fastdecode bench shard-kill`: kill -9 of a shard mid-decode, today's recovery (its sequences
re-prefilled from their history) against a pool that outlives the process (--kv-dir: the restarted
shard re-attaches it and its sequences resume where they were), on the same workload.

Per KV dtype: a fleet without a kill gives the greedy tokens to equal; then, per mode, a fleet whose
shard 1 is killed once every stream is decoding and restarted at once on its address (as `up` or a
pod's restart policy does). Reported per run: whether every stream's tokens equal the run without
the kill, the stall (the longest wait between two tokens of a stream, after the kill), the time from
the kill to the last stream's end, the sequences and tokens re-prefilled, and the sequences resumed
and positions torn (recomputed) after a re-attach."""

from __future__ import annotations

import concurrent.futures
import os
import random
import re
import signal
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from fastdecode.client import Client
from fastdecode.runtime.errors import InvalidInput
from fastdecode.runtime.rpc import sync_channel
from fastdecode.tools.fleet import Fleet
from fastdecode.v1 import kv_attention_pb2, kv_attention_pb2_grpc

MODES = ("today", "kv-dir")
COUNTERS = {
    "recovered_sequences": "fastdecode_shard_recoveries_total",
    "recovered_tokens": "fastdecode_shard_recovery_tokens_total",
    "resumed_sequences": "fastdecode_shard_reattached_sequences_total",
    "torn_positions": 'fastdecode_shard_reattach_recomputed_positions_total{kind="torn"}',
    "reprefilled_positions": 'fastdecode_shard_reattach_recomputed_positions_total{kind="reprefilled"}',
}


def _prompts(n: int, context: int, vocab: int, seed: int, shared: int = 0) -> list[list[int]]:
    """n prompts of `context` random ids, the first `shared` of them the same in every prompt."""
    rng = random.Random(seed)
    head = [rng.randrange(1, vocab) for _ in range(shared)]
    return [head + [rng.randrange(1, vocab) for _ in range(context - shared)] for _ in range(n)]


def _counters(f: Fleet) -> dict[str, float]:
    assert f.scheduler and f.scheduler.metrics
    text = urllib.request.urlopen(f"http://{f.scheduler.metrics}/metrics", timeout=10).read().decode()
    out = {}
    for key, name in COUNTERS.items():
        m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
        out[key] = float(m.group(1)) if m else 0.0
    return out


def _held(f: Fleet, shard: int) -> int:
    stub = kv_attention_pb2_grpc.KVAttentionStub(sync_channel(f.kv[shard].address, f.peer_credentials))
    return int(stub.Stats(kv_attention_pb2.StatsRequest(), timeout=10).tokens_held)


def _streams(
    f: Fleet, prompts: list[list[int]], tokens: int, kill_after: int | None
) -> tuple[list[list[int]], float | None, list[float], float]:
    """Every prompt as a greedy stream; with kill_after, shard 1 is killed (then restarted) once each
    stream has that many tokens. Returns the tokens, the kill time, each stream's longest gap after
    it and the time the last stream ended."""
    assert f.gateway
    arrivals: list[list[float]] = [[] for _ in prompts]

    def one(i: int) -> list[int]:
        out: list[int] = []
        with Client(f.gateway.address, timeout=3600) as client:  # type: ignore[union-attr]
            for chunk in client.stream(token_ids=prompts[i], max_tokens=tokens, ignore_eos=True):
                out += chunk.token_ids
                arrivals[i] += [time.monotonic()] * len(chunk.token_ids)
        return out

    killed_at = None
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(one, i) for i in range(len(prompts))]
        if kill_after is not None:
            while min(len(a) for a in arrivals) < kill_after and not any(x.done() for x in futures):
                time.sleep(0.02)
            held = _held(f, 1)
            os.kill(f.kv[1].pid, signal.SIGKILL)
            killed_at = time.monotonic()
            f.kv[1].proc.wait(timeout=30)
            f.restart(f.kv[1])
            print(
                f"killed shard 1 holding {held} tokens; restarted in {time.monotonic() - killed_at:.1f}s",
                file=sys.stderr,  # stdout is the result (--json)
            )
        outs = [x.result() for x in futures]
    gaps = []
    if killed_at is not None:
        for a in arrivals:
            after = [killed_at] + [t for t in a if t > killed_at]
            gaps.append(max((b - x for x, b in zip(after, after[1:], strict=False)), default=0.0))
    return outs, killed_at, gaps, max(max(a) for a in arrivals if a)


def run_shard_kill(
    model: Path,
    sequences: int = 16,
    context: int = 2048,
    tokens: int = 32,
    kv_dtypes: tuple[str, ...] = ("float32", "float8_e4m3"),
    modes: tuple[str, ...] = MODES,
    kill_after: int = 8,
    kv_dir: Path | None = None,
    seed: int = 0,
    shared_prefix: int = 0,
) -> dict[str, Any]:
    from fastdecode.model.config import ModelConfig

    config = ModelConfig.from_pretrained(model)
    if not 0 <= shared_prefix < context:
        raise InvalidInput(f"--shared-prefix must be below --context ({context}), got {shared_prefix}")
    prompts = _prompts(sequences, context, config.vocab_size, seed, shared_prefix)
    per_token = config.kv_geometry.bytes_per_token(4)
    # each shard room for every sequence: today's recovery re-prefills shard 1's on shard 0
    capacity = int(sequences * (context + tokens + 64) * per_token * 1.1)
    result: dict[str, Any] = {
        "model": model.name,
        "sequences": sequences,
        "context": context,
        "tokens": tokens,
        "kill_after_tokens": kill_after,
        "shared_prefix": shared_prefix,  # tokens every prompt starts with (prefix caching shares them)
    }
    root = Path(tempfile.mkdtemp(prefix="fastdecode-shard-kill-"))
    for dtype in kv_dtypes:
        want: list[list[int]] | None = None
        for mode in modes:
            pool_dir = (kv_dir or Path("/dev/shm")) / f"fastdecode-shard-kill-{os.getpid()}-{dtype}"
            f = Fleet(
                model=model,
                shards=2,
                device="cpu",
                kv_capacity=capacity,
                kv_dtype=dtype,
                kv_dir=pool_dir if mode == "kv-dir" else None,
                workdir=root / f"{dtype}-{mode}",
                scheduler_args=["--health-interval", "0.2", "--shard-restart-grace", "600"],
            )
            f.start(timeout=600)
            try:
                if want is None:  # the tokens of a run without the kill, on this dtype
                    t0 = time.monotonic()
                    want = _streams(f, prompts, tokens, None)[0]
                    result[f"{dtype}_no_kill_seconds"] = round(time.monotonic() - t0, 2)
                before = _counters(f)
                got, killed_at, gaps, end = _streams(f, prompts, tokens, kill_after)
                after = _counters(f)
            finally:
                f.stop()
                for p in pool_dir.glob("*") if pool_dir.exists() else ():
                    p.unlink()
            key = f"{dtype}_{mode}"
            result[f"{key}_same_tokens"] = got == want
            result[f"{key}_stall_max_s"] = round(max(gaps), 2)
            result[f"{key}_stall_median_s"] = round(sorted(gaps)[len(gaps) // 2], 2)
            result[f"{key}_kill_to_done_s"] = round(end - (killed_at or end), 2)
            for k in COUNTERS:
                result[f"{key}_{k}"] = int(after[k] - before[k])
        if len(modes) == 2:
            result[f"{dtype}_stall_ratio"] = round(
                result[f"{dtype}_kv-dir_stall_max_s"] / max(1e-9, result[f"{dtype}_today_stall_max_s"]), 3
            )
    return result
