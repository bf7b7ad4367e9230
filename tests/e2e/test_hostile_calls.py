"""The issue's hostile probes against a running fleet: Submit around the gateway, Release of every
sequence and a bogus-geometry Reserve on every shard, sent without the fleet secret while requests
decode, change nothing (UNAUTHENTICATED, same tokens); and a bogus Reserve sent *with* the secret (a
member gone wrong) no longer wedges the fleet: the shard is its own fault, requests complete."""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from fastdecode.client import Client
from fastdecode.runtime.rpc import TLSFiles, sync_channel
from fastdecode.tools.fleet import Fleet
from fastdecode.v1 import kv_attention_pb2 as kv_pb
from fastdecode.v1 import kv_attention_pb2_grpc as kv_grpc
from fastdecode.v1 import scheduler_pb2, scheduler_pb2_grpc

PROMPTS = [[0, 17, 300, 45], [0, 99, 5, 1200, 77], [0, 600], [0, 7, 250, 1800]]
BOGUS = kv_pb.KVGeometry(num_layers=1, num_kv_heads=1, head_dim=2)


@pytest.fixture(scope="module")
def fleet(model_factory: Callable, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    f = Fleet(
        model=model_factory("llama"),
        shards=2,
        device="cpu",
        kv_capacity=64 << 20,
        workdir=tmp_path_factory.mktemp("hostile"),
        scheduler_args=["--health-interval", "0.3"],
    )
    f.start()
    yield f
    f.stop()


def _generate_all(fleet: Fleet, max_tokens: int = 24) -> list[list[int]]:
    assert fleet.gateway
    with (
        Client(fleet.gateway.address, timeout=60) as client,
        concurrent.futures.ThreadPoolExecutor(4) as pool,
    ):
        return list(
            pool.map(lambda p: client.generate(token_ids=p, max_tokens=max_tokens).token_ids, PROMPTS)
        )


def _hostile_calls(fleet: Fleet, creds: TLSFiles) -> list[grpc.StatusCode]:
    assert fleet.scheduler
    codes = []
    with sync_channel(fleet.scheduler.address, creds) as ch:
        try:
            list(
                scheduler_pb2_grpc.SchedulerStub(ch).Submit(
                    scheduler_pb2.SubmitRequest(prompt_token_ids=[0, 1]), timeout=10
                )
            )
            codes.append(grpc.StatusCode.OK)
        except grpc.RpcError as e:
            codes.append(e.code())
    bogus = kv_pb.ReserveRequest(
        geometry=BOGUS, sequences=[kv_pb.SequenceReservation(seq_id="intruder", max_tokens=16)]
    )
    for k in fleet.kv:
        with sync_channel(k.address, creds) as ch:
            stub = kv_grpc.KVAttentionStub(ch)
            for method, request in ((stub.Release, kv_pb.ReleaseRequest(all=True)), (stub.Reserve, bogus)):
                try:
                    method(request, timeout=10)
                    codes.append(grpc.StatusCode.OK)
                except grpc.RpcError as e:
                    codes.append(e.code())
    return codes


def test_hostile_calls_without_the_secret_change_nothing(fleet: Fleet) -> None:
    expected = _generate_all(fleet)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        running = pool.submit(_generate_all, fleet)
        time.sleep(0.3)  # mid-decode
        codes = _hostile_calls(fleet, TLSFiles())
        got = running.result(timeout=120)
    assert codes and set(codes) == {grpc.StatusCode.UNAUTHENTICATED}, codes
    assert got == expected


def test_a_bogus_reserve_from_inside_does_not_wedge_the_fleet(
    fleet: Fleet, model_factory: Callable, tmp_path: Path
) -> None:
    """Every shard of a fresh fleet, idle and never reserved, gets a Reserve of a geometry the fleet
    does not use, with the fleet secret: requests still complete, with the same tokens (the shards
    used to take that geometry for good, requests hung to their deadline and the scheduler logged a
    warning per step)."""
    expected = _generate_all(fleet)
    with Fleet(
        model=model_factory("llama"),
        shards=2,
        device="cpu",
        kv_capacity=64 << 20,
        workdir=tmp_path,
        scheduler_args=["--health-interval", "0.3"],
    ) as fresh:
        codes = _hostile_calls(fresh, fresh.peer_credentials)
        assert codes[1:] == [grpc.StatusCode.OK] * 2 * len(fresh.kv)  # it did reach them
        t0 = time.monotonic()
        assert _generate_all(fresh) == expected
        assert time.monotonic() - t0 < 30
        assert _generate_all(fresh) == expected
    sched = (tmp_path / "scheduler.log").read_text(errors="replace")
    assert len(sched.splitlines()) < 300, sched[-3000:]
    assert "Traceback" not in sched


def _scrape(address: str, name: str) -> float:
    import urllib.request

    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + "{"))


def test_a_pool_rebuild_after_prefix_hits_leaves_the_fleet_generating(fleet: Fleet) -> None:
    """Prefix hits first, then a bogus-geometry Reserve and a Release on every idle shard with the
    secret (each pool is rebuilt and its counters restart at 0), then unique prompts: all complete,
    no call answers INTERNAL, the shards log no traceback, and the exported counters never go down."""
    assert fleet.gateway
    shared = [0, *range(100, 140)]  # 41 tokens: two full blocks shared by the repeats
    with Client(fleet.gateway.address, timeout=60) as client:
        for _ in range(3):
            client.generate(token_ids=shared, max_tokens=4)
    queries = [_scrape(k.metrics, "fastdecode_kv_prefix_queries_total") for k in fleet.kv if k.metrics]
    bogus = kv_pb.ReserveRequest(
        geometry=BOGUS, sequences=[kv_pb.SequenceReservation(seq_id="rebuild", max_tokens=16)]
    )
    # The scheduler releases a request's KV after its last token is on the way to the client, so a
    # shard may hold it a moment after generate returns; a busy shard refuses another geometry.
    deadline = time.monotonic() + 30
    for k in fleet.kv:
        assert k.metrics
        while _scrape(k.metrics, "fastdecode_kv_sequences") > 0:
            assert time.monotonic() < deadline, "a shard still holds the finished requests' KV"
            time.sleep(0.05)
    for k in fleet.kv:
        with sync_channel(k.address, fleet.peer_credentials) as ch:
            stub = kv_grpc.KVAttentionStub(ch)
            stub.Reserve(bogus, timeout=10)  # raises on INTERNAL
            assert stub.Release(kv_pb.ReleaseRequest(seq_ids=["rebuild"]), timeout=10).released == 1
    unique = [[0, 3 + i, *range(200 + 50 * i, 240 + 50 * i)] for i in range(4)]
    with (
        Client(fleet.gateway.address, timeout=60) as client,
        concurrent.futures.ThreadPoolExecutor(4) as pool,
    ):
        outs = list(pool.map(lambda p: client.generate(token_ids=p, max_tokens=8, ignore_eos=True), unique))
    assert [len(o.token_ids) for o in outs] == [8] * 4
    after = [_scrape(k.metrics, "fastdecode_kv_prefix_queries_total") for k in fleet.kv if k.metrics]
    assert all(a >= b for a, b in zip(after, queries, strict=True)), (queries, after)
    for k in fleet.kv:
        text = k.log_path.read_text(errors="replace")
        assert "Traceback" not in text and "INTERNAL" not in text, text[-3000:]
