"""kv_attention's Prometheus metrics: the servicer reports the pool's state and each Attend item here."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from fastdecode.kv import KVStore

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
KV_BYTES_READ = Counter(
    "fastdecode_kv_bytes_read_total", "KV-cache bytes read by attention (keys and values)", ["shard"]
)
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
        self._kv_bytes_read = KV_BYTES_READ.labels(shard)

    def pool(self, s: KVStore | None) -> None:
        """The pool's gauges (`s` None: no pool yet)."""
        if s is None:
            # Visible from the first scrape, before any sequence: an idle shard is empty, not absent.
            # Its pool is sized by the first reservation's geometry; until then the budget is its size.
            for gauge in (KV_USAGE, KV_TOKENS, KV_BYTES_USED, KV_SEQUENCES):
                gauge.labels(self.shard).set(0)
            KV_BYTES_CAPACITY.labels(self.shard).set(self.kv_capacity)
        elif s.capacity_tokens:
            KV_USAGE.labels(self.shard).set(s.tokens_reserved / s.capacity_tokens)
            KV_TOKENS.labels(self.shard).set(s.tokens_held)
            KV_BYTES_USED.labels(self.shard).set(s.bytes_used)
            KV_BYTES_CAPACITY.labels(self.shard).set(s.capacity_bytes)
            KV_SEQUENCES.labels(self.shard).set(len(s.seqs))

    def attended(self, seconds: float, kv_bytes_read: int) -> None:
        self._attention_seconds.observe(seconds)
        self._kv_bytes_read.inc(kv_bytes_read)

    def attend_failed(self, code: str) -> None:
        ATTEND_ERRORS.labels(self.shard, code).inc()
