"""Windowed layers held as windows: a windowed layer group gives its blocks back once its window has
passed them, every query still sees exactly its window (against fp64 over the whole history), and
what a sequence holds, what it exports on migration and what a fill writes count only the window."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Iterable

import pytest
import torch

from fastdecode.kv import AttendBatch, KVStore
from fastdecode.kv.shard import ShardCore
from fastdecode.runtime.errors import FailedPrecondition
from fastdecode.runtime.geometry import KVGeometry
from fastdecode.wire.kv import export_chunks, import_chunks
from tests.unit.test_kv_window import reference

KVH, HEADS, DIM, BS = 2, 4, 16, 4
GEMMA = (8, 8, 8, 8, 8, 0)  # five windowed layers to one global, as Gemma 3


def _store(backend: str, windows: tuple[int, ...] = GEMMA, dtype: torch.dtype = torch.float32) -> KVStore:
    return KVStore(KVGeometry(len(windows), KVH, DIM, windows), 1 << 22, dtype, BS, backend=backend)


def test_groups_share_one_allocator_and_count_tokens_on_every_layer() -> None:
    s = _store("native")
    assert (s.group_size, s.num_groups, s.group_windows) == (1, 6, [8, 8, 8, 8, 8, 0])
    assert s.prefix is None  # windowed: no prefix sharing
    two = _store("native", (0, 0, 5, 5, 5, 5))  # gcd(2, 4) = 2 layers a group
    assert (two.group_size, two.num_groups, two.group_windows) == (2, 3, [0, 5, 5])
    plain = KVStore(KVGeometry(6, KVH, DIM), 1 << 22, torch.float32, BS)
    assert abs(plain.capacity_tokens - s.capacity_tokens) <= BS  # same bytes, same tokens (to a block)
    s.reserve("a", 10)
    assert s.tokens_held == 0 and s.free_tokens == s.capacity_tokens - 12  # 3 blocks in each of 6 groups


@pytest.mark.parametrize("backend", ["native", "torch"])
def test_decode_past_the_window_gives_blocks_back_and_sees_its_window(backend: str) -> None:
    store = _store(backend)
    gen = torch.Generator().manual_seed(0)
    total = 70
    hist = [
        (torch.randn(total, KVH, DIM, generator=gen), torch.randn(total, KVH, DIM, generator=gen))
        for _ in GEMMA
    ]
    store.reserve("s", 13)
    store.reserve("other", 5)
    pos, chunks = 0, [13, 9, 1, 1, 6] + [1] * 40
    for n in chunks:
        for layer, w in enumerate(GEMMA):
            q = torch.randn(n, HEADS, DIM, generator=gen)
            k, v = hist[layer][0][pos : pos + n], hist[layer][1][pos : pos + n]
            o = store.attend(layer, AttendBatch(["s"], [n], [pos], q, k, v))
            want = reference(q, hist[layer][0][: pos + n], hist[layer][1][: pos + n], pos, w, 0.0)
            torch.testing.assert_close(o.double(), want, atol=1e-4, rtol=1e-4)
        pos += n
    seq = store.seqs["s"]
    geo = KVGeometry(6, KVH, DIM, GEMMA)
    # windowed groups hold the blocks from the one of position pos - 8 + 1 (seen last) on
    assert seq.dead[:5] == [(pos - 1 - 8 + 1) // BS] * 5 and seq.dead[5] == 0
    held = store.tokens_held - store.held_of(store.seqs["other"])
    assert held == pytest.approx(geo.held_tokens(pos - 1, BS), abs=1)
    assert held < 0.35 * pos
    free = store.free_tokens
    store.release("s")
    assert store.free_tokens > free
    # a rerun below the window's blocks is refused with a clear error, not a kernel failure
    store.reserve("t", 40)
    q, kv = torch.randn(40, HEADS, DIM), torch.randn(40, KVH, DIM)
    store.attend(0, AttendBatch(["t"], [40], [0], q, kv, kv))
    store.attend(0, AttendBatch(["t"], [1], [40], q[:1], kv[:1], kv[:1]))
    with pytest.raises(FailedPrecondition, match="window"):
        store.attend(0, AttendBatch(["t"], [1], [10], q[:1], kv[:1], kv[:1]))


def test_more_sequences_fit_at_the_same_capacity() -> None:
    """At one byte budget, sequences of 64 tokens each: the windowed store fills up later."""
    cap = 6 * 2 * KVH * DIM * 4 * 640  # 640 tokens of full attention
    counts = []
    for windows in ((0,) * 6, GEMMA):
        store = KVStore(KVGeometry(6, KVH, DIM, windows), cap, torch.float32, BS)
        n = 0
        while store.free_tokens >= 64:
            store.reserve(f"s{n}", 1)
            store.fill_synthetic([f"s{n}"], 64)
            n += 1
        counts.append(n)
    assert counts[0] == 10 and counts[1] >= 3 * counts[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_migration_sends_the_window_and_the_copy_attends_the_same(dtype: torch.dtype) -> None:
    src, dst = ShardCore(1 << 22, dtype, BS), ShardCore(1 << 22, dtype, BS)
    geometry = KVGeometry(6, KVH, DIM, GEMMA, 30.0)
    src.reserve(geometry, [("s", 30)])
    gen = torch.Generator().manual_seed(2)
    for pos, n in ((0, 30), (30, 1), (31, 1)):
        for layer in range(6):
            q = torch.randn(n, HEADS, DIM, generator=gen)
            kv = torch.randn(n, KVH, DIM, generator=gen)
            src.attend(layer, AttendBatch(["s"], [n], [pos], q, kv, kv))
    chunks = list(export_chunks(src, "s"))
    assert chunks[0].geometry.layer_windows == list(GEMMA) and chunks[0].geometry.attn_logit_softcap == 30.0
    assert [c.first_token for c in chunks[1:]] == [24] * 5 + [0]  # window layers send their blocks only

    async def stream(items: Iterable) -> AsyncIterator:
        for c in items:
            yield c

    tokens, _ = asyncio.run(import_chunks(dst, stream(chunks)))
    assert tokens == 32
    assert dst.store is not None and dst.store.softcap == 30.0
    assert dst.store.seqs["s"].dead == [6] * 5 + [0]  # the next query (32) sees 25.. : blocks 6..
    for layer in range(6):
        q = torch.randn(1, HEADS, DIM, generator=gen)
        kv = torch.randn(1, KVH, DIM, generator=gen)
        a = src.attend(layer, AttendBatch(["s"], [1], [32], q, kv, kv)).o
        b = dst.attend(layer, AttendBatch(["s"], [1], [32], q, kv, kv)).o
        assert torch.equal(a, b)


def test_held_tokens_of_a_gemma3_shape_at_4096() -> None:
    """Window 512, five local layers to one global, context 4096: about 0.29x of full attention."""
    geo = KVGeometry(18, 1, 256, (512, 512, 512, 512, 512, 0) * 3)
    ratio = geo.held_tokens(4096, 16) / 4096
    assert ratio <= 0.3
    assert ratio == pytest.approx((1 + 5 * 512 / 4096) / 6, abs=0.01)
    assert math.isclose(KVGeometry(18, 1, 256).held_tokens(4096, 16), 4096)


@pytest.mark.parametrize("backend", ["native", "torch"])
def test_prefix_sharing_reads_the_window_a_finished_prefix_left_cached(backend: str) -> None:
    """One group cache per layer group: a second sequence with the same prompt finds the full layers'
    blocks and the windowed layers' last window still cached (let go by the first, idle, not
    evicted), computes only the rest, and every query still sees exactly its window."""
    store = KVStore(KVGeometry(6, KVH, DIM, GEMMA), 1 << 22, torch.float32, BS, backend=backend)
    gen = torch.Generator().manual_seed(5)
    emb = torch.randn(6, 64, 2, KVH, DIM, generator=gen)  # per layer: k, v of a token ...
    pos_emb = torch.randn(6, 128, 2, KVH, DIM, generator=gen)  # ... plus its position's

    def kv(layer: int, ids: list[int], start: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = emb[layer, ids] + pos_emb[layer, start : start + len(ids)]
        return x[:, 0], x[:, 1]

    def run(sid: str, ids: list[int], start: int, chunk: int) -> None:
        for p0 in range(start, len(ids), chunk):
            part = ids[p0 : p0 + chunk]
            for layer, w in enumerate(GEMMA):
                q = torch.randn(len(part), HEADS, DIM, generator=gen)
                k, v = kv(layer, part, p0)
                o = store.attend(layer, AttendBatch([sid], [len(part)], [p0], q, k, v))
                hk, hv = kv(layer, ids[: p0 + len(part)], 0)
                want = reference(q, hk, hv, p0, w, 0.0)
                torch.testing.assert_close(o.double(), want, atol=1e-4, rtol=1e-4)

    prompt = [(7 * i) % 64 for i in range(30)]
    assert store.reserve("a", 30, prompt) == 0
    run("a", prompt + [1] * 10, 0, 6)  # prefill in chunks, then 10 decode-sized steps
    a = store.seqs["a"]
    assert a.dead[:5] == [(36 - 8 + 1) // BS] * 5  # its last chunk (36..) sees 29 on: blocks 0..6 let go
    held = store.blocks_in_use
    b_ids = prompt + [3, 4, 5, 6, 9]
    cached = store.reserve("b", len(b_ids), b_ids)
    assert cached == 28  # 7 full blocks of the 30-token prompt; blocks 5, 6 of every window still cached
    b = store.seqs["b"]
    assert b.dead[:5] == [(28 - 8 + 1) // BS] * 5 and b.blocks[:5] == [-1] * 5
    # b's own blocks (28..35) in every group, and the windowed groups' blocks 5, 6, idle until now;
    # the full group's blocks 0..6 are a's, read
    assert store.blocks_in_use - held == 6 * 2 + 5 * 2
    run("b", b_ids + [2] * 6, 28, 5)
    store.release("a")
    store.release("b")
    assert store.blocks_in_use == 0 and store.prefix_stats["hits"] == 1
