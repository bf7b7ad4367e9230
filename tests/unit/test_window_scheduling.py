"""The scheduler core counts what a windowed model's sequences really hold: driven against real
KVStores (tiny heads), its block counts never fall below what the store holds,
no chunk is refused for want of a block, and at the same capacity more sequences run at once than
with full attention on every layer."""

from __future__ import annotations

import torch

from fastdecode.kv import AttendBatch, KVStore
from fastdecode.runtime.errors import ResourceExhausted
from fastdecode.runtime.geometry import KVGeometry
from fastdecode.scheduling import Request, SchedulerCore, ShardSpec
from tests.support.core_fleet import EOS, model

KVH, DIM, BS = 1, 8, 4
WINDOWS = (16, 16, 16, 16, 16, 0)


def _run(windows: tuple[int, ...], capacity_bytes: int) -> tuple[int, int]:
    """Runs 16 requests to the end; returns (peak running sequences, chunks refused)."""
    layers = len(windows)
    geo = KVGeometry(layers, KVH, DIM, windows)
    store = KVStore(geo, capacity_bytes, torch.float32, BS, backend="native")
    core = SchedulerCore(
        [ShardSpec(store.capacity_tokens, block_size=BS)], [EOS], kv_geometry=geo, prefill_token_budget=64
    )
    for i in range(16):
        core.submit(Request(f"r{i}", [1 + i, 2, 3, 4, 5, 6, 7, 8, 9, 10], max_tokens=60))
    kv: dict[str, list[int]] = {}
    gen = torch.Generator().manual_seed(0)
    peak = refused = 0
    for _ in range(5000):
        st = core.next_step()
        if st is None:
            break
        for sid, _shard in st.release:
            store.release(sid)
            kv.pop(sid, None)
        store.reserve_many([(r.seq_id, r.max_tokens) for r in st.reserve])
        for r in st.reserve:
            kv[r.seq_id] = []
        results: dict = {}
        short = []
        for p in st.seqs:
            n = len(p.token_ids)
            q = torch.randn(n, 2 * KVH, DIM, generator=gen)
            k = torch.randn(n, KVH, DIM, generator=gen)
            try:
                for layer in range(layers):
                    store.attend(layer, AttendBatch([p.seq_id], [n], [p.start_pos], q, k, k))
            except ResourceExhausted:
                short.append(p.seq_id)
                continue
            del kv[p.seq_id][p.start_pos :]
            kv[p.seq_id].extend(p.token_ids)
            if p.sample:
                results[p.seq_id] = (model(kv[p.seq_id], p.sample_index) % (EOS - 1) + 1, -0.5)
        # what the core counts covers what the store holds (a model-wide block: one per group)
        counted = core.stats().shards[0].reserved_tokens
        assert counted >= store.blocks_in_use * BS / store.num_groups - BS
        peak = max(peak, sum(1 for p in st.seqs if p.seq_id not in short))
        if short:
            refused += len(short)
            core.kv_exhausted(st, short)
        core.apply(st, results)
    else:
        raise AssertionError("did not finish")
    assert not store.seqs
    return peak, refused


def test_windowed_model_runs_more_sequences_at_the_same_capacity() -> None:
    capacity = 2 * len(WINDOWS) * KVH * DIM * 4 * 280  # 280 tokens of full attention
    full_peak, full_refused = _run((0,) * len(WINDOWS), capacity)
    win_peak, win_refused = _run(WINDOWS, capacity)
    assert (full_refused, win_refused) == (0, 0)
    assert win_peak >= 2 * full_peak, (win_peak, full_peak)
