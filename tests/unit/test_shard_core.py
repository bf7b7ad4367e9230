"""The shard core defends its geometry: a reservation of another geometry is INVALID_ARGUMENT while it
holds sequences, and an idle shard is not pinned by one odd reservation; errors name no other ids; a
geometry out of range, or whose pool does not fit the capacity or the host, is refused before anything
is allocated."""

from __future__ import annotations

import os
import time

import pytest
import torch

from fastdecode.benchmarks.common import proc_status_bytes
from fastdecode.kv import memory
from fastdecode.kv.shard import ShardCore
from fastdecode.kv.store import KVStore
from fastdecode.runtime import codec
from fastdecode.runtime.errors import InvalidInput, NotFound, ResourceExhausted
from fastdecode.runtime.geometry import KVGeometry
from fastdecode.v1 import kv_attention_pb2 as pb
from fastdecode.wire.kv import attend_batch
from fastdecode.wire.kv_control import geometry_from_proto, geometry_to_proto

REAL, BOGUS = KVGeometry(2, 2, 8), KVGeometry(1, 1, 2)


def core() -> ShardCore:
    return ShardCore(1 << 20, torch.float32, 16, backend="torch")


def test_a_reservation_of_another_geometry_is_invalid_while_sequences_are_held() -> None:
    c = core()
    c.reserve(REAL, [("a", 8)])
    with pytest.raises(InvalidInput, match="geometry"):
        c.reserve(BOGUS, [("intruder", 8)])
    assert c.store is not None and c.store.geometry_matches(REAL) and list(c.store.seqs) == ["a"]


def test_an_idle_shard_is_not_pinned_by_a_bogus_reservation() -> None:
    c = core()
    c.reserve(BOGUS, [("intruder", 8)])
    assert c.release(None) == [True]  # the scheduler frees what a shard it took back holds
    c.reserve(REAL, [("a", 8)])  # the fleet's geometry rebuilds the empty pool
    assert c.store is not None and c.store.geometry_matches(REAL)


def test_attend_errors_name_no_sequence_id() -> None:
    c = core()
    c.reserve(REAL, [("secret-request-a", 8)])
    q = torch.zeros(2, 4, 8)  # two sequences, one token each, 4 query heads
    kv = torch.zeros(2, 2, 8)
    req = pb.AttendRequest(
        layer=0,
        seq_ids=["secret-request-a", "secret-request-b"],
        num_tokens=[1, 1],
        start_pos=[0, 0],
        q=codec.encode(q),
        k=codec.encode(kv),
        v=codec.encode(kv),
    )
    with pytest.raises(NotFound) as info:
        c.attend(req.layer, attend_batch(req))
    assert "secret-request" not in info.value.message and "1 of 2" in info.value.message


# ---- a geometry is checked before its pool is allocated -----------------------------------
# every field at int32's top: one Reserve of it took 23 GB and the OOM killer
HUGE = KVGeometry(*((1 << 31) - 1,) * 3)


def rss_bytes() -> int:
    return proc_status_bytes(os.getpid()) or 0


@pytest.mark.parametrize("held", ["fresh", "idle", "busy"])
def test_the_int32_geometry_is_refused_at_once_before_any_allocation(held: str) -> None:
    c = core()
    if held != "fresh":
        c.reserve(REAL, [("a", 8)])
        if held == "idle":
            c.release(None)
    before, t0 = rss_bytes(), time.perf_counter()
    with pytest.raises(ResourceExhausted, match="one block of 16 tokens") as info:
        c.reserve(HUGE, [("intruder", 16)])
    assert time.perf_counter() - t0 < 1.0
    assert rss_bytes() - before < 50 << 20
    assert "1048576" in info.value.message  # names the pool it does not fit
    if held == "fresh":
        assert c.store is None
    else:  # the pool it had stays, and so does what it holds
        assert c.store is not None and c.store.geometry_matches(REAL)
        assert list(c.store.seqs) == ([] if held == "idle" else ["a"])


