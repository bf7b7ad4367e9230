"""A fleet behind a router: the probes vllm-router, sglang's router and llm-d's endpoint picker send
to a worker (services/gateway/router_probes.py), the Model Server Protocol gauges on /metrics under
our names and vLLM's, and `--kv-events`: the prefix blocks the fleet holds, as vLLM's ZMQ KV events,
checked against vLLM's hashes of the prompts sent, a shared prefix stored once, and evictions."""

from __future__ import annotations

import json
import random
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import msgpack
import pytest
import zmq

from fastdecode.model import ModelConfig
from fastdecode.runtime.rpc import sync_channel
from fastdecode.tools.fleet import UpProcess, free_port
from fastdecode.v1 import gateway_pb2, gateway_pb2_grpc
from services.scheduler.kv_events import vllm_block_hashes
from tests.support import TOKEN, FleetFactory, scrape

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

AUTH = (("authorization", f"Bearer {TOKEN}"),)
GAUGES = {  # ours -> vLLM's (llm-d's endpoint picker defaults)
    "fastdecode_gateway_fleet_requests_running": "vllm:num_requests_running",
    "fastdecode_gateway_fleet_requests_waiting": "vllm:num_requests_waiting",
    "fastdecode_gateway_fleet_kv_cache_usage_ratio": "vllm:kv_cache_usage_perc",
}


def get(fleet: UpProcess, path: str, token: bool = False) -> tuple[int, bytes]:
    req = urllib.request.Request(f"http://{fleet.http}{path}")
    if token:
        req.add_header("Authorization", f"Bearer {TOKEN}")
    with urllib.request.urlopen(req, timeout=30) as r:
        return r.status, r.read()


def gauges(samples: dict) -> dict[str, float]:
    names = {*GAUGES, *GAUGES.values(), "vllm:gpu_cache_usage_perc"}
    return {n: v for (n, _), v in samples.items() if n in names}


def shard_metric(fleet: UpProcess, name: str) -> float:
    return sum(v for (n, _), v in scrape(fleet.state["kv_attention"][0]["metrics"]).items() if n == name)


def generate(fleet: UpProcess, ids: list[int], max_tokens: int, metadata: tuple = ()) -> list:
    stub = gateway_pb2_grpc.GatewayStub(sync_channel(fleet.target))
    req = gateway_pb2.GenerateRequest(
        token_ids=gateway_pb2.TokenIds(ids=ids), max_tokens=max_tokens, ignore_eos=True
    )
    return list(stub.Generate(req, metadata=metadata, timeout=120))


def test_probes_and_gauges_while_requests_run(fleet: UpProcess) -> None:
    first = scrape(fleet.state["gateway"]["metrics"])  # serve() asked the scheduler before it was ready
    g = gauges(first)
    for ours, theirs in GAUGES.items():
        assert ours in g and theirs in g, (ours, theirs, sorted(g))
        assert g[ours] == g[theirs]
    assert g["vllm:gpu_cache_usage_perc"] == g["vllm:kv_cache_usage_perc"]
    assert 0.0 <= g["vllm:kv_cache_usage_perc"] <= 1.0
    lora = [lab for (n, lab) in first if n == "vllm:lora_requests_info"]
    assert lora and dict(lora[0]) == {
        "running_lora_adapters": "",
        "waiting_lora_adapters": "",
        "max_lora": "0",
    }

    clients = 12
    failed: list[BaseException] = []

    def client(i: int) -> None:
        try:
            generate(fleet, [0, 17, 300 + i, 45, 9] * 8, 400, AUTH)
        except BaseException as e:  # noqa: BLE001 (reported below, with the gauges seen)
            failed.append(e)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    seen_running = seen_usage = seen_load = 0.0
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline and any(t.is_alive() for t in threads):
            g = gauges(scrape(fleet.state["gateway"]["metrics"]))
            seen_running = max(seen_running, g["vllm:num_requests_running"])
            seen_usage = max(seen_usage, g["vllm:kv_cache_usage_perc"])
            assert 0.0 <= g["vllm:kv_cache_usage_perc"] <= 1.0
            assert g["vllm:num_requests_running"] + g["vllm:num_requests_waiting"] <= clients
            _, body = get(fleet, "/get_load")
            [load] = json.loads(body)
            assert set(load) == {"dp_rank", "num_reqs", "num_waiting_reqs", "num_tokens"}
            seen_load = max(seen_load, load["num_tokens"])
            if seen_running and seen_usage and seen_load:
                break
            time.sleep(0.05)
    finally:
        for t in threads:
            t.join(120)
    assert not failed, failed[:1]
    assert seen_running >= 1 and seen_usage > 0 and seen_load > 0, (seen_running, seen_usage, seen_load)

    # every probe a router sends, on the HTTP port (no token but on /v1/)
    assert get(fleet, "/health") == (200, b'{"status":"ok"}')
    assert get(fleet, "/health_generate")[0] == 200
    _, models = get(fleet, "/v1/models", token=True)
    model_id = json.loads(models)["data"][0]["id"]
    info = json.loads(get(fleet, "/get_model_info")[1])
    assert info["served_model_name"] == model_id and info["is_generation"] is True
    server = json.loads(get(fleet, "/get_server_info")[1])
    assert server["dp_size"] == 1 and server["max_total_num_tokens"] > 0
    status, text = get(fleet, "/metrics")
    assert status == 200 and b"vllm:num_requests_waiting" in text and b"vllm:kv_cache_usage_perc" in text
    time.sleep(1.5)  # the watch polls every second: the gauges come back to idle
    idle = gauges(scrape(fleet.state["gateway"]["metrics"]))
    assert idle["vllm:num_requests_running"] == 0 and idle["vllm:num_requests_waiting"] == 0


