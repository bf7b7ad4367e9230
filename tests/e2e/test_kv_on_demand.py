"""KV on demand end to end: full-context max_tokens no longer pins full-context KV; a full shard
preempts and recomputes, and every request still ends with transformers' greedy tokens."""

from __future__ import annotations

import concurrent.futures
import json
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from fastdecode.client import Client
from fastdecode.model import ModelConfig
from fastdecode.runtime.rpc import sync_channel
from fastdecode.tools.fleet import Fleet
from fastdecode.v1 import kv_attention_pb2, kv_attention_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from tests.support import metric_total, scrape

CONTEXT = 64  # a short context keeps 12 full-length generations (and their oracle) fast on CPU
BLOCK = 16
PROMPTS = [[1, 5 + i, 300 + 7 * i, 45, 2 + i][: 2 + i % 4] for i in range(12)]


@pytest.fixture(scope="module")
def short_model(model_factory: Callable, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny llama with its context cut to CONTEXT (same weights: transformers agrees on them)."""
    out = tmp_path_factory.mktemp("short") / f"tiny-llama-{CONTEXT}"
    shutil.copytree(model_factory("llama"), out)
    cfg = json.loads((out / "config.json").read_text())
    cfg["max_position_embeddings"] = CONTEXT
    (out / "config.json").write_text(json.dumps(cfg))
    return out


@pytest.fixture(scope="module")
def fleet(short_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    cfg = ModelConfig.from_pretrained(short_model)
    # room for exactly 2 full-context sequences per shard (what full reservations would allow)
    capacity = 2 * CONTEXT * cfg.kv_bytes_per_token(4)
    f = Fleet(
        model=short_model,
        shards=2,
        device="cpu",
        kv_capacity=capacity,
        workdir=tmp_path_factory.mktemp("kvd"),
        # 16 steps of headroom: a 2..5-token prompt commits 2 of a shard's 8 blocks
        scheduler_args=["--kv-lookahead", "16"],
    )
    f.start()
    yield f
    f.stop()


def test_full_context_requests_share_shards_and_preempt_without_failing(
    fleet: Fleet, short_model: Path, hf_greedy: Callable
) -> None:
    assert fleet.gateway and fleet.scheduler
    creds = fleet.peer_credentials
    sched = scheduler_pb2_grpc.SchedulerStub(sync_channel(fleet.scheduler.address, creds))
    shards = [kv_attention_pb2_grpc.KVAttentionStub(sync_channel(k.address, creds)) for k in fleet.kv]
    peak = {"running": 0, "blocks": 0}
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            st = sched.GetStats(scheduler_pb2.SchedulerStatsRequest(), timeout=5)
            peak["running"] = max(peak["running"], st.running)
            for s in shards:
                kv = s.Stats(kv_attention_pb2.StatsRequest(), timeout=5)
                assert kv.blocks_in_use + kv.blocks_free == 2 * CONTEXT // BLOCK or not kv.configured
                peak["blocks"] = max(peak["blocks"], kv.blocks_in_use)
            time.sleep(0.01)

    watcher = threading.Thread(target=watch, daemon=True)
    t0 = time.monotonic()
    watcher.start()
    with Client(fleet.gateway.address) as client, concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        futures = [
            pool.submit(client.generate, token_ids=p, max_tokens=CONTEXT - len(p), timeout=300)
            for p in PROMPTS
        ]
        outs = [f.result(timeout=320) for f in futures]
    done.set()
    watcher.join(timeout=10)
    print(f"\nkv-on-demand: fleet done in {time.monotonic() - t0:.1f}s")
    # One thread for the oracle: with the host's cores shared, two spinning OpenMP threads made
    # transformers' generate ~5x slower here. The result does not depend on it.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for p, out in zip(PROMPTS, outs, strict=True):
            assert out.token_ids == hf_greedy(short_model, tuple(p), CONTEXT - len(p))
    finally:
        torch.set_num_threads(threads)
    stats = sched.GetStats(scheduler_pb2.SchedulerStatsRequest(), timeout=5)
    print(
        f"\nkv-on-demand: peak running {peak['running']}, peak blocks in use per shard {peak['blocks']}"
        f"/{2 * CONTEXT // BLOCK}, preemptions {stats.preemptions}, finished {stats.finished}"
    )
    assert peak["running"] > 4  # full-context reservations would run 2 per shard
    assert stats.preemptions > 0
    assert fleet.scheduler.metrics
    samples = scrape(fleet.scheduler.metrics)
    assert metric_total(samples, "fastdecode_preemptions_total") == stats.preemptions
    assert fleet.dense and fleet.dense.metrics
    assert metric_total(scrape(fleet.dense.metrics), "fastdecode_dense_sequences_total", outcome="error") == 0
    assert "preempted" in fleet.scheduler.log_path.read_text()
