"""`bench split`'s pure parts: CPU-set parsing, host layout, the planner's split step, the fill."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fastdecode.benchmarks.gpu_check import split_layouts
from fastdecode.benchmarks.hosts import cpu_list, host_layout, parse_cpu_set, parse_hosts, thread_env
from fastdecode.benchmarks.split import crossover, run_split_bench
from fastdecode.kv import AttendBatch, KVStore
from fastdecode.planning.planner import SplitParts, best_host_share, split_ideal_ratio, split_step_s
from fastdecode.runtime.errors import InvalidInput, NotFound
from fastdecode.runtime.geometry import KVGeometry


def test_cpu_set_parsing() -> None:
    assert parse_cpu_set("0") == (0,)
    assert parse_cpu_set("0-3") == (0, 1, 2, 3)
    assert parse_cpu_set(" 6-7 + 0-1 ") == (0, 1, 6, 7)
    assert parse_hosts("4-7,8-11") == ((4, 5, 6, 7), (8, 9, 10, 11))
    assert parse_hosts("1") == ((1,),)
    for bad in ("", "a", "3-1", "1-", "0,1"):
        with pytest.raises(InvalidInput):
            parse_cpu_set(bad)
    with pytest.raises(InvalidInput):
        parse_hosts(" ")


def test_cpu_list_is_the_kernel_form() -> None:
    assert cpu_list((0, 1, 2, 3, 8, 10, 11)) == "0-3,8,10-11"
    assert cpu_list((5,)) == "5"
    assert parse_cpu_set(cpu_list((0, 1, 2, 3)).replace(",", "+")) == (0, 1, 2, 3)


def test_default_layout_gives_the_first_cpu_to_the_dense_host() -> None:
    layout = host_layout(available={0, 1})
    assert layout.dense == (0,) and layout.shards == ((1,),)
    layout = host_layout(available={2, 3, 4, 5})
    assert layout.dense == (2,) and layout.shards == ((3, 4, 5),)
    assert layout.dense_threads == 1 and layout.shard_threads(0) == 3
    assert "shard host 0: CPUs 3-5" in layout.describe()


def test_several_shard_hosts() -> None:
    layout = host_layout("0-3", "4-7,8-11", available=set(range(16)))
    assert layout.dense == (0, 1, 2, 3)
    assert layout.shards == ((4, 5, 6, 7), (8, 9, 10, 11))
    assert [layout.shard_threads(i) for i in range(2)] == [4, 4]
    assert thread_env(layout.shards[1])["OMP_NUM_THREADS"] == "4"


def test_layout_rejects_overlap_missing_cpus_and_no_room() -> None:
    with pytest.raises(InvalidInput, match="overlap"):
        host_layout("0-1", "1-2", available={0, 1, 2})
    with pytest.raises(InvalidInput, match="not available"):
        host_layout("0", "7", available={0, 1})
    with pytest.raises(InvalidInput, match="no CPU left"):
        host_layout(available={0})


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-CUDA error path")
def test_split_device_cuda_without_cuda_is_invalid_input(tmp_path: Path) -> None:
    # checked before the model is read or any host is made: tmp_path holds no checkpoint
    with pytest.raises(InvalidInput, match="CUDA is not available"):
        run_split_bench(tmp_path, device="cuda")
    with pytest.raises(InvalidInput, match="device must be one of"):
        run_split_bench(tmp_path, device="tpu")


def test_gpu_check_split_layouts_deal_the_cpus() -> None:
    layouts = split_layouts(range(16))
    assert [n for n, _, _ in layouts] == [1, 2, 4, 8]
    assert layouts[0] == (1, "0-3", "4-15")
    assert layouts[1] == (2, "0-3", "4-9,10-15")
    assert layouts[3][2] == "4,5,6,7,8,9,10,11"
    # every layout is one host_layout accepts on those CPUs
    for n, dense, shards in layouts:
        layout = host_layout(dense, shards, available=set(range(16)))
        assert len(layout.shards) == n and layout.dense == (0, 1, 2, 3)
    # counts the CPUs cannot hold are skipped; one host's gaps are joined by '+'
    assert split_layouts(range(2)) == [(1, "0", "1")]
    assert [n for n, _, _ in split_layouts(range(8))] == [1, 2, 4]
    assert split_layouts([0, 2, 3, 5, 6, 7, 9, 10], counts=(1,)) == [(1, "0+2", "3+5-7+9-10")]
    assert split_layouts([0]) == []


def test_split_step_overlaps_when_piped() -> None:
    # per layer: dense 4 ms, shard 6 ms over 10 layers
    parts = SplitParts(dense_s=0.03, attention_s=0.05, num_layers=10, dense_exchange_s=0.01)
    assert split_step_s(parts, pipelined=False) == pytest.approx(0.09)
    assert split_step_s(parts, pipelined=True) == pytest.approx(0.05)  # the shard side sets it
    # balanced sides: one half's chain (half of each side plus the wire) sets the layer
    even = SplitParts(dense_s=0.05, attention_s=0.05, num_layers=10, wire_s=0.001)
    assert split_step_s(even, pipelined=True) == pytest.approx(0.06)
    assert split_ideal_ratio(0.2, 0.3) == pytest.approx(0.5 / 0.3)
    with pytest.raises(InvalidInput):
        split_step_s(SplitParts(0.1, 0.1, 0), True)


def test_a_hosted_share_and_the_tail_in_the_split_step() -> None:
    # plain: the dense host attends its share while the shard hosts attend theirs; then the tail
    parts = SplitParts(dense_s=0.1, attention_s=0.04, num_layers=10, host_attention_s=0.05, tail_s=0.02)
    assert split_step_s(parts, pipelined=False) == pytest.approx(0.1 + 0.05 + 0.02)
    # piped: the share is dense-side work, overlapped with the shard hosts'
    assert split_step_s(parts, pipelined=True) == pytest.approx(0.15 + 0.02)
    with pytest.raises(InvalidInput):
        split_step_s(SplitParts(0.1, 0.1, 10, tail_s=-1), True)


def test_best_host_share_balances_the_hosts() -> None:
    # unpiped, attention as fast on both hosts: half the batch each
    plain = best_host_share(32, 10, 0.1, 0.2, 0.08, 0.08, modes=(False,))
    assert plain.sequences == 16 and not plain.pipelined
    assert plain.predicted_step_s == pytest.approx(0.1 + 0.04)
    # piped with the S-part at 0.15 s and attention at 0.3 s: the dense host takes k so that
    # 0.15 + 0.3 k / 32 = 0.3 (32 - k) / 32, k = 8
    piped = best_host_share(32, 10, 0.1, 0.15, 0.3, 0.3, modes=(True,))
    assert piped.sequences == 8 and piped.pipelined
    assert piped.predicted_step_s == pytest.approx(0.225)
    # nothing to gain when the dense side is the bottleneck: no share
    assert best_host_share(32, 10, 0.3, 0.4, 0.05, 0.05, modes=(True,)).sequences == 0
    # both modes: the faster wins (here the piped one), and a tail adds to either
    both = best_host_share(32, 10, 0.1, 0.15, 0.3, 0.3, tail_s=0.02)
    assert both.pipelined and both.predicted_step_s == pytest.approx(0.245)
    with pytest.raises(InvalidInput):
        best_host_share(1, 10, 0.1, 0.1, 0.1, 0.1)


def test_crossover_is_the_smallest_context_won() -> None:
    pts = [{"context": c, "ratio": r} for c, r in ((512, 0.9), (1024, 1.01), (2048, 0.99), (4096, 1.3))]
    assert crossover(pts) == 1024
    assert crossover([{"context": 512, "ratio": 0.5}]) is None


def test_fill_synthetic_writes_every_layer_linearly() -> None:
    store = KVStore(KVGeometry(3, 2, 8), 1 << 20, torch.bfloat16, block_size=16)
    store.reserve("a", 40)
    store.reserve("b", 40)
    assert store.fill_synthetic(["a", "b"], 33, seed=1) == 33
    assert store.seqs["a"].lengths == [33, 33, 33]
    assert store.tokens_held == 2 * 33
    # decode attends over the filled cache like over a prefilled one
    q = torch.randn(2, 4, 8)
    kv = torch.randn(2, 2, 8)
    o = store.attend(0, AttendBatch(["a", "b"], [1, 1], [33, 33], q, kv, kv))
    assert o.shape == (2, 32) and torch.isfinite(o.float()).all()
    with pytest.raises(NotFound):
        store.fill_synthetic(["zz"], 4)
    with pytest.raises(InvalidInput):
        store.fill_synthetic(["a"], 0)


def test_step_timings_carry_the_mode_and_the_s_part_cpu() -> None:
    from fastdecode.dense.outcome import Timings
    from fastdecode.wire.dense import timings_to_proto

    t = Timings(s_part_seconds=0.2, s_part_cpu_seconds=0.15, step_seconds=0.3, pipelined=True)
    p = timings_to_proto(t)
    assert p.pipelined is True
    assert p.s_part_cpu_seconds == pytest.approx(0.15) and p.s_part_seconds == pytest.approx(0.2)
    assert timings_to_proto(Timings()).pipelined is False
