"""The scheduler core driving real KV stores and the real dense model in one process: shards that
fill mid-decode preempt and recompute, and every sequence ends with the tokens of a run that never
filled (and of transformers). With prefix sharing on, sequences that start alike read one copy of
their common blocks and prefill only the rest, with the same tokens."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from fastdecode.dense.engine import pack, run_layers
from fastdecode.kv import AttendBatch, KVStore
from fastdecode.model.dense import DenseModel
from fastdecode.runtime.errors import ResourceExhausted
from fastdecode.runtime.geometry import KVGeometry
from fastdecode.scheduling import Request, SchedulerCore, ShardSpec

BLOCK = 4
PROMPTS = [[1, 17, 300, 45], [1, 99, 5], [1, 600, 7, 8, 9], [1, 2], [1, 33, 44, 55], [1, 1500]]
NEW = 28
# 14 common tokens (3 full blocks and a part), then each its own question
SHARED = [1, 17, 300, 45, 9, 81, 1200, 4, 77, 5, 310, 62, 19, 8]
PREFIX_PROMPTS = [SHARED + q for q in ([5, 6], [700], [33, 44, 55, 66, 77], [2], [1500, 3, 3])]


def run(
    model: DenseModel,
    store_blocks: int,
    believed_blocks: int,
    lookahead: int,
    prompts: list[list[int]] = PROMPTS,
    sharing: bool = False,
) -> tuple[dict[str, list[int]], SchedulerCore, int, int]:
    """Greedy-generate PROMPTS on 2 shards of `store_blocks` blocks while the core believes each has
    `believed_blocks`; returns the tokens, the core, the refused chunks and the peak batch."""
    c = model.config
    per_block = BLOCK * c.kv_bytes_per_token(4)
    stores = [
        KVStore(
            KVGeometry(c.num_hidden_layers, c.num_key_value_heads, c.head_dim),
            store_blocks * per_block,
            block_size=BLOCK,
        )
        for _ in range(2)
    ]
    core = SchedulerCore(
        [ShardSpec(believed_blocks * BLOCK, block_size=BLOCK) for _ in range(2)],
        c.eos_token_ids,
        kv_lookahead=lookahead,
        prefix_sharing=sharing,
    )
    for i, p in enumerate(prompts):
        core.submit(Request(f"s{i}", p, NEW))
    out: dict[str, list[int]] = {}
    refused = peak = 0
    for _ in range(2000):
        step = core.next_step()
        if step is None:
            break
        for sid, shard in step.release:
            stores[shard].release(sid)
        refused_reservations = []
        cached: dict[str, int] = {}
        for r in step.reserve:
            try:
                cached[r.seq_id] = stores[r.shard].reserve(r.seq_id, r.max_tokens, r.token_ids or None)
            except ResourceExhausted:  # as the scheduler service does
                core.reservation_failed(r.seq_id)
                refused_reservations.append(r.seq_id)
        step = core.prefix_cached(step.without(refused_reservations), cached)
        peak = max(peak, len(step.seqs))
        results: dict[str, tuple[int, float] | str] = {}
        full: list[str] = []
        for shard, store in enumerate(stores):
            seqs = [p for p in step.seqs if p.shard == shard]
            if not seqs:
                continue
            ids, pos, last = pack(seqs, model.device)  # PlannedSeq has seq_id, token_ids, start_pos

            def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s=seqs, st=store):
                return st.attend(
                    layer,
                    AttendBatch(
                        [p.seq_id for p in s],
                        [len(p.token_ids) for p in s],
                        [p.start_pos for p in s],
                        q,
                        k,
                        v,
                    ),
                )

            try:
                with torch.inference_mode():
                    logits = model.logits(
                        run_layers(model, model.embed(ids), pos, attend).index_select(0, last)
                    )
            except ResourceExhausted:
                full += [p.seq_id for p in seqs]  # the shard kept nothing of this call
                continue
            for p, row in zip(seqs, logits, strict=True):
                if p.sample:
                    results[p.seq_id] = (int(row.argmax()), 0.0)
        if full:
            refused += len(full)
            core.kv_exhausted(step, full)
        for ev in core.apply(step, results):
            assert ev.error is None, ev.error
            out.setdefault(ev.seq_id, []).extend(ev.token_ids)
    assert core.running == core.waiting == 0
    for store in stores:
        assert store.blocks_in_use == 0  # every preempted or finished sequence was released
    return out, core, refused, peak


@pytest.fixture(scope="module")
def model(llama_dir: Path) -> DenseModel:
    return DenseModel.from_pretrained(llama_dir, "cpu", torch.float32)


@pytest.fixture(scope="module")
def roomy(model: DenseModel) -> dict[str, list[int]]:
    out, core, refused, _ = run(model, 200, 200, 64)
    assert core.preemptions == 0 and refused == 0
    return out


def test_roomy_run_equals_transformers(
    roomy: dict[str, list[int]], llama_dir: Path, hf_greedy: Callable
) -> None:
    for i, p in enumerate(PROMPTS):
        assert roomy[f"s{i}"] == hf_greedy(llama_dir, tuple(p), NEW)


def test_shards_filling_mid_decode_preempt_and_recompute_the_same_tokens(
    model: DenseModel, roomy: dict[str, list[int]]
) -> None:
    # 3 sequences of 32 tokens (8 blocks) each would fill a 24-block shard: the core preempts
    out, core, refused, peak = run(model, 20, 20, 4)
    assert core.preemptions > 0 and refused == 0  # the core's block count matches the stores'
    assert peak > 4  # full reservations (8 blocks each) would run 2 per shard
    assert out == roomy


def test_a_shard_that_refuses_a_block_is_handled_like_a_full_one(
    model: DenseModel, roomy: dict[str, list[int]]
) -> None:
    # The core believes in 26 blocks a shard, the stores have 16: the stores refuse blocks mid-decode.
    out, core, refused, _ = run(model, 16, 26, 4)
    assert refused > 0 and core.preemptions > 0
    assert out == roomy


@pytest.fixture(scope="module")
def unshared(model: DenseModel) -> dict[str, list[int]]:
    out, core, _, _ = run(model, 200, 200, 64, PREFIX_PROMPTS, sharing=False)
    assert core.prefix_hits == 0
    return out


def test_shared_prefixes_give_the_tokens_of_an_unshared_run_and_of_transformers(
    model: DenseModel, unshared: dict[str, list[int]], llama_dir: Path, hf_greedy: Callable
) -> None:
    out, core, _, _ = run(model, 200, 200, 64, PREFIX_PROMPTS, sharing=True)
    # the first on each shard computes the 3 common blocks; the others wait for them, then read them
    assert core.prefix_hits >= len(PREFIX_PROMPTS) - 2
    assert core.cached_tokens == 12 * core.prefix_hits
    assert core.decisions["deferred_prefix"] > 0
    assert out == unshared
    for i in (0, 2):
        assert out[f"s{i}"] == hf_greedy(llama_dir, tuple(PREFIX_PROMPTS[i]), NEW)


def test_shared_prefixes_survive_preemption_and_refused_blocks(
    model: DenseModel, unshared: dict[str, list[int]]
) -> None:
    out, core, refused, _ = run(model, 18, 26, 4, PREFIX_PROMPTS, sharing=True)
    assert core.preemptions > 0 and core.prefix_hits > 0
    assert out == unshared
