"""KV store: allocation, attention against a naive reference, errors."""

from __future__ import annotations

import math
import mmap

import pytest
import torch

from fastdecode.kv import AttendBatch, BlockAllocator, KVStore, huge_page_empty, huge_page_share
from fastdecode.kv.memory import mapping_of
from fastdecode.runtime.errors import FailedPrecondition, InvalidInput, NotFound, ResourceExhausted
from fastdecode.runtime.geometry import KVGeometry


def naive_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int) -> torch.Tensor:
    """q [n, H, D] at positions start.., keys/values [L, KVH, D] -> [n, H*D] (causal)."""
    n, heads, dim = q.shape
    group = heads // keys.shape[1]
    k = keys.repeat_interleave(group, dim=1)
    v = values.repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q.double(), k.double()) / math.sqrt(dim)
    mask = torch.arange(keys.shape[0])[None, :] > torch.arange(start, start + n)[:, None]
    scores = scores.masked_fill(mask[None], float("-inf"))
    return torch.einsum("hnl,lhd->nhd", scores.softmax(-1), v.double()).reshape(n, heads * dim).float()


def make_store(kv_heads: int = 2, tokens: int = 4096, dtype: torch.dtype = torch.float32) -> KVStore:
    itemsize = torch.empty((), dtype=dtype).element_size()
    return KVStore(
        KVGeometry(3, kv_heads, 8), capacity_bytes=tokens * 2 * 3 * kv_heads * 8 * itemsize, dtype=dtype
    )


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (4, 2), (4, 1)])  # MHA, GQA, MQA
def test_chunked_prefill_then_decode_matches_naive(heads: int, kv_heads: int) -> None:
    torch.manual_seed(0)
    store = make_store(kv_heads)
    lens = {"a": 9, "b": 4}
    for sid in lens:
        store.reserve(sid, 32)
    history_k = {s: torch.randn(40, kv_heads, 8) for s in lens}
    history_v = {s: torch.randn(40, kv_heads, 8) for s in lens}
    # step 1: prefill chunks of both (a: 0..5, b: 0..4), step 2: rest of a + decode of b, step 3: decode both
    plan = [[("a", 0, 5), ("b", 0, 4)], [("a", 5, 4), ("b", 4, 1)], [("a", 9, 1), ("b", 5, 1)]]
    for step in plan:
        q = torch.randn(sum(n for _, _, n in step), heads, 8)
        k = torch.cat([history_k[s][p : p + n] for s, p, n in step])
        v = torch.cat([history_v[s][p : p + n] for s, p, n in step])
        for layer in range(3):
            o = store.attend(
                layer,
                AttendBatch([s for s, _, _ in step], [n for *_, n in step], [p for _, p, _ in step], q, k, v),
            )
            row = 0
            for s, p, n in step:
                ref = naive_attention(q[row : row + n], history_k[s][: p + n], history_v[s][: p + n], p)
                torch.testing.assert_close(o[row : row + n], ref, atol=1e-5, rtol=1e-4)
                row += n
    assert store.tokens_held == 10 + 6


def test_fragmented_pool_gives_same_result_as_contiguous() -> None:
    torch.manual_seed(1)
    frag = make_store(tokens=16 * 8)
    for i in range(8):
        frag.reserve(f"f{i}", 16)
    for i in (1, 3, 5):
        frag.release(f"f{i}")  # free blocks 1, 3, 5: no run of 3
    frag.reserve("x", 40)
    assert not frag.seqs["x"].contiguous
    flat = make_store()
    flat.reserve("x", 40)
    assert flat.seqs["x"].contiguous
    q, k, v = torch.randn(40, 2, 8), torch.randn(40, 2, 8), torch.randn(40, 2, 8)
    for store in (frag, flat):
        store.attend(0, AttendBatch(["x"], [30], [0], q[:30], k[:30], v[:30]))
    torch.testing.assert_close(
        frag.attend(0, AttendBatch(["x"], [10], [30], q[30:], k[30:], v[30:])),
        flat.attend(0, AttendBatch(["x"], [10], [30], q[30:], k[30:], v[30:])),
    )


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_kv_is_close(dtype: torch.dtype) -> None:
    torch.manual_seed(2)
    store, ref = make_store(dtype=dtype), make_store()
    q, k, v = torch.randn(12, 4, 8), torch.randn(12, 2, 8), torch.randn(12, 2, 8)
    for s in (store, ref):
        s.reserve("a", 12)
    out = store.attend(0, AttendBatch(["a"], [12], [0], q, k, v))
    assert out.dtype == torch.float32
    torch.testing.assert_close(
        out, ref.attend(0, AttendBatch(["a"], [12], [0], q, k, v)), atol=3e-2, rtol=3e-2
    )
    assert store.bytes_per_token * 2 == ref.bytes_per_token


def test_pool_exhaustion_and_release() -> None:
    store = make_store(tokens=64)
    store.reserve("a", 48)
    with pytest.raises(ResourceExhausted, match="KV pool full"):
        store.reserve("b", 17)
    with pytest.raises(ResourceExhausted):  # all or nothing
        store.reserve_many([("c", 16), ("d", 16)])
    assert "c" not in store.seqs and store.free_tokens == 16
    assert store.release("a") and not store.release("a")
    store.reserve("b", 64)


