"""kv_attention's Prometheus metrics: the servicer reports the pool's state and each Attend item here."""

from __future__ import annotations

import logging
import weakref

from prometheus_client import Counter, Gauge, Histogram

from fastdecode.kv import KVStore
from fastdecode.runtime.errors import Status
from fastdecode.runtime.logs import Throttle

log = logging.getLogger("fastdecode.kv_attention.metrics")

KV_USAGE = Gauge("fastdecode_kv_usage_ratio", "Reserved share of the shard's KV pool", ["shard"])
KV_TOKENS = Gauge("fastdecode_kv_tokens_held", "Tokens held in the shard's KV-cache", ["shard"])
KV_BYTES_USED = Gauge("fastdecode_kv_bytes_used", "Bytes of the KV pool holding tokens", ["shard"])
KV_BYTES_CAPACITY = Gauge("fastdecode_kv_bytes_capacity", "Bytes of the shard's KV pool", ["shard"])
KV_SEQUENCES = Gauge("fastdecode_kv_sequences", "Sequences with KV on the shard", ["shard"])
ATTENTION_SECONDS = Histogram(
    "fastdecode_kv_attention_seconds",
    "Attention compute time per Attend item (one layer of one mini-batch)",
    ["shard"],
    buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0),
)
ATTENTION_CPU_SECONDS = Counter(
    "fastdecode_kv_attention_cpu_seconds",
    "CPU seconds of attention on the serving thread (wall time on a busy host counts others' turns too)",
    ["shard"],
)
KV_BYTES_READ = Counter(
    "fastdecode_kv_bytes_read_total", "KV-cache bytes read by attention (keys and values)", ["shard"]
)
# Shared prefixes: counts the store keeps (the exporter adds what grew since the last update) and sizes.
PREFIX_QUERIES = Counter(
    "fastdecode_kv_prefix_queries_total", "Reservations that brought token ids for prefix sharing", ["shard"]
)
PREFIX_HITS = Counter(
    "fastdecode_kv_prefix_hits_total", "Reservations that found cached prefix blocks", ["shard"]
)
PREFIX_HIT_TOKENS = Counter(
    "fastdecode_kv_prefix_hit_tokens_total",
    "Prompt tokens found in the prefix cache (not prefilled)",
    ["shard"],
)
PREFIX_EVICTIONS = Counter(
    "fastdecode_kv_prefix_evictions_total", "Idle cached prefix blocks evicted for room", ["shard"]
)
PREFIX_CACHED_BLOCKS = Gauge("fastdecode_kv_prefix_cached_blocks", "KV blocks in the prefix cache", ["shard"])
PREFIX_SHARED_BYTES = Gauge(
    "fastdecode_kv_prefix_shared_bytes", "KV bytes prefix sharing saves now (extra readers)", ["shard"]
)
PREFIX_COUNTERS = {
    "queries": PREFIX_QUERIES,
    "hits": PREFIX_HITS,
    "hit_tokens": PREFIX_HIT_TOKENS,
    "evictions": PREFIX_EVICTIONS,
}
PREFIX_GAUGES = {"cached_blocks": PREFIX_CACHED_BLOCKS, "shared_bytes": PREFIX_SHARED_BYTES}
ATTEND_ERRORS = Counter(
    "fastdecode_kv_attend_errors_total", "Attend items answered with an error", ["shard", "code"]
)


class ShardMetrics:
    """One shard's series (label `shard`)."""

    def __init__(self, shard: str, kv_capacity: int) -> None:
        self.shard = shard
        self.kv_capacity = kv_capacity
        # per-item metrics, resolved once rather than by label on every item
        self._attention_seconds = ATTENTION_SECONDS.labels(shard)
        self._attention_cpu = ATTENTION_CPU_SECONDS.labels(shard)
        self._kv_bytes_read = KV_BYTES_READ.labels(shard)
        self._prefix_counted: dict[str, int] = {}  # store counts already added to PREFIX_COUNTERS
        self._counted_store: weakref.ref[KVStore] | None = None  # the pool those counts came from
        self._throttle = Throttle(60.0)
        for status in Status:  # every item error code exported (as 0) from the first scrape
            if status is not Status.OK:
                ATTEND_ERRORS.labels(shard, status.name)

    def pool(self, s: KVStore | None) -> None:
        """The pool's gauges (`s` None: no pool yet). Called after Reserve, Release and Fill changed
        the state: it never raises, so a metric cannot turn work that was done into an error."""
        try:
            self._pool(s)
        except Exception as e:  # a metric is not worth a request: one line a minute, no traceback
            held = self._throttle("pool")
            if held is not None:
                log.warning("updating the KV gauges failed (%d more held back): %r", held, e)

    def _pool(self, s: KVStore | None) -> None:
        if s is None:
            # Visible from the first scrape, before any sequence: an idle shard is empty, not absent.
            # Its pool is sized by the first reservation's geometry; until then the budget is its size.
            for gauge in (KV_USAGE, KV_TOKENS, KV_BYTES_USED, KV_SEQUENCES, *PREFIX_GAUGES.values()):
                gauge.labels(self.shard).set(0)
            for counter in PREFIX_COUNTERS.values():
                counter.labels(self.shard)  # exported as 0 from the first scrape
            KV_BYTES_CAPACITY.labels(self.shard).set(self.kv_capacity)
        elif s.capacity_tokens:
            KV_USAGE.labels(self.shard).set(s.tokens_reserved / s.capacity_tokens)
            KV_TOKENS.labels(self.shard).set(s.tokens_held)
            KV_BYTES_USED.labels(self.shard).set(s.bytes_used)
            KV_BYTES_CAPACITY.labels(self.shard).set(s.capacity_bytes)
            KV_SEQUENCES.labels(self.shard).set(len(s.seqs))
            prefix = s.prefix_stats
            for name, gauge in PREFIX_GAUGES.items():
                gauge.labels(self.shard).set(prefix[name])
            if self._counted_store is None or self._counted_store() is not s:
                # a new pool (a Reserve of another geometry rebuilds it) counts from 0 again: the
                # exported counters go on from where they were, adding only what it counted since
                self._prefix_counted = {}
                self._counted_store = weakref.ref(s)
            for name, counter in PREFIX_COUNTERS.items():
                now, before = prefix[name], self._prefix_counted.get(name, 0)
                counter.labels(self.shard).inc(now - before if now >= before else now)
                self._prefix_counted[name] = now

    def attended(self, seconds: float, kv_bytes_read: int, cpu_seconds: float = 0.0) -> None:
        self._attention_seconds.observe(seconds)
        self._attention_cpu.inc(cpu_seconds)
        self._kv_bytes_read.inc(kv_bytes_read)

    def attend_failed(self, code: str) -> None:
        ATTEND_ERRORS.labels(self.shard, code).inc()
