"""The gateway's Prometheus metrics: GatewayCore reports through GatewayMetrics, this exports it."""

from __future__ import annotations

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
