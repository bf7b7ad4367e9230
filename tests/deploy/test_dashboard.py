"""The Grafana dashboard charts only metrics the services really export, and covers each service."""

from __future__ import annotations

import functools
import importlib
import importlib.util
import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.metrics import MetricWrapperBase

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "fastdecode-fleet.json"
SERVICES = ("gateway", "scheduler", "gpu_dense", "kv_attention")
SUFFIXES = {
    "counter": ("_total",),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count"),
    "summary": ("_sum", "_count"),
}


@functools.cache
def exported() -> dict[str, set[str]]:
    """Per service, the sample names of the metrics its modules define (its metrics exporter, or the
    server module where it has none). Importing all four into one process also proves no two
    services define the same name: prometheus_client refuses duplicates."""
    out: dict[str, set[str]] = {}
    for service in SERVICES:
        names = [f"services.{service}.{m}" for m in ("server", "metrics")]
        modules = [importlib.import_module(n) for n in names if importlib.util.find_spec(n) is not None]
        metrics = [v for module in modules for v in vars(module).values() if isinstance(v, MetricWrapperBase)]
        out[service] = {
            f"{m.name}{suffix}"
            for metric in metrics
            for m in metric.describe()
            for suffix in SUFFIXES.get(m.type, ("",))
        }
    return out


def panels(items: list[dict]) -> Iterator[dict]:
    for p in items:
        yield p
        yield from panels(p.get("panels", []))


def expressions() -> list[tuple[str, str]]:
    dash = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in panels(dash["panels"]) for t in p.get("targets", [])]


def test_dashboard_is_grafana_json() -> None:
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] and dash["title"] and dash["schemaVersion"] >= 36
    ids = [p["id"] for p in panels(dash["panels"])]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for p in panels(dash["panels"]):
        if p["type"] != "row":
            assert p["targets"] and p["datasource"]["uid"] == "${datasource}"
            assert {"h", "w", "x", "y"} <= set(p["gridPos"]) and p["gridPos"]["x"] + p["gridPos"]["w"] <= 24


@pytest.mark.parametrize(("title", "expr"), expressions())
def test_every_metric_in_the_panels_exists_in_the_code(title: str, expr: str) -> None:
    known = set().union(*exported().values())
    used = set(re.findall(r"\bfastdecode_[a-z0-9_]+", expr))
    assert used, f"panel {title!r} charts no fastdecode metric"
    missing = used - known
    assert not missing, f"panel {title!r} uses metrics no service exports: {sorted(missing)}"


def test_dashboard_covers_every_service() -> None:
    used = {m for _, e in expressions() for m in re.findall(r"\bfastdecode_[a-z0-9_]+", e)}
    for service, names in exported().items():
        assert used & names, f"no panel charts a {service} metric"
