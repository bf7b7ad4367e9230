"""A shard's metrics derive from its state and never raise: a pool rebuilt for another geometry
(an idle shard's stray Reserve) counts its prefix counters from 0 again, and the exported counters
go on from where they were (they used to get a negative `inc`, whose ValueError came after every
Reserve and Release had changed the state: INTERNAL for work done, leaked reservations)."""

from __future__ import annotations

import logging

import pytest
import torch
from prometheus_client import REGISTRY

from fastdecode.kv.shard import ShardCore
from fastdecode.runtime.geometry import KVGeometry
from services.kv_attention.metrics import ShardMetrics

GEOMETRY = KVGeometry(2, 2, 8)
PROMPT = list(range(1, 65))  # four 16-token blocks


def _counter(name: str, shard: str) -> float:
    value = REGISTRY.get_sample_value(name, {"shard": shard})
    assert value is not None
    return value


def test_a_pool_rebuild_keeps_the_counters_monotonic(caplog: pytest.LogCaptureFixture) -> None:
    shard = "rebuild-test"
    core = ShardCore(8 << 20, torch.float32, 16, backend="torch")
    metrics = ShardMetrics(shard, 8 << 20)
    metrics.pool(None)
    for i in range(3):  # the same prompt three times: queries 3; hits once its blocks are cached
        core.reserve(GEOMETRY, [(f"s{i}", 80, PROMPT)])
        metrics.pool(core.store)
        core.release([f"s{i}"])
        metrics.pool(core.store)
    queries = _counter("fastdecode_kv_prefix_queries_total", shard)
    assert queries >= 3
    with caplog.at_level(logging.WARNING):
        core.reserve(KVGeometry(1, 1, 2), [("intruder", 16)])  # another geometry: the pool is rebuilt at 0
        metrics.pool(core.store)
        core.release(["intruder"])
        metrics.pool(core.store)
        core.reserve(GEOMETRY, [("after", 80, [9] * 40)])  # and rebuilt once more, for the fleet's
        metrics.pool(core.store)
    assert _counter("fastdecode_kv_prefix_queries_total", shard) == queries + 1  # only what is new
    assert not [r for r in caplog.records if r.name.startswith("fastdecode.kv_attention.metrics")]


def test_a_failing_gauge_update_is_one_line_not_an_error(caplog: pytest.LogCaptureFixture) -> None:
    """Whatever goes wrong reading the pool's state, pool() returns: the Reserve it follows stays done."""

    class Broken:
        capacity_tokens = 1

        @property
        def tokens_reserved(self) -> int:
            raise RuntimeError("state went odd")

    metrics = ShardMetrics("broken-test", 1 << 20)
    with caplog.at_level(logging.WARNING):
        for _ in range(5):
            metrics.pool(Broken())  # type: ignore[arg-type]
    lines = [r for r in caplog.records if r.name == "fastdecode.kv_attention.metrics"]
    assert len(lines) == 1 and "state went odd" in lines[0].getMessage()
    assert lines[0].exc_info is None  # no traceback


def test_an_oversized_attend_reply_is_that_items_error() -> None:
    """A reply over what the Attend stream takes is answered RESOURCE_EXHAUSTED in-band, not written
    (gRPC failed the stream mid-write, with a traceback); the next item is answered as usual."""
    from fastdecode.runtime import codec
    from fastdecode.runtime.settings import ShardSettings
    from fastdecode.v1 import kv_attention_pb2 as pb
    from services.kv_attention.server import KVAttentionService

    service = KVAttentionService(ShardSettings(kv_capacity=8 << 20, attention_backend="torch"))
    service.core.reserve(KVGeometry(1, 2, 8), [("a", 8)])

    def item(i: int) -> pb.AttendRequest:
        q, kv = torch.zeros(1, 4, 8), torch.zeros(1, 2, 8)
        return pb.AttendRequest(
            request_id=i,
            layer=0,
            seq_ids=["a"],
            num_tokens=[1],
            start_pos=[i],
            q=codec.encode(q),
            k=codec.encode(kv),
            v=codec.encode(kv),
        )

    service.max_reply_bytes = 64  # a 4-head reply of 8 floats is larger
    refused = service.answer(item(0))
    assert isinstance(refused, pb.AttendResponse) and refused.error.code == 8  # RESOURCE_EXHAUSTED
    assert "the limit is 64" in refused.error.message
    service.max_reply_bytes = 1 << 20
    assert isinstance(service.answer(item(0)), bytes)