def test_errors_are_typed() -> None:
    store = make_store()
    store.reserve("a", 4)
    q, k = torch.randn(1, 4, 8), torch.randn(1, 2, 8)
    with pytest.raises(NotFound):
        store.attend(0, AttendBatch(["zz"], [1], [0], q, k, k))
    with pytest.raises(InvalidInput, match="k/v must have shape"):
        store.attend(0, AttendBatch(["a"], [1], [0], q, torch.randn(1, 3, 8), k))
    with pytest.raises(InvalidInput, match="q must have shape"):
        store.attend(0, AttendBatch(["a"], [1], [0], torch.randn(1, 3, 8), k, k))
    with pytest.raises(InvalidInput, match="gap"):
        store.attend(0, AttendBatch(["a"], [1], [2], q, k, k))
    with pytest.raises(InvalidInput, match="layer"):
        store.attend(7, AttendBatch(["a"], [1], [0], q, k, k))
    with pytest.raises(FailedPrecondition):
        store.reserve("a", 4)


def test_allocator_merges_free_runs() -> None:
    alloc = BlockAllocator(10)
    a, b, c = alloc.allocate(3), alloc.allocate(3), alloc.allocate(4)
    assert a == [0, 1, 2] and b == [3, 4, 5] and c == [6, 7, 8, 9] and alloc.free == 0
    alloc.release(a)
    alloc.release(c)
    assert alloc.allocate(5) == [0, 1, 2, 6, 7]  # scattered when no run fits
    alloc.release([0, 1, 2, 6, 7])
    alloc.release(b)
    assert alloc.allocate(10) == list(range(10))


# ------------------------------------------------------------------ blocks on demand


def attend_all(store: KVStore, seq_ids: list[str], start: list[int], n: list[int]) -> torch.Tensor:
    total = sum(n)
    q, kv = torch.randn(total, 4, 8), torch.randn(total, 2, 8)
    return store.attend(0, AttendBatch(seq_ids, n, start, q, kv, kv))


def test_sequences_grow_a_block_at_a_time_and_stats_count_blocks() -> None:
    store = make_store(tokens=16 * 8)
    store.reserve("a", 5)  # admitted with its prompt: one block, not its max_tokens
    store.reserve("b", 20)
    assert (store.blocks_in_use, store.blocks_free) == (3, 5)
    attend_all(store, ["a"], [0], [5])
    assert store.seqs["a"].blocks == [0]
    for pos in range(5, 17):  # decode a into its second block
        attend_all(store, ["a"], [pos], [1])
    # block 1 (right after a's) belongs to b, so a's second block comes from the free pool
    assert store.seqs["a"].blocks == [0, 3] and not store.seqs["a"].contiguous
    assert store.tokens_reserved == 4 * 16 and store.seqs["a"].lengths[0] == 17
    attend_all(store, ["b"], [0], [33])  # a prefill past b's admission grows it in place
    assert store.seqs["b"].blocks == [1, 2, 4] and not store.seqs["b"].contiguous
    store.reserve("c", 1)
    assert store.seqs["c"].blocks == [5]
    attend_all(store, ["c"], [0], [40])
    assert store.seqs["c"].blocks == [5, 6, 7] and store.seqs["c"].contiguous  # extended in place
    assert (store.blocks_in_use, store.blocks_free) == (8, 0)


def test_scattered_growth_attends_like_one_contiguous_run() -> None:
    torch.manual_seed(3)
    grown, flat = make_store(tokens=16 * 8), make_store(tokens=16 * 8)
    grown.reserve("x", 3)
    grown.reserve("y", 3)  # x's next block is taken: x grows into scattered blocks
    flat.reserve("x", 48)
    q, k, v = torch.randn(40, 4, 8), torch.randn(40, 2, 8), torch.randn(40, 2, 8)
    for store in (grown, flat):
        for layer in range(3):
            store.attend(layer, AttendBatch(["x"], [3], [0], q[:3], k[:3], v[:3]))
    outs = []
    for store in (grown, flat):
        got = []
        for pos in range(3, 40):
            for layer in range(3):
                o = store.attend(
                    layer,
                    AttendBatch(["x"], [1], [pos], q[pos : pos + 1], k[pos : pos + 1], v[pos : pos + 1]),
                )
            got.append(o)
        outs.append(torch.cat(got))
    assert not grown.seqs["x"].contiguous and len(grown.seqs["x"].blocks) == 3
    torch.testing.assert_close(outs[0], outs[1])


def test_no_free_block_fails_the_call_and_keeps_nothing() -> None:
    store = make_store(tokens=16 * 4)
    store.reserve("a", 16)
    store.reserve("b", 16)
    store.reserve("c", 16)
    for sid in "abc":
        attend_all(store, [sid], [0], [16])
    attend_all(store, ["a"], [16], [1])  # a takes the last block
    assert store.blocks_free == 0
    before = {s: (list(q.blocks), list(q.lengths)) for s, q in store.seqs.items()}
    with pytest.raises(ResourceExhausted, match="'b'"):  # b needs a 2nd block; c does not
        attend_all(store, ["c", "b"], [15, 16], [1, 1])
    assert {s: (list(q.blocks), list(q.lengths)) for s, q in store.seqs.items()} == before
    assert store.release("c")
    attend_all(store, ["b"], [16], [1])  # a freed block is taken at once
    assert len(store.seqs["b"].blocks) == 2 and store.blocks_free == 0