@pytest.mark.parametrize(
    "geometry, needle",
    [
        ((0, 2, 8), "must be positive"),
        ((2, -1, 8), "must be positive"),
        ((2, 2, 0), "must be positive"),
        ((2000, 1, 1), "num_layers must be in [1, 1024]"),
        ((1, 2000, 1), "num_kv_heads must be in [1, 1024]"),
        ((1, 1, 5000), "head_dim must be in [1, 4096]"),
        ((2, 2, 8, [4], 0.0), "1 layer windows for 2 layers"),
        ((2, 2, 8, [4, -1], 0.0), "each layer window"),
        ((2, 2, 8, [], float("nan")), "attn_logit_softcap"),
        ((2, 2, 8, [], float("inf")), "attn_logit_softcap"),
        ((2, 2, 8, [], -1.0), "attn_logit_softcap"),
    ],
)
def test_each_geometry_field_out_of_range_is_invalid_and_named(geometry: tuple, needle: str) -> None:
    c = ShardCore(64 << 20, torch.float32, 16, backend="torch")
    with pytest.raises(InvalidInput) as info:  # a window or cap below 0 already as a KVGeometry
        c.reserve(KVGeometry(*geometry), [("a", 8)])
    assert needle in info.value.message and c.store is None


def test_a_block_size_out_of_range_is_invalid() -> None:
    for bs in (0, 5000):
        with pytest.raises(InvalidInput, match="block size"):
            ShardCore(1 << 20, torch.float32, bs, backend="torch").reserve(REAL, [("a", 8)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("windows", [[], [4, 0, 4, 0]])
def test_a_pool_of_one_block_on_every_layer_fits_and_one_byte_less_does_not(
    dtype: torch.dtype, windows: list[int]
) -> None:
    """The fit is counted in bytes as the store lays them out: int8's scale per row included, a
    windowed store's blocks per layer group."""
    layers, kvh, dim, bs = 4, 2, 8, 16
    row = dim * dtype.itemsize + (4 if dtype == torch.int8 else 0)
    need = bs * 2 * layers * kvh * row
    geometry = KVGeometry(layers, kvh, dim, tuple(windows))
    with pytest.raises(ResourceExhausted):
        ShardCore(need - 1, dtype, bs, backend="torch").reserve(geometry, [("a", 1)])
    c = ShardCore(need, dtype, bs, backend="torch")
    c.reserve(geometry, [("a", 1)])
    assert c.store is not None and c.store.capacity_tokens == bs and c.store.capacity_bytes == need


def test_a_pool_larger_than_the_hosts_available_memory_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memory, "host_available_bytes", lambda: 1000)
    c = core()
    with pytest.raises(ResourceExhausted, match="available memory"):
        c.reserve(REAL, [("a", 8)])
    assert c.store is None
    # an idle pool a rebuild lets go counts as available (KVStore checks again once it is gone)
    plan = memory.plan_pool(BOGUS, 16, torch.float32, 1 << 20, freed_bytes=1 << 20)
    assert plan.pool_bytes == 1 << 20


def test_plan_pool_is_what_the_store_builds() -> None:
    geometry = KVGeometry(6, 2, 8, (512, 512, 512, 512, 512, 0))
    plan = memory.plan_pool(geometry, 16, torch.bfloat16, 1 << 20)
    store = KVStore(geometry, 1 << 20, torch.bfloat16, 16, backend="torch")
    assert (plan.num_blocks, plan.pool_bytes, plan.bytes_per_token, plan.group_size) == (
        store.num_blocks,
        store.capacity_bytes,
        store.bytes_per_token,
        store.group_size,
    )


def test_the_wire_copies_no_more_windows_than_layers_can_be() -> None:
    g = pb.KVGeometry(num_layers=2, num_kv_heads=2, head_dim=8, layer_windows=[1] * 5000)
    with pytest.raises(InvalidInput, match="5000 layer windows"):
        geometry_from_proto(g)
    g = pb.KVGeometry(num_layers=2, num_kv_heads=2, head_dim=8, layer_windows=[3, 0], attn_logit_softcap=30)
    assert geometry_from_proto(g) == KVGeometry(2, 2, 8, (3, 0), 30.0)
    assert geometry_from_proto(geometry_to_proto(KVGeometry(2, 2, 8, (3, 0), 30.0))) == geometry_from_proto(g)
