"""Shared prefix blocks in the KV store: matching, sharing, eviction, copy-on-write, and a property
test that no block with a reader is ever freed or overwritten."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from fastdecode.contract import chain_hashes, prefix_seed
from fastdecode.kv import AttendBatch, KVStore
from fastdecode.kv.prefix import PrefixCache
from fastdecode.runtime.errors import ResourceExhausted
from fastdecode.runtime.geometry import KVGeometry

BS = 4
LAYERS, KVH, HD = 2, 1, 2


def _store(blocks: int, sharing: bool = True, backend: str = "native", **kw) -> KVStore:
    geometry = KVGeometry(LAYERS, KVH, HD)
    probe = KVStore(geometry, 1 << 20, block_size=BS, backend=backend)
    return KVStore(
        geometry, blocks * BS * probe.bytes_per_token, block_size=BS, backend=backend,
        prefix_sharing=sharing, **kw,
    )  # fmt: skip


def _value(tokens: list[int], pos: int, layer: int) -> float:
    """What a real model would store at pos: a function of the tokens up to it (and the layer)."""
    return float(hash((tuple(tokens[: pos + 1]), layer)) % 9973)


def _fill(store: KVStore, sid: str, tokens: list[int], start: int, end: int) -> None:
    for layer in range(LAYERS):
        vals = torch.tensor([_value(tokens, p, layer) for p in range(start, end)])
        kv = vals[:, None, None].expand(end - start, KVH, HD).contiguous()
        store.write(layer, sid, start, kv, -kv)


def _read(store: KVStore, sid: str, layer: int) -> list[float]:
    seq = store.seqs[sid]
    pos = torch.arange(seq.lengths[layer])
    blocks = torch.tensor(seq.blocks, dtype=torch.int64)
    slots = blocks[pos // BS] * BS + pos % BS
    k, v = store.k[layer][0, slots, 0], store.v[layer][0, slots, 0]
    assert torch.equal(k, -v)
    return k.tolist()


def test_chain_hashes_name_full_blocks_by_everything_before_them() -> None:
    seed = prefix_seed("m", "torch.float32", (2, 1, 2), BS)
    a = chain_hashes(seed, list(range(10)), BS)
    assert len(a) == 2  # the partly filled third block has no name
    assert chain_hashes(seed, list(range(8)) + [99], BS) == a
    assert chain_hashes(seed, [1] + list(range(1, 10)), BS)[1] != a[1]  # block 1 depends on block 0
    for other in (
        prefix_seed("n", "torch.float32", (2, 1, 2), BS),
        prefix_seed("m", "torch.int8", (2, 1, 2), BS),
    ):
        assert chain_hashes(other, list(range(10)), BS)[0] != a[0]


def test_a_second_sequence_reads_the_first_ones_prefix_blocks() -> None:
    store = _store(16)
    prompt = list(range(11))  # 2 full blocks + 3
    assert store.reserve("a", 11, prompt) == 0
    _fill(store, "a", prompt, 0, 11)
    assert store.prefix.cached_blocks == 2
    other = prompt[:9] + [50, 51]
    assert store.reserve("b", 11, other) == 8
    a, b = store.seqs["a"], store.seqs["b"]
    assert b.blocks[:2] == a.blocks[:2] and b.blocks[2] != a.blocks[2]
    assert b.lengths == [8, 8]
    _fill(store, "b", other, 8, 11)
    assert _read(store, "b", 1) == [_value(other, p, 1) for p in range(11)]
    assert store.tokens_held == 11 + 3  # the shared 8 count once
    assert store.prefix_stats["shared_bytes"] == 2 * BS * store.bytes_per_token
    # the whole prompt cached still leaves its last token to compute, in a block of its own
    assert store.reserve("c", 8, prompt[:8]) == 4


def test_different_model_or_sharing_off_never_match() -> None:
    store = _store(16)
    store.reserve("a", 9, list(range(9)), model="m1")
    _fill(store, "a", list(range(9)), 0, 9)
    assert store.reserve("b", 9, list(range(9)), model="m2") == 0
    off = _store(16, sharing=False)
    off.reserve("a", 9, list(range(9)))
    _fill(off, "a", list(range(9)), 0, 9)
    assert off.reserve("b", 9, list(range(9))) == 0
    assert off.prefix_stats["cached_blocks"] == 0


def test_idle_prefix_blocks_stay_cached_and_are_evicted_lru_when_room_is_needed() -> None:
    store = _store(6)
    p1, p2 = list(range(9)), list(range(100, 109))
    for sid, p in (("a", p1), ("b", p2)):
        store.reserve(sid, 9, p)
        _fill(store, sid, p, 0, 9)
    store.release("a")
    store.release("b")
    assert store.blocks_free == 6 and store.prefix.cached_blocks == 4
    assert store.reserve("c", 9, p1) == 8  # still cached after its writer left; now p1 is newest
    store.release("c")
    store.reserve("big", 12)  # needs 3 blocks: 2 free + the least recently used idle one (p2's tail)
    assert store.prefix.evictions == 1
    assert store.reserve("d", 9, p2) == 4  # p2's first block survived, its tail did not
    assert store.prefix.evictions == 3  # d's own two blocks: p1's, now the least recently used
    with pytest.raises(ResourceExhausted):
        store.reserve("f", 1)  # the one cached block left is read by d: never evicted
    assert store.seqs["d"].blocks[0] == store.prefix.lookup(
        chain_hashes(prefix_seed("", str(store.dtype), (LAYERS, KVH, HD), BS), p2, BS)[0]
    )


def test_rewriting_a_shared_block_copies_it_first() -> None:
    store = _store(16)
    prompt = list(range(9))
    store.reserve("a", 9, prompt)
    _fill(store, "a", prompt, 0, 9)
    store.reserve("b", 9, prompt)
    _fill(store, "b", prompt, 8, 9)
    shared = store.seqs["a"].blocks[0]
    # b reruns layer 0 from position 0 (an aborted step planned again), here with other values
    # (another batch may round differently): a must still read its own
    vals = torch.full((9, KVH, HD), 5.0)
    store.write(0, "b", 0, vals, -vals)
    assert store.seqs["b"].blocks[0] != shared and store.seqs["a"].blocks[0] == shared
    assert _read(store, "a", 0) == [_value(prompt, p, 0) for p in range(9)]
    assert _read(store, "b", 0) == [5.0] * 9
    assert store.prefix.readers(shared) == 1
    # its last layer rewritten too, b's copy of the block is named like the cached one: b reads that
    _fill(store, "b", prompt, 0, 9)
    assert store.seqs["b"].blocks[0] == shared and store.prefix.readers(shared) == 2


@pytest.mark.parametrize("backend", ["native", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.int8, torch.float8_e4m3fn])
def test_attention_over_shared_blocks_equals_unshared(backend: str, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    layers, kvh, hd, heads = 2, 2, 8, 4
    outs = []
    for sharing in (False, True):
        store = KVStore(
            KVGeometry(layers, kvh, hd), 1 << 20, dtype, BS, backend=backend, prefix_sharing=sharing
        )
        prompt = list(range(13))
        res = []
        for sid in ("a", "b"):  # the same tokens: the same q, k, v at every position
            gen = torch.Generator().manual_seed(1)
            cached = store.reserve(sid, 13, prompt)
            n = 13 - cached
            for layer in range(layers):
                qkv = torch.randn(13, heads + 2 * kvh, hd, generator=gen)
                q, k, v = qkv[cached:, :heads], qkv[cached:, heads : heads + kvh], qkv[cached:, heads + kvh :]
                o = store.attend(layer, AttendBatch([sid], [n], [cached], q, k, v))
                res.append(o[-1])  # the last token's output (what is sampled from)
        outs.append(torch.stack(res))
        if sharing:
            assert store.seqs["b"].frozen == 3
    torch.testing.assert_close(outs[0], outs[1])


class SharingMachine(RuleBasedStateMachine):
    """Random reservations that share prefixes, fills, decodes, reruns and releases on a small
    pool: every live sequence always reads exactly what was written for its own tokens, and no block
    it reads is free or idle (evictable)."""

    PREFIXES = ([1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5])

    def __init__(self) -> None:
        super().__init__()
        self.store = _store(14)
        self.tokens: dict[str, list[int]] = {}
        self.n = 0

    @rule(prefix=st.integers(0, 2), cut=st.integers(1, 12), suffix=st.lists(st.integers(0, 20), max_size=6))
    def admit(self, prefix: int, cut: int, suffix: list[int]) -> None:
        tokens = self.PREFIXES[prefix][:cut] + suffix
        sid = f"s{self.n}"
        self.n += 1
        try:
            cached = self.store.reserve(sid, len(tokens), tokens)
        except ResourceExhausted:
            return
        assert cached % BS == 0 and cached < len(tokens)
        self.tokens[sid] = tokens
        try:
            _fill(self.store, sid, tokens, cached, len(tokens))
        except ResourceExhausted:
            self.store.release(sid)
            del self.tokens[sid]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), tok=st.integers(0, 20))
    def decode(self, data: st.DataObject, tok: int) -> None:
        sid = data.draw(st.sampled_from(sorted(self.tokens)))
        tokens = self.tokens[sid] + [tok]
        try:
            _fill(self.store, sid, tokens, len(tokens) - 1, len(tokens))
        except ResourceExhausted:
            return
        self.tokens[sid] = tokens

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def rerun(self, data: st.DataObject) -> None:
        """An aborted step planned again: the sequence rewrites its own tokens from an earlier spot."""
        sid = data.draw(st.sampled_from(sorted(self.tokens)))
        tokens = self.tokens[sid]
        start = data.draw(st.integers(0, len(tokens) - 1))
        try:
            _fill(self.store, sid, tokens, start, len(tokens))
        except ResourceExhausted:
            pass  # no block to copy a shared one into: the store refused the write

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        sid = data.draw(st.sampled_from(sorted(self.tokens)))
        assert self.store.release(sid)
        del self.tokens[sid]

    @invariant()
    def readers_read_their_own_tokens(self) -> None:
        store = self.store
        free: set[int] = set()
        for start, length in zip(store.alloc._starts, store.alloc._lens, strict=True):
            free.update(range(start, start + length))
        idle = set(store.prefix._idle)
        owned: dict[int, str] = {}
        for sid, tokens in self.tokens.items():
            seq = store.seqs[sid]
            for i, b in enumerate(seq.blocks):
                assert b not in free and b not in idle, f"{sid} reads block {b}, which is free"
                if i < seq.frozen:
                    assert store.prefix.holds(b)
                else:
                    assert owned.setdefault(b, sid) == sid, f"{sid} and {owned[b]} both write block {b}"
            for layer in range(LAYERS):
                assert _read(store, sid, layer) == [_value(tokens, p, layer) for p in range(len(tokens))]
        assert store.blocks_free == len(free) + len(idle)


TestSharingMachine = SharingMachine.TestCase
TestSharingMachine.settings = settings(
    max_examples=60, stateful_step_count=30, deadline=None, suppress_health_check=list(HealthCheck)
)


def test_prefix_cache_refuses_to_forget_a_block_others_read() -> None:
    cache = PrefixCache()
    cache.insert(b"h", 3)
    cache.acquire(3)
    with pytest.raises(ValueError):
        cache.forget(3)
