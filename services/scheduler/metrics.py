"""The scheduler's Prometheus metrics: SchedulerDriver reports through SchedulerMetrics, this exports it."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from fastdecode.scheduling import SchedulerStats
from fastdecode.scheduling.ports import SchedulerMetrics

RUNNING = Gauge("fastdecode_num_requests_running", "Sequences decoding")
WAITING = Gauge("fastdecode_num_requests_waiting", "Sequences queued for admission")
KV_LOAD = Gauge("fastdecode_kv_load_tokens", "Total KV tokens held across shards")
SHARD_TOKENS = Gauge("fastdecode_shard_kv_tokens", "KV tokens held per shard", ["shard"])
SHARD_USAGE = Gauge(
    "fastdecode_kv_cache_usage_ratio", "Reserved share of each shard's KV capacity", ["shard"]
)
SHARD_HEALTHY = Gauge("fastdecode_shard_healthy", "1 while the shard takes sequences", ["shard"])
RECOVERIES = Counter("fastdecode_shard_recoveries_total", "Sequences re-prefilled after a shard loss")
RECOVERED_TOKENS = Counter(
    "fastdecode_shard_recovery_tokens_total", "Tokens of history re-prefilled after shard losses"
)
REATTACHED = Counter(
    "fastdecode_shard_reattached_sequences_total",
    "Sequences that resumed on a restarted shard whose KV pool outlived it (--kv-dir)",
)
REATTACH_RECOMPUTED = Counter(
    "fastdecode_shard_reattach_recomputed_positions_total",
    "Positions computed again after a shard re-attached its pool, by kind: torn (an append in flight "
    "when it died) and reprefilled (below what the scheduler had sent: lost KV)",
    ["kind"],
)
SHARD_LOSSES = Counter("fastdecode_shard_losses_total", "Shards detected lost")
PREEMPTIONS = Counter(
    "fastdecode_preemptions_total",
    "Sequences preempted (KV freed, recomputed later) because a shard was full",
)
DENSE_RECONNECTS = Counter(
    "fastdecode_dense_reconnects_total", "Times gpu_dense was lost and the paused requests resumed"
)
ADMISSIONS = Counter(
    "fastdecode_admission_decisions_total",
    "Admission outcomes: sequences admitted or rejected (queue full); steps in which waiting "
    "sequences were deferred by the policy or by shard capacity",
    ["decision"],
)
STEP_SECONDS = Histogram(
    "fastdecode_scheduler_step_seconds",
    "Scheduler step wall time (reservations and the dense run included)",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
)
MIGRATIONS = Counter(
    "fastdecode_migrations_total", "Live KV migrations between shards, by outcome", ["outcome"]
)
MIGRATED_BYTES = Counter("fastdecode_migrated_bytes_total", "KV bytes copied by live migrations")
MIGRATION_SECONDS = Histogram(
    "fastdecode_migration_seconds",
    "Wall time of one live migration (the moving sequence's pause)",
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
)
SPEC_DRAFTS = Counter(
    "fastdecode_spec_draft_tokens",
    "Speculative drafts decode rows carried, and of them those verification kept",
    ["outcome"],
)
SPEC_KEPT_AT = Counter(
    "fastdecode_spec_position_drafts",
    "Per draft position (0 first): drafts offered there, and of them those kept",
    ["position", "outcome"],
)
SPEC_ROWS = Counter("fastdecode_spec_rows", "Decode rows that carried speculative drafts")
SPEC_K = Gauge(
    "fastdecode_spec_chosen_k",
    "Most drafts a decode row is offered now: the k --speculative-k auto chose (a probe at 0 offers "
    "--num-speculative-tokens for a few steps), or --num-speculative-tokens when fixed",
)
SPEC_EMITTED = Counter(
    "fastdecode_spec_emitted_tokens", "Tokens rows with drafts yielded (kept drafts + the target's own)"
)
BATCH_SIZE = Histogram(
    "fastdecode_scheduler_batch_size",
    "Sequences per step",
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024),
)


class PrometheusSchedulerMetrics(SchedulerMetrics):
    def __init__(self) -> None:
        # Exported (as 0) from the first scrape; shards and decisions follow from the driver's first
        # report at start-up.
        for outcome in ("ok", "failed"):
            MIGRATIONS.labels(outcome)
        for outcome in ("proposed", "accepted"):
            SPEC_DRAFTS.labels(outcome)
        self._spec = (0, 0, 0, 0)
        self._spec_at: dict[int, tuple[int, int]] = {}

    def shard_lost(self, recovered_sequences: int, recovered_tokens: int = 0) -> None:
        SHARD_LOSSES.inc()
        RECOVERIES.inc(recovered_sequences)
        RECOVERED_TOKENS.inc(recovered_tokens)

    def shard_reattached(self, resumed: int, reprefilled_tokens: int, torn_positions: int) -> None:
        REATTACHED.inc(resumed)
        REATTACH_RECOMPUTED.labels("torn").inc(torn_positions)
        REATTACH_RECOMPUTED.labels("reprefilled").inc(reprefilled_tokens)

    def preempted(self, sequences: int) -> None:
        PREEMPTIONS.inc(sequences)

    def migrated(self, nbytes: int, seconds: float, ok: bool) -> None:
        MIGRATIONS.labels("ok" if ok else "failed").inc()
        MIGRATED_BYTES.inc(nbytes)
        MIGRATION_SECONDS.observe(seconds)

    def dense_reconnected(self) -> None:
        DENSE_RECONNECTS.inc()

    def step(self, seconds: float, batch: int) -> None:
        STEP_SECONDS.observe(seconds)
        BATCH_SIZE.observe(batch)

    def state(self, stats: SchedulerStats, decisions_delta: dict[str, int]) -> None:
        RUNNING.set(stats.running)
        WAITING.set(stats.waiting)
        KV_LOAD.set(stats.kv_load_tokens)
        for sh in stats.shards:
            SHARD_TOKENS.labels(str(sh.shard)).set(sh.tokens)
            SHARD_HEALTHY.labels(str(sh.shard)).set(1 if sh.healthy else 0)
            if sh.capacity_tokens:
                SHARD_USAGE.labels(str(sh.shard)).set(sh.reserved_tokens / sh.capacity_tokens)
        for decision, count in decisions_delta.items():
            ADMISSIONS.labels(decision).inc(count)
        rows, drafts, kept, emitted = (now - was for now, was in zip(stats.spec, self._spec, strict=True))
        self._spec = stats.spec
        for j, (o, k) in enumerate(zip(*stats.spec_at, strict=True)):
            was_o, was_k = self._spec_at.get(j, (0, 0))
            SPEC_KEPT_AT.labels(str(j), "proposed").inc(o - was_o)
            SPEC_KEPT_AT.labels(str(j), "accepted").inc(k - was_k)
            self._spec_at[j] = (o, k)
        SPEC_ROWS.inc(rows)
        SPEC_DRAFTS.labels("proposed").inc(drafts)
        SPEC_DRAFTS.labels("accepted").inc(kept)
        SPEC_EMITTED.inc(emitted)
        if stats.spec_k is not None:
            SPEC_K.set(stats.spec_k)
