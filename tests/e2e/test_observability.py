"""Metrics and logs of a running fleet: every /metrics endpoint moves with a generation, and one
request id can be followed through the gateway, scheduler, gpu_dense and the kv_attention shard."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import grpc

from fastdecode.runtime.errors import Status
from fastdecode.runtime.rpc import REQUEST_ID_KEY, sync_channel
from fastdecode.scheduling import FINISH_ERROR, FINISH_LENGTH, FINISH_STOP
from fastdecode.scheduling.tables import ADMISSION_DECISIONS
from fastdecode.tools.fleet import UpProcess
from fastdecode.v1 import gateway_pb2, gateway_pb2_grpc
from tests.support import TOKEN, Samples, scrape, start_up
from tests.support import metric_total as total


def names(samples: Samples) -> set[str]:
    return {n for n, _ in samples}


def endpoints(fleet: UpProcess) -> dict[str, list[str]]:
    s = fleet.state
    return {
        "gateway": [s["gateway"]["metrics"]],
        "scheduler": [s["scheduler"]["metrics"]],
        "gpu_dense": [s["gpu_dense"]["metrics"]],
        "kv_attention": [k["metrics"] for k in s["kv_attention"]],
    }


def scrape_all(fleet: UpProcess) -> dict[str, Samples]:
    out: dict[str, Samples] = {}
    for service, addresses in endpoints(fleet).items():
        merged: Samples = {}
        for a in addresses:
            for (n, lab), v in scrape(a).items():
                merged[(n, lab)] = merged.get((n, lab), 0.0) + v  # shards summed
        out[service] = merged
    return out


def generate(fleet: UpProcess, request_id: str, max_tokens: int = 8) -> list[gateway_pb2.GenerateResponse]:
    stub = gateway_pb2_grpc.GatewayStub(sync_channel(fleet.target))
    req = gateway_pb2.GenerateRequest(
        token_ids=gateway_pb2.TokenIds(ids=[0, 17, 300, 45, 9]), max_tokens=max_tokens, ignore_eos=True
    )
    metadata = (("authorization", f"Bearer {TOKEN}"), (REQUEST_ID_KEY, request_id))
    return list(stub.Generate(req, metadata=metadata, timeout=60))


def test_every_metrics_endpoint_moves_with_a_generation(fleet: UpProcess) -> None:
    assert all(a for addrs in endpoints(fleet).values() for a in addrs), "a service serves no /metrics"
    before = scrape_all(fleet)
    out = generate(fleet, f"metrics-{uuid.uuid4().hex[:8]}", max_tokens=8)
    assert out[-1].finish_reason == "length"
    time.sleep(0.3)  # the scheduler's release step and gauges follow the last token
    after = scrape_all(fleet)

    def moved(service: str, name: str, at_least: float = 1, **labels: str) -> None:
        delta = total(after[service], name, **labels) - total(before[service], name, **labels)
        assert delta >= at_least, f"{service}: {name}{labels or ''} moved by {delta}, want >= {at_least}"

    moved("gateway", "fastdecode_gateway_requests_total", status="OK")
    moved("gateway", "fastdecode_time_to_first_token_seconds_count")
    moved("gateway", "fastdecode_inter_token_latency_seconds_count", 7)
    moved("gateway", "fastdecode_e2e_request_latency_seconds_count")
    moved("gateway", "fastdecode_prompt_tokens_total", 5)
    moved("gateway", "fastdecode_generation_tokens_total", 8)

    moved("scheduler", "fastdecode_scheduler_step_seconds_count", 8)
    moved("scheduler", "fastdecode_scheduler_batch_size_count", 8)
    moved("scheduler", "fastdecode_admission_decisions_total", decision="admitted")
    sched = names(after["scheduler"])
    for name in (
        "fastdecode_num_requests_running",
        "fastdecode_num_requests_waiting",
        "fastdecode_shard_kv_tokens",
        "fastdecode_kv_cache_usage_ratio",
        "fastdecode_shard_recoveries_total",
    ):
        assert name in sched, name
    shards = {dict(lab)["shard"] for n, lab in after["scheduler"] if n == "fastdecode_kv_cache_usage_ratio"}
    assert shards == {"0", "1"}

    moved("gpu_dense", "fastdecode_dense_s_part_seconds_count", 8)
    moved("gpu_dense", "fastdecode_dense_shard_wait_seconds_count", 8)
    moved("gpu_dense", "fastdecode_dense_pipeline_overlap_ratio_count", 8)
    assert total(after["gpu_dense"], "fastdecode_dense_s_part_seconds_sum") > total(
        before["gpu_dense"], "fastdecode_dense_s_part_seconds_sum"
    )

    layers = 2  # the test model's depth (tests/conftest.py): one Attend item per layer and step
    moved("kv_attention", "fastdecode_kv_attention_seconds_count", 8 * layers)
    moved("kv_attention", "fastdecode_kv_bytes_read_total", 1)
    assert "fastdecode_kv_usage_ratio" in names(after["kv_attention"])


def test_every_labelled_series_is_exported_from_the_first_scrape(
    model_factory: Callable, tmp_path: Path
) -> None:
    """A fresh fleet, scraped before any request: every known label combination is there as 0 (issue
    32: the gateway's and gpu_dense's counters appeared only after first use, so a rate() missed them)."""
    fresh = start_up(model_factory("llama"), tmp_path, env={"FASTDECODE_AUTH_TOKEN": TOKEN})
    try:
        first = scrape_all(fresh)
    finally:
        fresh.stop()

    def zero(service: str, name: str, **labels: str) -> None:
        key = (name, tuple(sorted(labels.items())))
        assert key in first[service], f"{service}: {name}{labels} not exported before the first request"
        assert first[service][key] == 0, f"{service}: {name}{labels} = {first[service][key]}"

    for reason in (FINISH_STOP, FINISH_LENGTH, FINISH_ERROR):
        zero("gateway", "fastdecode_requests_total", finish_reason=reason)
    for status in Status:
        for api in ("grpc", "http"):
            zero("gateway", "fastdecode_gateway_requests_total", status=status.name, api=api)
    for mode in ("piped", "plain"):
        zero("gpu_dense", "fastdecode_dense_steps_total", mode=mode)
    for outcome in ("ok", "error"):
        zero("gpu_dense", "fastdecode_dense_sequences_total", outcome=outcome)
    for decision in ADMISSION_DECISIONS:
        zero("scheduler", "fastdecode_admission_decisions_total", decision=decision)
    for outcome in ("ok", "failed"):
        zero("scheduler", "fastdecode_migrations_total", outcome=outcome)
    for shard in ("0", "1"):
        zero("scheduler", "fastdecode_shard_kv_tokens", shard=shard)
        assert first["scheduler"][("fastdecode_shard_healthy", (("shard", shard),))] == 1
        for name in ("fastdecode_kv_tokens_held", "fastdecode_kv_sequences", "fastdecode_kv_usage_ratio"):
            zero("kv_attention", name, shard=shard)
        zero("kv_attention", "fastdecode_kv_prefix_hits_total", shard=shard)
        for status in Status:
            if status is not Status.OK:
                zero("kv_attention", "fastdecode_kv_attend_errors_total", shard=shard, code=status.name)


def json_lines(path: Path) -> list[dict]:
    lines = []
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            lines.append(json.loads(line))
    return lines


def test_one_request_id_followed_through_every_service(fleet: UpProcess) -> None:
    rid = f"trace-{uuid.uuid4().hex[:12]}"
    generate(fleet, rid, max_tokens=4)
    s = fleet.state
    logs = {
        "gateway": [Path(s["gateway"]["log"])],
        "scheduler": [Path(s["scheduler"]["log"])],
        "gpu_dense": [Path(s["gpu_dense"]["log"])],
        "kv_attention": [Path(k["log"]) for k in s["kv_attention"]],
    }
    want = {  # a message each service must log for this request
        "gateway": "finished",
        "scheduler": "finished",
        "gpu_dense": "prefill",
        "kv_attention": "released",
    }
    found: dict[str, list[dict]] = {}
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        found = {
            service: [r for p in paths for r in json_lines(p) if r.get("request_id") == rid]
            for service, paths in logs.items()
        }
        if all(any(want[sv] in r["message"] for r in found[sv]) for sv in want):
            break
        time.sleep(0.2)
    for service, records in found.items():
        assert records, f"{service} logged nothing for {rid}"
        assert any(want[service] in r["message"] for r in records), (service, records)
        for r in records:  # structured: every line names its service, level and logger
            assert r["service"].startswith(service) and r["level"] and r["logger"].startswith("fastdecode")
    sample = sorted((r for rs in found.values() for r in rs), key=lambda r: r["time"])
    print("\n" + "\n".join(json.dumps(r) for r in sample))


def test_gateway_returns_the_request_id(fleet: UpProcess) -> None:
    stub = gateway_pb2_grpc.GatewayStub(sync_channel(fleet.target))
    call = stub.Generate(
        gateway_pb2.GenerateRequest(token_ids=gateway_pb2.TokenIds(ids=[0, 5]), max_tokens=2),
        metadata=(("authorization", f"Bearer {TOKEN}"), (REQUEST_ID_KEY, "mine-123")),
        timeout=60,
    )
    list(call)
    assert dict(call.initial_metadata()).get(REQUEST_ID_KEY) == "mine-123"
    assert call.code() == grpc.StatusCode.OK
