"""The shard core defends its geometry: a reservation of another geometry is INVALID_ARGUMENT while it
holds sequences, and an idle shard is not pinned by one odd reservation; errors name no other ids."""

from __future__ import annotations

import pytest
import torch

from fastdecode.kv.shard import ShardCore
from fastdecode.runtime import codec
from fastdecode.runtime.errors import InvalidInput, NotFound
from fastdecode.v1 import kv_attention_pb2 as pb
from fastdecode.wire.kv import attend_batch

REAL, BOGUS = (2, 2, 8), (1, 1, 2)


def core() -> ShardCore:
    return ShardCore(1 << 20, torch.float32, 16, backend="torch")


def test_a_reservation_of_another_geometry_is_invalid_while_sequences_are_held() -> None:
    c = core()
    c.reserve(REAL, [("a", 8)])
    with pytest.raises(InvalidInput, match="geometry"):
        c.reserve(BOGUS, [("intruder", 8)])
    assert c.store is not None and c.store.geometry_matches(*REAL) and list(c.store.seqs) == ["a"]


def test_an_idle_shard_is_not_pinned_by_a_bogus_reservation() -> None:
    c = core()
    c.reserve(BOGUS, [("intruder", 8)])
    assert c.release(None) == [True]  # the scheduler frees what a shard it took back holds
    c.reserve(REAL, [("a", 8)])  # the fleet's geometry rebuilds the empty pool
    assert c.store is not None and c.store.geometry_matches(*REAL)


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
