"""The scheduler's speculation gauge: the k drafting offers rows now, set from each state report."""

from __future__ import annotations

from prometheus_client import REGISTRY

from fastdecode.scheduling.types import SchedulerStats
from services.scheduler.metrics import PrometheusSchedulerMetrics


def _stats(spec_k: int | None) -> SchedulerStats:
    return SchedulerStats(0, 0, 0, 0, 0, 0, "naive", None, 0.0, 1.0, [], spec_k=spec_k)


def test_the_chosen_k_is_exported_when_there_is_one() -> None:
    m = PrometheusSchedulerMetrics()
    m.state(_stats(2), {})
    assert REGISTRY.get_sample_value("fastdecode_spec_chosen_k") == 2
    m.state(_stats(0), {})
    assert REGISTRY.get_sample_value("fastdecode_spec_chosen_k") == 0
    m.state(_stats(None), {})  # no speculation: nothing to say, the gauge keeps its value
    assert REGISTRY.get_sample_value("fastdecode_spec_chosen_k") == 0
