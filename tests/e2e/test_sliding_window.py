"""A Mistral checkpoint with a sliding window (8 keys) through a 2-shard fleet, both attention
backends: greedy fp32 tokens equal transformers' `generate` on prompts longer than the window,
prefilled in chunks smaller than the prompts, and the shards hold windows, not whole contexts."""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from fastdecode.client import Client
from fastdecode.model import ModelConfig
from fastdecode.runtime.rpc import sync_channel
from fastdecode.tools.fleet import Fleet, UpProcess
from fastdecode.v1 import kv_attention_pb2, kv_attention_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from tests.support import TOKEN, start_up

WINDOW = 8
PROMPTS = [
    [0] + list(range(100, 140)),  # 41 tokens: five windows
    [0, 7, 7, 7, 250, 1800, 42, 3, 999, 1500, 64, 128, 256, 512, 1024, 2000, 11, 12, 13, 14, 15, 16],
    [0, 33, 44, 55, 66, 77, 88, 99, 111, 222, 333],
    [0, 600],  # shorter than the window: it passes it while decoding
]
MAX_NEW = 24


@pytest.fixture(scope="module")
def mistral_window(model_factory: Callable, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random Mistral, saved again by transformers itself with sliding_window = 8."""
    from transformers import AutoModelForCausalLM

    src = model_factory("mistral")
    model = AutoModelForCausalLM.from_pretrained(src)
    model.config.sliding_window = WINDOW
    out = tmp_path_factory.mktemp("mistral-window")
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(src / name, out / name)
    assert ModelConfig.from_pretrained(out).layer_windows == (WINDOW,) * model.config.num_hidden_layers
    return out


@pytest.fixture(scope="module", params=["native", "torch"])
def fleet(request: pytest.FixtureRequest, mistral_window: Path, tmp_path_factory) -> Iterator[UpProcess]:
    f = start_up(
        mistral_window,
        tmp_path_factory.mktemp(f"window-{request.param}"),
        "--kv-dtype",
        "float32",
        env={
            "FASTDECODE_AUTH_TOKEN": TOKEN,
            "FASTDECODE_ATTENTION_BACKEND": request.param,
            "FASTDECODE_PREFILL_TOKEN_BUDGET": "16",  # chunks shorter than the long prompts
        },
    )
    yield f
    f.stop()


def test_windowed_greedy_equals_transformers(
    fleet: UpProcess, hf_greedy: Callable, mistral_window: Path
) -> None:
    with Client(fleet.target, token=TOKEN) as client, concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(client.generate, token_ids=p, max_tokens=MAX_NEW) for p in PROMPTS]
        outs = [f.result(timeout=180) for f in futures]
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert out.token_ids == hf_greedy(mistral_window, tuple(prompt), MAX_NEW)


def test_a_shared_prefix_is_read_from_the_windowed_cache(
    fleet: UpProcess, hf_greedy: Callable, mistral_window: Path
) -> None:
    """A prompt that starts with a finished one's 41 tokens: the shard finds its blocks (the
    window's last blocks cached too), the dense side computes only the rest, the tokens are equal."""
    long = PROMPTS[0] + [5, 6, 7, 1500, 9]
    with Client(fleet.target, token=TOKEN) as client:
        client.generate(token_ids=PROMPTS[0], max_tokens=4)  # its prompt blocks are cached now
        out = client.generate(token_ids=long, max_tokens=MAX_NEW)
    assert out.usage.cached_tokens == 32  # two full blocks of 16 of the shared 41 tokens
    assert out.token_ids == hf_greedy(mistral_window, tuple(long), MAX_NEW)


def test_a_lost_shard_recomputes_windowed_sequences(
    mistral_window: Path, hf_greedy: Callable, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """kill -9 of a shard while windowed sequences decode there: the scheduler re-prefills their
    history on the other shard (in chunks, each query with its window) and the tokens stay equal."""
    f = Fleet(
        model=mistral_window,
        shards=2,
        device="cpu",
        kv_capacity=64 << 20,
        workdir=tmp_path_factory.mktemp("window-recovery"),
        scheduler_args=["--health-interval", "0.3"],
        env={"FASTDECODE_PREFILL_TOKEN_BUDGET": "16"},
    )
    f.start()
    try:
        assert f.gateway
        outs = _decode_and_kill_shard_1(f)
        for prompt, out in zip(PROMPTS, outs, strict=True):
            assert out.token_ids == hf_greedy(mistral_window, tuple(prompt), 40)
        sched = scheduler_pb2_grpc.SchedulerStub(sync_channel(f.scheduler.address, f.peer_credentials))
        assert sched.GetStats(scheduler_pb2.SchedulerStatsRequest(), timeout=5).recoveries > 0
    finally:
        f.stop()


def test_speculation_on_windowed_layers_with_a_shared_prefix_and_a_lost_shard(
    mistral_window: Path, hf_greedy: Callable, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """--speculative ngram on the windowed model: rows of drafts attend with each query's window, a
    prompt sharing a finished one's prefix reads its cached blocks, and kill -9 of a shard while rows
    with drafts decode there costs a re-prefill, not a token: all equal transformers'."""
    f = Fleet(
        model=mistral_window,
        shards=2,
        device="cpu",
        kv_capacity=64 << 20,
        workdir=tmp_path_factory.mktemp("window-spec"),
        scheduler_args=[
            "--health-interval",
            "0.3",
            "--speculative",
            "ngram",
            "--num-speculative-tokens",
            "4",
            "--speculative-k",
            "fixed",  # drafts on every row, whatever they cost on this CPU
        ],
        env={"FASTDECODE_PREFILL_TOKEN_BUDGET": "16"},
    )
    f.start()
    try:
        assert f.gateway and f.scheduler
        sched = scheduler_pb2_grpc.SchedulerStub(sync_channel(f.scheduler.address, f.peer_credentials))
        with Client(f.gateway.address) as client:
            client.generate(token_ids=PROMPTS[0], max_tokens=4)
            long = PROMPTS[0] + [5, 6, 7, 1500, 9]
            out = client.generate(token_ids=long, max_tokens=MAX_NEW)
            assert out.usage.cached_tokens == 32 and out.token_ids == hf_greedy(
                mistral_window, tuple(long), MAX_NEW
            )
        outs = _decode_and_kill_shard_1(f)
        for prompt, out in zip(PROMPTS, outs, strict=True):
            assert out.token_ids == hf_greedy(mistral_window, tuple(prompt), 40)
        st = sched.GetStats(scheduler_pb2.SchedulerStatsRequest(), timeout=5)
        assert st.recoveries > 0 and st.spec_rows > 0
    finally:
        f.stop()


def _decode_and_kill_shard_1(f: Fleet) -> list:
    """PROMPTS decoded 40 tokens each, with kill -9 of shard 1 once decoding past the window is under
    way there; each request's outcome."""
    assert f.gateway
    with Client(f.gateway.address) as client, concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(client.generate, token_ids=p, max_tokens=40) for p in PROMPTS]
        stub = kv_attention_pb2_grpc.KVAttentionStub(sync_channel(f.kv[1].address, f.peer_credentials))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            stats = stub.Stats(kv_attention_pb2.StatsRequest(), timeout=5)
            if stats.attend_items > 40 * 4 and stats.sequences:
                break
            time.sleep(0.02)
        os.kill(f.kv[1].pid, signal.SIGKILL)
        return [fut.result(timeout=180) for fut in futures]
