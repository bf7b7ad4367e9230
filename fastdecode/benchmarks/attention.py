"""One shard's decode attention (KVStore.attend) against the machine's memory bandwidth.

Decode attention reads every cached K and V once per token and does ~2 FLOPs per element,
so it is memory-bound: the yardstick is a plain torch.sum over a large fp32 tensor, measured
interleaved with the attention runs (same noise). Headline: effective_gbps / memory_gbps.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from fastdecode.benchmarks.common import GIB, gbps, median, memory_probe, time_once
from fastdecode.codec import DTYPE_NAMES
from fastdecode.errors import InvalidInput
from fastdecode.kv import KVStore


@contextlib.contextmanager
def torch_threads(n: int | None) -> Iterator[int]:
    """Run with n torch intra-op threads (None: leave as is); yields the count in effect."""
    before = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


def run_attention_bench(
    batch: int = 32,
    context: int = 1024,
    heads: int = 12,
    kv_heads: int = 12,
    head_dim: int = 64,
    kv_dtype: str = "float32",
    layers: int = 1,
    repeats: int = 11,
    ragged: bool = False,
    threads: int | None = None,
    memory_bytes: int = GIB,
    seed: int = 0,
) -> dict[str, object]:
    """Median time of one decode attend per layer over B sequences holding `context` tokens each.

    `context` counts the new token: each sequence holds context-1 cached tokens and decodes one
    more at position context-1 (the same slot every repeat, so the length stays fixed).
    With `ragged`, sequence i holds context - (i % 16) tokens, which defeats the store's batched
    equal-length decode path and measures the per-sequence loop instead.
    """
    if min(batch, heads, kv_heads, head_dim, layers, repeats) < 1 or context < 2:
        raise InvalidInput("batch, heads, kv_heads, head_dim, layers, repeats >= 1 and context >= 2")
    if heads % kv_heads:
        raise InvalidInput(f"heads ({heads}) must be a multiple of kv_heads ({kv_heads})")
    if kv_dtype not in DTYPE_NAMES:
        raise InvalidInput(f"kv_dtype must be one of {sorted(DTYPE_NAMES)}")
    if ragged and context <= 16:
        raise InvalidInput("ragged needs context > 16")
    dtype = DTYPE_NAMES[kv_dtype]
    gen = torch.Generator().manual_seed(seed)
    with torch_threads(threads) as nthreads:
        itemsize = torch.empty((), dtype=dtype).element_size()
        lengths = [context - (i % 16 if ragged else 0) for i in range(batch)]
        block = 16
        per_seq = -(-context // block) * block
        store = KVStore(
            layers,
            kv_heads,
            head_dim,
            capacity_bytes=batch * per_seq * 2 * layers * kv_heads * head_dim * itemsize,
            dtype=dtype,
            block_size=block,
        )
        ids = [f"bench-{i}" for i in range(batch)]
        for sid in ids:
            store.reserve(sid, context)
        # Fill the cache (not timed): the values do not change the cost of a decode step.
        for sid, n in zip(ids, lengths, strict=True):
            q = torch.randn(n - 1, heads, head_dim, generator=gen)
            kv = torch.randn(n - 1, kv_heads, head_dim, generator=gen)
            for layer in range(layers):
                store.attend(layer, [sid], [n - 1], [0], q, kv, kv)
        q = torch.randn(batch, heads, head_dim, generator=gen)
        k = torch.randn(batch, kv_heads, head_dim, generator=gen)
        v = torch.randn(batch, kv_heads, head_dim, generator=gen)
        ones, starts = [1] * batch, [n - 1 for n in lengths]

        def step() -> None:
            for layer in range(layers):
                store.attend(layer, ids, ones, starts, q, k, v)

        probe = memory_probe(memory_bytes)
        for _ in range(2):  # warm-up: first touches, thread pool start
            step()
        probe()
        attn_s, mem_s = [], []
        for _ in range(repeats):
            attn_s.append(time_once(step) / layers)
            mem_s.append(probe())
        kv_bytes = sum(lengths) * 2 * kv_heads * head_dim * itemsize  # per layer
        per_layer = median(attn_s)
        effective = gbps(kv_bytes, per_layer)
        memory = gbps(probe.nbytes, median(mem_s))  # type: ignore[attr-defined]
        return {
            "batch": batch,
            "context": context,
            "layers": layers,
            "heads": heads,
            "kv_heads": kv_heads,
            "head_dim": head_dim,
            "kv_dtype": kv_dtype,
            "ragged": ragged,
            "threads": nthreads,
            "repeats": repeats,
            "kv_bytes_per_layer": kv_bytes,
            "attend_ms_per_layer": per_layer * 1e3,
            "attend_ms_min": min(attn_s) * 1e3,
            "effective_gbps": effective,
            "memory_gbps": memory,
            "memory_bytes": probe.nbytes,  # type: ignore[attr-defined]
            "ratio": effective / memory,
            "target_ratio": 0.6,
        }
