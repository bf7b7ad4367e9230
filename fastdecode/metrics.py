"""Prometheus metrics: names in the style vLLM users know, prefix fastdecode_, on their own port."""

from __future__ import annotations

import logging

from prometheus_client import start_http_server

log = logging.getLogger("fastdecode.metrics")


def start_metrics_server(port: int | None, host: str = "127.0.0.1") -> int | None:
    """Serve /metrics on `port` (0 = any free port); returns the bound port, or None when off."""
    if port is None:
        return None
    server, _ = start_http_server(port, addr=host)
    bound = server.server_port
    log.info("metrics on http://%s:%d/metrics", host, bound)
    return bound
