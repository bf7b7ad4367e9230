"""The gateway's Prometheus metrics: GatewayCore reports through GatewayMetrics, this exports it."""

from __future__ import annotations

import time

from prometheus_client import Counter, Gauge, Histogram

from fastdecode.gateway.auth import current_tenant
from fastdecode.gateway.core import GatewayMetrics
from fastdecode.runtime.errors import Status
from fastdecode.scheduling import FINISH_ERROR, FINISH_LENGTH, FINISH_STOP

TTFT = Histogram(
    "fastdecode_time_to_first_token_seconds",
    "Time from request arrival to the first streamed token",
    buckets=(
        0.001,
        0.005,
        0.01,
        0.02,
        0.04,
        0.06,
        0.08,
        0.1,
        0.25,
        0.5,
        0.75,
        1.0,
        2.5,
        5.0,
        7.5,
        10.0,
        20.0,
    ),
)
ITL = Histogram(
    "fastdecode_inter_token_latency_seconds",
    "Time between two token events of one request",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0),
)
E2E = Histogram(
    "fastdecode_e2e_request_latency_seconds",
    "Time from request arrival to its last message",
    buckets=(0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 300.0),
)
REQUESTS = Counter("fastdecode_requests_total", "Requests finished, by finish reason", ["finish_reason"])
GATEWAY_REQUESTS = Counter(
    "fastdecode_gateway_requests_total",
    "Generation requests the gateway answered; status: OK or the gRPC status code name; api: grpc or http",
    ["status", "api"],
)
IN_FLIGHT = Gauge("fastdecode_gateway_requests_in_flight", "Generation requests in flight at the gateway")
PROMPT_TOKENS = Counter("fastdecode_prompt_tokens_total", "Prompt tokens of accepted requests")
GENERATION_TOKENS = Counter("fastdecode_generation_tokens_total", "Tokens streamed to clients")
# Per tenant (the API key's, --api-keys-file; "" without keys): the label set is bounded by the file
TENANT_REQUESTS = Counter(
    "fastdecode_gateway_tenant_requests_total",
    "Generation requests answered, per tenant",
    ["tenant", "status"],
)
TENANT_TOKENS = Counter(
    "fastdecode_gateway_tenant_tokens_total",
    "Tokens per tenant; kind: prompt or generated",
    ["tenant", "kind"],
)

# The fleet's load, from the scheduler (services/gateway/router_probes.py FleetWatch): the Model
# Server Protocol gauges a router in front of several fleets reads, under our names and under the
# names llm-d's endpoint picker reads by default (vLLM's), so it needs no flags.
FLEET_RUNNING = Gauge("fastdecode_gateway_fleet_requests_running", "Sequences decoding in the fleet")
FLEET_WAITING = Gauge("fastdecode_gateway_fleet_requests_waiting", "Sequences waiting for admission")
FLEET_KV_USAGE = Gauge(
    "fastdecode_gateway_fleet_kv_cache_usage_ratio", "Share of all serving shards' KV capacity in use (0..1)"
)
LORA_LABELS = ["running_lora_adapters", "waiting_lora_adapters", "max_lora"]
FLEET_LORA = Gauge(
    "fastdecode_gateway_lora_requests_info",
    "LoRA adapters of running and waiting requests (labels, comma-separated; none yet); value: update time",
    LORA_LABELS,
)
VLLM_RUNNING = Gauge("vllm:num_requests_running", "Sequences decoding (fastdecode: the whole fleet)")
VLLM_WAITING = Gauge("vllm:num_requests_waiting", "Sequences waiting (fastdecode: the whole fleet)")
VLLM_KV_USAGE = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage, 0..1 (fastdecode: all shards)")
VLLM_GPU_CACHE = Gauge("vllm:gpu_cache_usage_perc", "KV-cache usage, 0..1 (vLLM's older name)")
VLLM_LORA = Gauge("vllm:lora_requests_info", "Running and waiting LoRA adapters", LORA_LABELS)


def export_fleet_load(running: int, waiting: int, kv_usage: float) -> None:
    """Set the fleet's load gauges (our names and vLLM's)."""
    for g, v in (
        (FLEET_RUNNING, running),
        (VLLM_RUNNING, running),
        (FLEET_WAITING, waiting),
        (VLLM_WAITING, waiting),
        (FLEET_KV_USAGE, kv_usage),
        (VLLM_KV_USAGE, kv_usage),
        (VLLM_GPU_CACHE, kv_usage),
    ):
        g.set(v)
    now = time.time()  # vLLM's value: the router reads the newest series
    FLEET_LORA.labels("", "", "0").set(now)  # no adapters: empty lists, as vLLM with none loaded
    VLLM_LORA.labels("", "", "0").set(now)


APIS = ("grpc", "http")


class PrometheusGatewayMetrics(GatewayMetrics):
    def __init__(self) -> None:
        # Every known label combination is exported (as 0) from the first scrape, not after first use:
        # a rate() over a series that appears mid-window misses its first increments.
        for reason in (FINISH_STOP, FINISH_LENGTH, FINISH_ERROR):
            REQUESTS.labels(reason)
        for status in Status:
            for api in APIS:
                GATEWAY_REQUESTS.labels(status.name, api)

    def tenants(self, names: list[str]) -> None:
        """Export every tenant's series from the first scrape (and after a reload)."""
        for tenant in names:
            for status in Status:
                TENANT_REQUESTS.labels(tenant, status.name)
            for kind in ("prompt", "generated"):
                TENANT_TOKENS.labels(tenant, kind)

    def answered(self, status: Status, api: str) -> None:
        GATEWAY_REQUESTS.labels(status.name, api).inc()  # Status names are gRPC's code names
        TENANT_REQUESTS.labels(current_tenant(), status.name).inc()  # the request's, bound by its front

    def in_flight(self, delta: int) -> None:
        IN_FLIGHT.inc(delta)

    def accepted(self, prompt_tokens: int) -> None:
        PROMPT_TOKENS.inc(prompt_tokens)
        TENANT_TOKENS.labels(current_tenant(), "prompt").inc(prompt_tokens)

    def first_token(self, seconds: float) -> None:
        TTFT.observe(seconds)

    def inter_token(self, seconds: float) -> None:
        ITL.observe(seconds)

    def generated(self, tokens: int) -> None:
        GENERATION_TOKENS.inc(tokens)
        TENANT_TOKENS.labels(current_tenant(), "generated").inc(tokens)

    def finished(self, reason: str, seconds: float) -> None:
        REQUESTS.labels(reason).inc()
        E2E.observe(seconds)
