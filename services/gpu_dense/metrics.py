"""gpu_dense's Prometheus metrics: the servicer reports each step's outcome and timings here."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from fastdecode.dense import Timings

_SECONDS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
STEP_SECONDS = Histogram("fastdecode_dense_step_seconds", "Wall time of one dense step", buckets=_SECONDS)
S_PART_SECONDS = Histogram(
    "fastdecode_dense_s_part_seconds", "S-part compute time per step (both mini-batches)", buckets=_SECONDS
)
SHARD_WAIT_SECONDS = Histogram(
    "fastdecode_dense_shard_wait_seconds",
    "Time per step the dense half spent waiting on the shards (not hidden by S-part work)",
    buckets=_SECONDS,
)
OVERLAP_RATIO = Histogram(
    "fastdecode_dense_pipeline_overlap_ratio",
    "Per step, the share of the shorter half (S-part or attention) hidden behind the other",
    buckets=(0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0),
)
STEPS = Counter(
    "fastdecode_dense_steps_total",
    "Dense steps, by mode: piped (two mini-batches) or plain (what --pipeline auto chose shows here)",
    ["mode"],
)
STEP_SEQUENCES = Counter(
    "fastdecode_dense_sequences_total",
    "Sequences computed in plans (of one decode step or several), by outcome",
    ["outcome"],
)
HEAD_CPU_SECONDS = Counter(
    "fastdecode_dense_head_cpu_seconds",
    "CPU seconds of the process while the LM head and sampling ran (on an emulated device: the host "
    "standing in for the device's sampling)",
)
ROUND_TRIPS = Counter(
    "fastdecode_dense_attend_items",
    "Attend items (one shard's share of one layer of one mini-batch) the steps sent, counted at "
    "each step's end with its steps_total",
)
DEVICE_SECONDS = Gauge(
    "fastdecode_dense_emulated_device_seconds",
    "An emulated device's busy seconds so far, by engine (compute, copy)",
    ["engine"],
)

# Exported (as 0) from the first scrape, not after the first step.
for _mode in ("piped", "plain"):
    STEPS.labels(_mode)
for _outcome in ("ok", "error"):
    STEP_SEQUENCES.labels(_outcome)


def plan_done(ok: int, failed: int) -> None:
    """One plan that ran (one or several decode steps): its sequences by outcome."""
    STEP_SEQUENCES.labels("ok").inc(ok)
    STEP_SEQUENCES.labels("error").inc(failed)


def step_done(t: Timings) -> None:
    """One decode step that ran (a plan runs several with the scheduler's --decode-steps): its timings."""
    STEPS.labels("piped" if t.pipelined else "plain").inc()
    STEP_SECONDS.observe(t.step_seconds)
    S_PART_SECONDS.observe(t.s_part_seconds)
    SHARD_WAIT_SECONDS.observe(t.shard_wait_seconds)
    HEAD_CPU_SECONDS.inc(t.head_cpu_seconds)
    ROUND_TRIPS.inc(t.round_trips)
    OVERLAP_RATIO.observe(t.overlap_ratio)  # 0 with the pipeline off: nothing overlaps


def device_time(compute: float, copy: float) -> None:
    DEVICE_SECONDS.labels("compute").set(compute)
    DEVICE_SECONDS.labels("copy").set(copy)
