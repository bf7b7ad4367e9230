"""Prometheus metrics: names in the style vLLM users know, prefix fastdecode_, on their own port."""

from __future__ import annotations

import logging
import urllib.request

from prometheus_client import start_http_server

log = logging.getLogger("fastdecode.runtime.metrics")


def start_metrics_server(port: int | None, host: str = "127.0.0.1") -> int | None:
    """Serve /metrics on `port` (0 = any free port); returns the bound port, or None when off."""
    if port is None:
        return None
    server, _ = start_http_server(port, addr=host)
    bound = server.server_port
    log.info("metrics on http://%s:%d/metrics", host, bound)
    return bound


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(address: str, timeout: float = 5) -> Samples:
    """A /metrics endpoint's samples (HOST:PORT): (name, sorted labels) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=timeout).read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def metric_total(samples: Samples, name: str, **labels: str) -> float:
    """Sum of the samples named `name` whose labels include `labels`."""
    want = set(labels.items())
    return sum(v for (n, lab), v in samples.items() if n == name and want <= set(lab))