# ---- KV events -------------------------------------------------------------------------------------

BLOCK = 16
CAPACITY_BLOCKS = 48  # per shard: the eviction load below stores about three times as many


class Subscriber:
    """A router's end of the stream: a SUB socket bound on loopback (the scheduler connects)."""

    def __init__(self, port: int) -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.bind(f"tcp://127.0.0.1:{port}")
        self.batches: list[tuple[int, list]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        while not self.stop.is_set():
            if self.sub.poll(100):
                topic, seq, payload = self.sub.recv_multipart()
                ts, events, rank = msgpack.unpackb(payload)
                assert topic == b"" and rank == 0 and ts > 0
                self.batches.append((int.from_bytes(seq, "big"), events))

    def events(self) -> list[list]:
        return [e for _, events in list(self.batches) for e in events]

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.sub.close(linger=0)
        self.ctx.term()


@pytest.fixture(scope="module")
def kv_events_fleet(
    model_factory: Callable, fleet_factory: FleetFactory
) -> Iterator[tuple[UpProcess, Subscriber]]:
    model: Path = model_factory("llama")
    g = ModelConfig.from_pretrained(model).kv_geometry
    per_token = 2 * g.num_layers * g.num_kv_heads * g.head_dim * 4  # float32 KV
    port = free_port()
    sub = Subscriber(port)
    fleet = fleet_factory(
        model,
        "--shards",
        "1",
        "--kv-capacity",
        str(CAPACITY_BLOCKS * BLOCK * per_token),
        "--kv-events",
        f"tcp://127.0.0.1:{port}",
        private=True,
    )
    yield fleet, sub
    sub.close()


def settle(sub: Subscriber) -> None:
    n = -1
    while n != len(sub.batches):  # a quiet half second: the last step's events are in
        n = len(sub.batches)
        time.sleep(0.5)


def test_kv_events_follow_the_prefix_registry(kv_events_fleet: tuple[UpProcess, Subscriber]) -> None:
    fleet, sub = kv_events_fleet
    rng = random.Random(7)
    prefix = [rng.randrange(3, 2000) for _ in range(3 * BLOCK)]
    prompts: list[list[int]] = []

    def run(ids: list[int]) -> None:
        prompts.append(ids)
        generate(fleet, ids, 3)

    run(prefix + [rng.randrange(3, 2000) for _ in range(8)])  # computes and stores the prefix
    threads = [
        threading.Thread(target=run, args=(prefix + [rng.randrange(3, 2000) for _ in range(8)],))
        for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    settle(sub)
    shared = vllm_block_hashes(prefix, BLOCK)
    events = sub.events()
    stored_once = [e for e in events if e[0] == "BlockStored" and shared[0] in e[1]]
    assert len(stored_once) == 1, stored_once  # five requests, one copy of the prefix
    assert stored_once[0][1] == shared and stored_once[0][2] is None and stored_once[0][3] == prefix
    hits = shard_metric(fleet, "fastdecode_kv_prefix_hit_tokens_total")
    assert hits >= 4 * len(prefix)  # the shard held what the events announced: the others read it

    for _ in range(3 * CAPACITY_BLOCKS // 4):  # 4 full blocks each: the registry must evict
        run([rng.randrange(3, 2000) for _ in range(4 * BLOCK + 8)])
    settle(sub)

    # every event against vLLM's hashes of the prompts sent, the live set replayed in order
    block_of: dict[int, tuple[list[int], int | None]] = {}
    for ids in prompts:
        hashes = vllm_block_hashes(ids, BLOCK)
        for i, h in enumerate(hashes):
            block_of[h] = (ids[i * BLOCK : (i + 1) * BLOCK], hashes[i - 1] if i else None)
    seqs = [s for s, _ in sub.batches]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # no batch lost
    live: set[int] = set()
    removed = 0
    for e in sub.events():
        if e[0] == "AllBlocksCleared":
            live.clear()
        elif e[0] == "BlockStored":
            _, hashes, parent, tokens, block_size, lora_id, medium, *_ = e
            assert (block_size, lora_id, medium) == (BLOCK, None, "GPU")
            assert len(tokens) == BLOCK * len(hashes)
            assert parent == block_of[hashes[0]][1]
            for i, h in enumerate(hashes):
                assert h not in live, "stored twice while held"
                assert block_of[h][0] == tokens[i * BLOCK : (i + 1) * BLOCK]
                if i:
                    assert block_of[h][1] == hashes[i - 1]
                live.add(h)
        else:
            assert e[0] == "BlockRemoved" and e[2] == "GPU"
            for h in e[1]:
                assert h in live, "removed while not held"
                live.discard(h)
                removed += 1
        assert len(live) <= CAPACITY_BLOCKS  # never more than a shard can hold
    assert removed > 0 and live
    cached = shard_metric(fleet, "fastdecode_kv_prefix_cached_blocks")
    assert 0 < len(live) <= cached, (len(live), cached)

    # what the events say is held, the shard holds: a prompt resent finds all of its blocks cached,
    # and one whose blocks were announced removed finds none (the shard evicted them too)
    held = [ids for ids in prompts if all(h in live for h in vllm_block_hashes(ids, BLOCK))]
    gone = [ids for ids in prompts if not any(h in live for h in vllm_block_hashes(ids, BLOCK))]
    assert held and gone
    for again, expect in ((held[-1], len(held[-1]) // BLOCK * BLOCK), (gone[0], 0)):
        before = shard_metric(fleet, "fastdecode_kv_prefix_hit_tokens_total")
        generate(fleet, again, 1)
        assert shard_metric(fleet, "fastdecode_kv_prefix_hit_tokens_total") - before == expect
