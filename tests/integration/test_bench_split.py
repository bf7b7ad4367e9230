"""`bench split` end to end at one short context on the tiny model: emulated hosts, real services."""

from __future__ import annotations

import json
import math
import os
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from fastdecode.benchmarks.hosts import NETNS_PREFIX
from fastdecode.cli import main

POINT_KEYS = {
    "context",
    "local_tokens_per_s",
    "fleet_tokens_per_s",
    "ratio",
    "s_ms",
    "r_ms",
    "exchange_cpu_ms",
    "ideal_ratio",
    "efficiency",
    "predicted_step_ms",
    "measured_step_ms",
}


def _namespaces() -> list[str]:
    try:
        out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.split()[0] for line in out.splitlines() if line.startswith(f"{NETNS_PREFIX}{os.getpid()}")]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs: one per emulated host")
@pytest.mark.parametrize("host_share", ["auto", "0.5"])
def test_cli_bench_split_tiny(model_factory: Callable, tmp_path: Path, host_share: str) -> None:
    png = tmp_path / "split.png"
    cpus = sorted(os.sched_getaffinity(0))
    args = ["bench", "split", "--json", "--model", str(model_factory("llama")), "--contexts", "48", "-B", "4"]
    args += [
        "--steps",
        "2",
        "--warmup",
        "1",
        "--pipeline",
        "on",
        "--plot",
        str(png),
        "--host-share",
        host_share,
    ]
    args += ["--dense-cpus", str(cpus[0]), "--shard-cpus", str(cpus[1])]
    before = os.sched_getaffinity(0)
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    result = json.loads(res.stdout.strip().splitlines()[-1])
    assert result["isolation"] in ("netns+veth", "pinned loopback")
    assert result["dense_cpus"] == str(cpus[0]) and result["shard_cpus"] == [str(cpus[1])]
    (point,) = result["points"]
    assert POINT_KEYS <= point.keys()
    assert point["context"] == 48
    for k in POINT_KEYS - {"exchange_cpu_ms"}:  # the exchange's CPU is a difference: may read < 0
        assert isinstance(point[k], int | float) and math.isfinite(point[k]) and point[k] > 0, k
    assert point["ratio"] == pytest.approx(point["fleet_tokens_per_s"] / point["local_tokens_per_s"])
    assert point["efficiency"] == pytest.approx(point["ratio"] / point["ideal_ratio"])
    assert point["pipelined"] is True
    # the dense host's own share: two of four sequences attended in gpu_dense's hosted shard
    assert result["host_share"] == ("auto" if host_share == "auto" else 0.5)
    if host_share == "0.5":
        assert point["host_sequences"] == 2 and point["host_share_set"] == "given"
        assert point["host_attention_ms"] > 0 and point["r_remote_ms"] > 0
    else:
        assert point["host_share_set"] == "auto" and 0 <= point["host_sequences"] <= 3
    assert png.stat().st_size > 0
    # this process's own affinity restored, the namespaces gone
    assert os.sched_getaffinity(0) == before
    assert _namespaces() == []


def test_cli_bench_split_rejects_bad_cpu_sets(model_factory: Callable) -> None:
    args = ["bench", "split", "--model", str(model_factory("llama")), "--contexts", "16"]
    res = CliRunner().invoke(main, [*args, "--dense-cpus", "0", "--shard-cpus", "0"])
    assert res.exit_code != 0 and "overlap" in res.output
    res = CliRunner().invoke(main, [*args, "--contexts", "x"])
    assert res.exit_code != 0 and "comma-separated" in res.output


def test_cli_bench_split_device_cuda_without_cuda_is_one_clear_error(model_factory: Callable) -> None:
    if torch.cuda.is_available():  # the GPU path is `make gpu-check` on a GPU host
        return
    args = ["bench", "split", "--model", str(model_factory("llama")), "--contexts", "16", "--json"]
    res = CliRunner().invoke(main, [*args, "--device", "cuda"])
    assert res.exit_code == 1 and isinstance(res.exception, SystemExit)
    assert res.output.strip() == "Error: device cuda requested but CUDA is not available"
    res = CliRunner().invoke(main, [*args, "--device", "tpu"])
    assert res.exit_code == 2 and "'tpu' is not one of 'cpu', 'cuda'" in res.output


def test_fill_rpc_writes_kv_and_maps_errors(tmp_path: Path) -> None:
    import grpc

    from fastdecode.runtime.rpc import sync_channel
    from fastdecode.tools.fleet import start_service, stop_processes
    from fastdecode.v1 import kv_attention_pb2 as kv_pb
    from fastdecode.v1 import kv_attention_pb2_grpc as kv_grpc

    proc = start_service("kv", ["kv-attention", "--kv-capacity", str(8 << 20)], tmp_path)
    ch = sync_channel(proc.address)
    try:
        stub = kv_grpc.KVAttentionStub(ch)
        with pytest.raises(grpc.RpcError) as e:  # nothing reserved yet
            stub.Fill(kv_pb.FillRequest(seq_ids=["a"], tokens=8), timeout=10)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        geometry = kv_pb.KVGeometry(num_layers=2, num_kv_heads=2, head_dim=16)
        seqs = [kv_pb.SequenceReservation(seq_id="a", max_tokens=64)]
        stub.Reserve(kv_pb.ReserveRequest(geometry=geometry, sequences=seqs), timeout=10)
        assert stub.Fill(kv_pb.FillRequest(seq_ids=["a"], tokens=40, seed=3), timeout=10).tokens_written == 40
        assert stub.Stats(kv_pb.StatsRequest(), timeout=10).tokens_held == 40
        for bad, code in (
            (kv_pb.FillRequest(seq_ids=["nope"], tokens=8), grpc.StatusCode.NOT_FOUND),
            (kv_pb.FillRequest(seq_ids=["a"], tokens=0), grpc.StatusCode.INVALID_ARGUMENT),
        ):
            with pytest.raises(grpc.RpcError) as e:
                stub.Fill(bad, timeout=10)
            assert e.value.code() == code
    finally:
        ch.close()
        stop_processes([proc], 10.0)


@pytest.mark.skipif(
    len(os.sched_getaffinity(0)) < 3, reason="needs three CPUs: a dense host, two shard hosts"
)
def test_cli_bench_split_two_shard_hosts(model_factory: Callable) -> None:
    cpus = sorted(os.sched_getaffinity(0))
    args = ["bench", "split", "--json", "--model", str(model_factory("llama")), "--contexts", "32", "-B", "6"]
    args += ["--steps", "2", "--warmup", "1", "--pipeline", "on"]
    args += ["--dense-cpus", str(cpus[0]), "--shard-cpus", f"{cpus[1]},{cpus[2]}"]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    result = json.loads(res.stdout.strip().splitlines()[-1])
    assert result["shard_cpus"] == [str(cpus[1]), str(cpus[2])]
    (point,) = result["points"]
    assert point["round_trips_per_step"] == 2 * 2 * 4  # two mini-batches x two shards x 4 layers
    assert point["fleet_tokens_per_s"] > 0 and point["r_ms"] > 0
    assert _namespaces() == []
