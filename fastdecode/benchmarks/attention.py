"""One shard's decode attention (KVStore.attend) against the machine's memory bandwidth.

Decode attention reads every cached K and V once per token and does ~2 FLOPs per element, so it
is memory-bound. The yardstick reads a large float32 buffer once per run, summing it with the
same threads as the kernel (the extension's `stream_read`: torch's intra-op pool, AVX2 loads,
chunks taken from a shared counter), interleaved with the attention runs so both see the same
noise. Without the extension (torch backend on an SDK-only install) it falls back to torch.sum
and says so in `memory_probe`. Headline: effective_gbps / memory_gbps.

`positions` > 1 attends that many new positions per sequence (speculative decoding's k+1, causal
among them) and also times one position on the same store, interleaved: `vs_one_position` is the
same-run time ratio (one pass over the KV for all of them costs about one position's time).

`isa` forces the kernel's ISA level for the run (default: what it picked from CPUID) and `path`
says which level attended this dtype (a dtype keeps a level only where it wins). `baseline_isa`
times the same store under a second level interleaved with the first, so `vs_baseline` (its time
over the baseline's) is a same-run ratio. clock="thread" times with the calling thread's CPU time
(one thread only: then the kernel and the yardstick run in that thread), so on a host shared with
other work the time the scheduler gives them is not counted; the memory they contend for still is.
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from fastdecode.benchmarks.common import GIB, gbps, median, memory_probe, time_once
from fastdecode.kv import (
    BACKENDS,
    KV_DTYPES,
    AttendBatch,
    KVStore,
    huge_page_empty,
    huge_page_share,
    kv_bytes_per_element,
)
from fastdecode.kv import native as native_kernel
from fastdecode.kv.memory import mapping_of
from fastdecode.kv.persist import PoolFile
from fastdecode.runtime.errors import InvalidInput
from fastdecode.runtime.geometry import KVGeometry

LENGTHS = ("uniform", "mixed")


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


CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "thread": time.thread_time}


def bandwidth_probe(
    nbytes: int, clock: Callable[[], float] = time.perf_counter
) -> tuple[Callable[[], float], str, int, float | None]:
    """(run -> seconds, name, bytes read per run, share of its buffer on huge pages): the native
    streaming read when built."""
    if not native_kernel.available():
        probe = memory_probe(nbytes)
        return probe, "torch.sum", probe.nbytes, None  # type: ignore[attr-defined]
    kernel = native_kernel.load()
    # On the same kind of memory as the pool (huge pages), written once so its pages are committed.
    x = huge_page_empty((max(1, nbytes // 4),), torch.float32).fill_(1.0)

    def run() -> float:
        return time_once(lambda: kernel.stream_read(x), clock)

    return run, "native stream_read", x.numel() * 4, huge_page_share(x)


def sequence_lengths(kind: str, batch: int, context: int, seed: int) -> list[int]:
    """uniform: every sequence holds `context` tokens; mixed: lengths drawn uniformly from
    [context/16, 2*context - context/16] (64..1984 for 1024), so the mean is about `context`."""
    if kind == "uniform":
        return [context] * batch
    lo = max(2, context // 16)
    rng = random.Random(seed)
    return [rng.randint(lo, max(lo, 2 * context - lo)) for _ in range(batch)]


def run_attention_bench(
    batch: int = 32,
    context: int = 1024,
    heads: int = 12,
    kv_heads: int = 12,
    head_dim: int = 64,
    kv_dtype: str = "float32",
    backend: str = "native",
    lengths: str = "mixed",
    layers: int = 1,
    repeats: int = 11,
    threads: int | None = None,
    memory_bytes: int = GIB,
    seed: int = 0,
    isa: str | None = None,
    baseline_isa: str | None = None,
    clock: str = "wall",
    positions: int = 1,
    kv_dir: str | None = None,
) -> dict[str, object]:
    """Median time of one decode attend per layer over B sequences (the new tokens included).

    Each sequence holds length-1 cached tokens and decodes one more at position length-1 (the same
    slot every repeat, so the length stays fixed); with `positions` = N, N new tokens at positions
    length-N .. length-1 (so both read the same keys). The cache is filled with KVStore.write (not
    timed: the values do not change the cost of a decode step).
    """
    if min(batch, heads, kv_heads, head_dim, layers, repeats, positions) < 1 or context < 2:
        raise InvalidInput(
            "batch, heads, kv_heads, head_dim, layers, repeats, positions >= 1 and context >= 2"
        )
    if heads % kv_heads:
        raise InvalidInput(f"heads ({heads}) must be a multiple of kv_heads ({kv_heads})")
    if kv_dtype not in KV_DTYPES:
        raise InvalidInput(f"kv_dtype must be one of {sorted(KV_DTYPES)}")
    if backend not in BACKENDS:
        raise InvalidInput(f"backend must be one of {list(BACKENDS)}")
    if lengths not in LENGTHS:
        raise InvalidInput(f"lengths must be one of {list(LENGTHS)}")
    if clock not in CLOCKS or (clock == "thread" and threads != 1):
        raise InvalidInput(f"clock must be one of {list(CLOCKS)}; 'thread' needs threads=1")
    tick = CLOCKS[clock]
    if (isa or baseline_isa) and backend != "native":
        raise InvalidInput("isa and baseline_isa apply to the native backend")
    dtype = KV_DTYPES[kv_dtype]
    gen = torch.Generator().manual_seed(seed)
    with torch_threads(threads) as nthreads, kernel_isa(backend, isa) as (chosen, use):
        lens = sequence_lengths(lengths, batch, context, seed)
        if positions > min(lens):
            raise InvalidInput(f"positions ({positions}) exceed the shortest sequence ({min(lens)} tokens)")
        block = 16
        per_token = 2 * layers * kv_heads * head_dim * kv_bytes_per_element(dtype, head_dim)
        capacity = int(sum(-(-n // block) * block for n in lens) * per_token) + (1 << 16)
        geometry = KVGeometry(layers, kv_heads, head_dim)
        store = KVStore(geometry, capacity, dtype=dtype, block_size=block, backend=backend)
        # --kv-dir: the same sequences in a pool mapped from a file there (a persistent shard's),
        # timed interleaved with the anonymous one: vs_anonymous is the same-run ratio
        stores = [store]
        if kv_dir is not None:
            base = Path(kv_dir) / "bench-attention"
            stores.append(KVStore(geometry, capacity, dtype, block, backend=backend, pool_file=base))
        ids = [f"bench-{i}" for i in range(batch)]
        for sid, n in zip(ids, lens, strict=True):
            for s in stores:
                s.reserve(sid, n)
            for layer in range(layers):
                if n > 1:
                    kv = torch.randn(n - 1, kv_heads, head_dim, generator=gen)
                    for s in stores:
                        s.write(layer, sid, 0, kv, kv)
        counts = sorted({1, positions})  # one position is the same-run reference for several

        def make_step(n: int, s: KVStore) -> Callable[[], None]:
            rows = batch * n
            q = torch.randn(rows, heads, head_dim, generator=gen)
            k = torch.randn(rows, kv_heads, head_dim, generator=gen)
            v = torch.randn(rows, kv_heads, head_dim, generator=gen)
            items = AttendBatch(ids, [n] * batch, [length - n for length in lens], q, k, v)

            def step() -> None:
                for layer in range(layers):
                    s.attend(layer, items)

            return step

        steps = {n: make_step(n, store) for n in counts}
        if kv_dir is not None:  # the file's pool, keyed by -n (timed as one more run)
            steps[-positions] = make_step(positions, stores[1])
            counts = [*counts, -positions]
        probe, probe_name, probe_bytes, probe_huge = bandwidth_probe(memory_bytes, tick)
        # (0: the run's level, 1: the baseline's; new positions per sequence), so a level can be
        # its own baseline (the noise floor of a same-run ratio)
        levels = [chosen] + ([baseline_isa] if baseline_isa else [])
        runs = [(i, n) for i in range(len(levels)) for n in counts]
        for _ in range(2):  # warm-up: first touches, thread pool start
            for i, n in runs:
                use(levels[i])
                steps[n]()
            probe()
        times: dict[tuple[int, int], list[float]] = {run: [] for run in runs}
        mem_s = []
        for r in range(repeats):
            # interleaved, the order alternating, so every run sees the same noise
            for i, n in runs if r % 2 == 0 else runs[::-1]:
                use(levels[i])
                times[i, n].append(time_once(steps[n], tick) / layers)
            mem_s.append(probe())
        attn_s, base_s = times[0, positions], times.get((1, positions), [])
        use(chosen)
        kv_bytes = int(sum(lens) * 2 * kv_heads * head_dim * kv_bytes_per_element(dtype, head_dim))
        per_layer = median(attn_s)
        effective = gbps(kv_bytes, per_layer)
        memory = gbps(probe_bytes, median(mem_s))
        return {
            "batch": batch,
            "context": context,
            "lengths": lengths,
            "mean_length": sum(lens) / batch,
            "layers": layers,
            "heads": heads,
            "kv_heads": kv_heads,
            "head_dim": head_dim,
            "kv_dtype": kv_dtype,
            "backend": backend,
            "isa": native_kernel.isa() if backend == "native" else "torch",
            "isa_forced": native_kernel.forced() if backend == "native" else False,
            "path": native_kernel.path(kv_dtype, head_dim) if backend == "native" else "torch",
            "threads": nthreads,
            "clock": clock,
            "repeats": repeats,
            "positions": positions,
            "kv_bytes_per_layer": kv_bytes,
            "attend_ms_per_layer": per_layer * 1e3,
            "attend_ms_min": min(attn_s) * 1e3,
            "effective_gbps": effective,
            "memory_gbps": memory,
            "memory_gbps_min": gbps(probe_bytes, max(mem_s)),
            "memory_gbps_max": gbps(probe_bytes, min(mem_s)),
            "memory_probe": probe_name,
            "memory_bytes": probe_bytes,
            # Both on huge pages when the OS had them (THP): a yardstick on 4 KiB pages read ~35
            # GB/s on Zen 4 against ~55 on huge pages, so a run where only one side got them
            # misreports the ratio.
            "kv_huge_page_share": huge_page_share(store.k),
            "memory_huge_page_share": probe_huge,
            "ratio": effective / memory,
            "target_ratio": 0.8,
            **(
                {
                    "one_position_ms_per_layer": median(times[0, 1]) * 1e3,
                    "vs_one_position": per_layer / median(times[0, 1]),
                }
                if positions > 1
                else {}
            ),
            **(
                baseline_fields(baseline_isa, base_s, per_layer, kv_dtype, head_dim, use, chosen)
                if base_s
                else {}
            ),
            **(persistent_fields(stores[1], times[0, -positions], per_layer) if kv_dir is not None else {}),
        }


def persistent_fields(store: KVStore, times: list[float], per_layer: float) -> dict[str, object]:
    """The pool mapped from a --kv-dir file against the anonymous one (same run, interleaved)."""
    mapping = mapping_of(store.k)
    rss = mapping.get("Rss", 0)
    huge = mapping.get("ShmemPmdMapped", 0) + mapping.get("FilePmdMapped", 0)
    file_ms = median(times)
    assert store.pool is not None
    out = {
        "persistent_pool": str(store.pool.path),
        "persistent_ms_per_layer": file_ms * 1e3,
        "vs_anonymous": file_ms / per_layer,
        "persistent_huge_page_share": huge / rss if rss else None,
    }
    store.close()
    PoolFile.remove_files(store.pool.path)
    return out


def baseline_fields(
    level: str,
    times: list[float],
    per_layer: float,
    kv_dtype: str,
    head_dim: int,
    use: Callable[[str | None], None],
    chosen: str | None,
) -> dict[str, object]:
    use(level)
    path = native_kernel.path(kv_dtype, head_dim)
    use(chosen)
    base = median(times)
    return {
        "baseline_isa": level,
        "baseline_path": path,
        "baseline_ms_per_layer": base * 1e3,
        "vs_baseline": per_layer / base,
    }


@contextlib.contextmanager
def kernel_isa(backend: str, isa: str | None) -> Iterator[tuple[str | None, Callable[[str | None], None]]]:
    """(the level the run uses, a setter) for the native kernel; the level in force before is put
    back on exit. A level the CPU lacks is IsaUnavailable, a clear error. Torch backend: (None, no-op)."""
    if backend != "native":
        yield None, lambda _level: None
        return
    before = native_kernel.isa() if native_kernel.forced() else "auto"

    def use(level: str | None) -> None:
        native_kernel.set_isa(level or before)

    try:
        use(isa)
        yield isa or before, use
    finally:
        native_kernel.set_isa(before)