def test_allocator_extends_a_run_in_place_only_when_the_next_block_is_free() -> None:
    alloc = BlockAllocator(6)
    assert alloc.allocate(2) == [0, 1]
    assert alloc.allocate_after(1) and alloc.free == 3
    assert alloc.allocate(1) == [3]
    assert not alloc.allocate_after(2)  # block 3 is taken
    assert alloc.allocate_after(3) and alloc.allocate_after(4) and alloc.free == 0
    assert not alloc.allocate_after(5)  # past the pool
    alloc.release([2, 3])
    assert alloc.allocate(2) == [2, 3]


def test_a_grown_table_whose_ends_look_like_a_run_is_not_taken_for_one() -> None:
    torch.manual_seed(4)
    store, flat = make_store(tokens=16 * 6), make_store(tokens=16 * 6)
    for sid in ("a", "x", "b", "c", "d"):
        store.reserve(sid, 16)  # blocks 0..4
    flat.reserve("x", 64)
    q, k, v = torch.randn(64, 4, 8), torch.randn(64, 2, 8), torch.randn(64, 2, 8)
    outs: list[list[torch.Tensor]] = [[], []]
    for lo, hi, free in ((0, 16, "c"), (16, 32, "a"), (32, 48, "d"), (48, 64, None)):
        for j, s in enumerate((store, flat)):
            outs[j].append(s.attend(0, AttendBatch(["x"], [hi - lo], [lo], q[lo:hi], k[lo:hi], v[lo:hi])))
        if free:
            store.release(free)
    # x grew into 3 (its next block was b's), then 0, then 4: its ends are 3 apart over 4 blocks
    assert store.seqs["x"].blocks == [1, 3, 0, 4] and not store.seqs["x"].contiguous
    torch.testing.assert_close(torch.cat(outs[0]), torch.cat(outs[1]))


def _thp_mode() -> str | None:
    """The bracketed word of /sys/kernel/mm/transparent_hugepage/enabled (None: no THP here)."""
    try:
        text = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return None
    return text[text.index("[") + 1 : text.index("]")]


def _vm_flags(t: torch.Tensor) -> set[str]:
    """The VmFlags of the /proc/self/smaps mapping that holds t's data ("hg": advised MADV_HUGEPAGE)."""
    addr, inside = t.data_ptr(), False
    with open("/proc/self/smaps") as f:
        for line in f:
            head, _, rest = line.partition(" ")
            if not head.endswith(":"):
                start, _, end = head.partition("-")
                inside = int(start, 16) <= addr < int(end, 16)
            elif inside and head == "VmFlags:":
                return set(rest.split())
    return set()


def test_kv_pools_are_advised_for_huge_pages() -> None:
    """The pools sit on memory advised MADV_HUGEPAGE: the kernel walks each head's rows a block at
    a time, and on 4 KiB pages every block is a TLB miss (bf16 layers took 1.26x as long)."""
    store = KVStore(KVGeometry(2, 4, 64), 16 << 20, dtype=torch.bfloat16)
    assert store.k.shape == (2, 4, store.num_blocks * 16, 64) and store.k.dtype == torch.bfloat16
    assert store.k.is_contiguous() and store.v.data_ptr() != store.k.data_ptr()
    store.reserve("a", 40)
    kv = torch.randn(39, 4, 64)
    store.write(0, "a", 0, kv, kv)  # the memory is usable like torch.empty's
    assert torch.equal(store.k[0, :, :39].float(), kv.to(torch.bfloat16).float().transpose(0, 1))
    mode = _thp_mode()
    if mode is None or mode == "never":
        pytest.skip(f"transparent huge pages are {mode or 'absent'} on this host")
    for pool in (store.k, store.v):
        assert "hg" in _vm_flags(pool), "the pool's mapping is not advised MADV_HUGEPAGE"
        assert mapping_of(pool).get("THPeligible") == 1, "the pool is not eligible for huge pages"
    if mode == "madvise":  # the advice is what makes the difference: a mapping of ours without it
        buf = mmap.mmap(-1, 4 << 20, flags=mmap.MAP_PRIVATE)
        plain = torch.frombuffer(buf, dtype=torch.uint8).fill_(1)
        assert "hg" not in _vm_flags(plain) and mapping_of(plain).get("THPeligible") == 0
    touched = huge_page_empty((8 << 20,), torch.uint8).fill_(1)
    share = huge_page_share(touched)
    assert share is not None and 0.0 <= share <= 1.0


def test_small_tensors_stay_on_torch_empty() -> None:
    x = huge_page_empty((3, 5), torch.float32)
    assert x.shape == (3, 5) and x.dtype == torch.float32
    assert huge_page_empty((0,), torch.float32).numel() == 0
