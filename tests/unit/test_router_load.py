"""The fleet's load as the gateway exports it to routers (services/gateway/fleet_load.py): the
scheduler's counts over the shards that serve."""

from __future__ import annotations

from fastdecode.v1 import scheduler_pb2 as pb
from services.gateway.fleet_load import FleetLoad


def test_fleet_load_counts_the_serving_shards() -> None:
    shards = [
        pb.ShardLoad(shard=0, healthy=True, block_tokens=64, capacity_tokens=256),
        pb.ShardLoad(shard=1, healthy=True, block_tokens=32, capacity_tokens=256, state="draining"),
        pb.ShardLoad(shard=2, healthy=False, block_tokens=999, capacity_tokens=256),  # lost
        pb.ShardLoad(shard=3, healthy=True, block_tokens=0, capacity_tokens=256, state="removed"),
    ]
    load = FleetLoad.from_stats(pb.SchedulerStats(running=3, waiting=2, shards=shards))
    assert (load.running, load.waiting, load.kv_tokens, load.kv_capacity) == (3, 2, 96, 512)
    assert load.kv_usage == 96 / 512
    assert FleetLoad().kv_usage == 0.0  # no capacity known yet: truly zero, not a division
