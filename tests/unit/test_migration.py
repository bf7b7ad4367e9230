"""Live KV migration: the store's export/import, the shard core's chunk stream, the scheduler core's
moves (drain, rebalance, failures) and the driver's RemoveShard, all without a process or a port."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable

import pytest
import torch

from fastdecode.kv import AttendBatch, KVStore
from fastdecode.kv.shard import ShardCore
from fastdecode.runtime.errors import FailedPrecondition, InvalidInput, NotFound, ResourceExhausted
from fastdecode.runtime.geometry import KVGeometry
from fastdecode.runtime.settings import SchedulerSettings
from fastdecode.scheduling import Request, SchedulerCore, ShardSpec
from fastdecode.scheduling.driver import SchedulerDriver
from fastdecode.scheduling.migration import Move
from fastdecode.wire.kv import export_chunks, import_chunks
from tests.support.core_fleet import Fleet
from tests.support.fakes import FakeDense, FakeShard

LAYERS, KVH, HEADS, DIM = 3, 2, 4, 8


def _filled(dtype: torch.dtype, tokens: int, backend: str = "torch") -> tuple[KVStore, list]:
    store = KVStore(KVGeometry(LAYERS, KVH, DIM), 1 << 20, dtype, block_size=4, backend=backend)
    store.reserve("other", 5)  # the sequence does not start at slot 0
    store.reserve("s", tokens)
    g = torch.Generator().manual_seed(0)
    rows = []
    for layer in range(LAYERS):
        k, v = torch.randn(tokens, KVH, DIM, generator=g), torch.randn(tokens, KVH, DIM, generator=g)
        store.write(layer, "s", 0, k, v)
        rows.append((k, v))
    return store, rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8, torch.float8_e4m3fn])
def test_export_import_then_attend_gives_the_same_output(dtype: torch.dtype) -> None:
    src, _ = _filled(dtype, 11)
    dst = KVStore(KVGeometry(LAYERS, KVH, DIM), 1 << 20, dtype, block_size=4, backend="torch")
    dst.reserve("x", 9)  # different slots on the target
    dst.begin_import("s", 11)
    with pytest.raises(FailedPrecondition):  # not held before the last layer
        dst.reserve("s", 1)
    assert "s" not in dst.seqs
    for layer in range(LAYERS):
        dst.import_layer("s", layer, src.export_layer("s", layer))
    assert dst.commit_import("s") == 11
    g = torch.Generator().manual_seed(1)
    for layer in range(LAYERS):
        q = torch.randn(1, HEADS, DIM, generator=g)
        k, v = torch.randn(1, KVH, DIM, generator=g), torch.randn(1, KVH, DIM, generator=g)
        a = src.attend(layer, AttendBatch(["s"], [1], [11], q, k, v))
        b = dst.attend(layer, AttendBatch(["s"], [1], [11], q, k, v))
        assert torch.equal(a, b)


def test_an_unfinished_import_frees_its_blocks_and_a_full_pool_refuses() -> None:
    src, _ = _filled(torch.float32, 10)
    dst = KVStore(KVGeometry(LAYERS, KVH, DIM), 1 << 20, torch.float32, block_size=4, backend="torch")
    free = dst.free_tokens
    dst.begin_import("s", 10)
    dst.import_layer("s", 0, src.export_layer("s", 0))
    with pytest.raises(InvalidInput, match="missing layers"):
        dst.commit_import("s")
    dst.abort_import("s")
    assert dst.free_tokens == free and "s" not in dst.seqs
    with pytest.raises(ResourceExhausted):
        dst.begin_import("big", dst.capacity_tokens + 1)
    dst.begin_import("s", 10)
    with pytest.raises(InvalidInput):  # rows of another dtype are refused, not converted
        k, v, ks, vs = src.export_layer("s", 0)
        dst.import_layer("s", 0, (k.half(), v.half(), ks, vs))


async def _stream(chunks: Iterable) -> AsyncIterator:
    for c in chunks:
        await asyncio.sleep(0)
        yield c


def test_shard_core_chunk_stream_round_trip_and_a_broken_stream() -> None:
    src = ShardCore(1 << 20, torch.bfloat16, 4, backend="torch")
    src.reserve(KVGeometry(LAYERS, KVH, DIM), [("s", 7)])
    for layer in range(LAYERS):
        src.store.write(layer, "s", 0, torch.randn(7, KVH, DIM), torch.randn(7, KVH, DIM))
    dst = ShardCore(1 << 20, torch.bfloat16, 4, backend="torch")
    tokens, nbytes = asyncio.run(import_chunks(dst, _stream(export_chunks(src, "s"))))
    assert tokens == 7 and nbytes == LAYERS * 2 * KVH * 7 * DIM * 2
    for layer in range(LAYERS):
        assert all(
            torch.equal(a, b)
            for a, b in zip(
                src.store.export_layer("s", layer), dst.store.export_layer("s", layer), strict=True
            )
        )
    other = ShardCore(1 << 20, torch.bfloat16, 4, backend="torch")
    cut = list(export_chunks(src, "s"))[:2]  # the header and one layer, then the source died
    with pytest.raises(InvalidInput, match="ended after 1 of 3 layers"):
        asyncio.run(import_chunks(other, _stream(cut)))
    assert other.store is not None and not other.store.seqs and other.store.blocks_in_use == 0
    fp32 = ShardCore(1 << 20, torch.float32, 4, backend="torch")
    with pytest.raises(FailedPrecondition, match="stores"):
        asyncio.run(import_chunks(fp32, _stream(export_chunks(src, "s"))))


# ---- the scheduler core's moves ---------------------------------------------------------------------
def _copy(fleet: Fleet, m: Move) -> None:
    """What ImportSequence does: the target holds the same KV in its own blocks."""
    fleet.kv[m.target][m.seq_id] = list(fleet.kv[m.source][m.seq_id])
    fleet.reserved[m.target][m.seq_id] = -(-m.tokens // fleet.bs[m.target])


def _reference(n: int, shards: int = 3) -> dict[str, list[int]]:
    core = SchedulerCore([ShardSpec(4000, block_size=4) for _ in range(shards)], [0])
    fleet = Fleet(core, shards)
    for i in range(n):
        core.submit(Request(f"r{i}", [1 + i, 2, 3 + i], max_tokens=20 + 3 * i))
    fleet.run()
    return fleet.out


def test_draining_a_shard_moves_every_sequence_with_the_same_tokens() -> None:
    core = SchedulerCore([ShardSpec(4000, block_size=4) for _ in range(3)], [0])
    fleet = Fleet(core, 3)
    for i in range(9):
        core.submit(Request(f"r{i}", [1 + i, 2, 3 + i], max_tokens=20 + 3 * i))
    for _ in range(6):
        fleet.step()
    on0 = core.seqs_on(0)
    assert on0
    core.drain_shard(0)
    moves, waiting = core.drain_moves(limit=2)
    assert len(moves) == 2 and not any(waiting.values())
    fleet.step()  # the moving sequences are not planned while their copy runs
    assert not {p.seq_id for p in fleet.plans[-1].seqs} & {m.seq_id for m in moves}
    for m in moves:
        _copy(fleet, m)
        assert core.end_move(m, ok=True)
    while not core.drained(0):
        for m in core.drain_moves(limit=8)[0]:
            _copy(fleet, m)
            assert core.end_move(m, ok=True)
        fleet.step()
    assert all(p.shard != 0 for p in fleet.plans[-1].seqs)
    core.remove_shard(0)
    fleet.run()
    assert fleet.out == _reference(9)
    assert core.migrations == len(on0) and core.stats().recoveries == 0
    assert core.stats().shards[0].state == "removed"


def test_a_failed_or_overtaken_copy_leaves_the_sequence_on_its_shard() -> None:
    core = SchedulerCore([ShardSpec(4000, block_size=4) for _ in range(3)], [0])
    fleet = Fleet(core, 3)
    for i in range(6):
        core.submit(Request(f"r{i}", [1 + i, 2, 3 + i], max_tokens=20 + 3 * i))
    for _ in range(4):
        fleet.step()
    sid = core.seqs_on(1)[0]
    m = core.begin_move(sid, 2)
    with pytest.raises(FailedPrecondition):  # one copy at a time
        core.begin_move(sid, 0)
    before = core.stats().shards[2].reserved_tokens
    assert not core.end_move(m, ok=False)
    assert core.shard_of(sid) == 1 and core.stats().shards[2].reserved_tokens < before
    # the target dies mid-copy: the move is undone with it
    m = core.begin_move(sid, 2)
    fleet.lose(2)
    assert not core.end_move(m, ok=True) and core.shard_of(sid) == 1
    # the source dies mid-copy: the sequence is re-prefilled elsewhere, the copy is void
    sid0 = core.seqs_on(0)[0]
    m = core.begin_move(sid0, 1)
    fleet.lose(0)
    assert not core.end_move(m, ok=True)
    fleet.run()
    assert fleet.out == _reference(6)


def test_drain_waits_for_room_and_says_so() -> None:
    core = SchedulerCore([ShardSpec(64, block_size=4), ShardSpec(64, block_size=4)], [0], kv_lookahead=0)
    fleet = Fleet(core, 2)
    for i in range(4):
        core.submit(Request(f"r{i}", list(range(1, 21)), max_tokens=8))
    fleet.step()
    core.drain_shard(0)
    moves, waiting = core.drain_moves(limit=4)
    assert not moves and waiting == {0: len(core.seqs_on(0))} and waiting[0] > 0  # shard 1 is full
    fleet.run()  # they finish where they are
    assert core.drained(0)
    with pytest.raises(FailedPrecondition, match="last serving shard"):
        core.drain_shard(1)


def test_rebalance_moves_the_cheapest_sequence_that_restores_balance() -> None:
    core = SchedulerCore([ShardSpec(4000, block_size=4), ShardSpec(4000, block_size=4)], [0])
    fleet = Fleet(core, 2)
    core.drain_shard(1)  # everything lands on shard 0 ...
    for i, n in enumerate([40, 8, 30, 12]):
        core.submit(Request(f"r{i}", list(range(1, n + 1)), max_tokens=50))
    fleet.step()
    core._shards[1].state = ""  # ... then shard 1 serves again: 90 tokens against 0
    m = core.rebalance_move(1.1)
    assert m is not None and m.target == 1
    assert m.seq_id == "r0"  # 40 of 90 brings the busiest to 50 <= 1.1 * 45; 30 would not
    assert core.rebalance_move(1.1) is None  # one move at a time
    _copy(fleet, m)
    assert core.end_move(m, ok=True)
    m = core.rebalance_move(1.1)  # 50 vs 40: 50 > 1.1 * 45 still; the 8 tokens of r1 are enough
    assert m is not None and m.seq_id == "r1"
    _copy(fleet, m)
    assert core.end_move(m, ok=True)
    assert core.rebalance_move(1.1) is None  # 42 vs 48: within the factor


# ---- the driver's RemoveShard ------------------------------------------------------------------------
class _SlowDense(FakeDense):
    async def run(self, step, pipeline):  # type: ignore[no-untyped-def]
        await asyncio.sleep(0.002)  # a step takes time: the requests are still running when drained
        return await super().run(step, pipeline)


def test_remove_shard_migrates_then_takes_the_shard_out() -> None:
    settings = SchedulerSettings(dense="fake:1", shards="fake:2,fake:3", rebalance_factor=0)

    async def main() -> None:
        a, b = FakeShard("fake:2"), FakeShard("fake:3")
        a.peers, b.peers = {"fake:3": b}, {"fake:2": a}
        dense = _SlowDense()
        driver = SchedulerDriver(settings, dense, [a, b])
        await driver.connect()
        loop = asyncio.create_task(driver.step_loop())
        gens = [driver.generate(Request(f"q{i}", [5, 6, 7], max_tokens=300)) for i in range(4)]
        await asyncio.gather(*(anext(g) for g in gens))
        held = set(a.held)
        assert held
        result = await driver.remove_shard(0)
        assert result.migrated == len(held) and result.reprefilled == 0
        assert a.retired and not a.held and held <= set(b.held)
        assert dense.info_.removed_shards == (0,)
        assert all(p.shard == 1 for p in dense.steps[-1].seqs)
        with pytest.raises(NotFound):
            await driver.remove_shard(None, "fake:9")
        await driver.probe_shards()  # it is gone: it stays removed
        assert driver.core.shard_state(0) == "removed"
        a.serving = True  # a restarted pod on its address, empty: it serves again, same index
        await driver.probe_shards()
        assert driver.core.shard_state(0) == "" and driver.shards[0].healthy
        assert dense.info_.removed_shards == ()
        loop.cancel()
        for g in gens:
            await g.aclose()

    asyncio.run(main())


# ---- the simulator models it ---------------------------------------------------------------------------
def test_the_simulator_rebalances_a_skewed_load_and_counts_the_cost() -> None:
    import random

    from fastdecode.planning.sim import SimConfig, WorkItem, simulate

    rng = random.Random(0)
    items = [
        WorkItem(i * 0.02, rng.choice([16, 64, 256, 1024]), rng.choice([32, 128, 512, 1024]))
        for i in range(120)
    ]

    def run(factor: float) -> object:
        cfg = SimConfig(shards=3, max_running=24, admission="naive", rebalance_factor=factor)
        return simulate(items, SimConfig(**{**cfg.__dict__, "migrate_bytes_per_s": 1e10}), seed=0)

    off, on = run(0.0), run(1.1)
    assert off.migrations == 0 and off.migrated_bytes == 0
    assert on.migrations > 0 and on.migration_seconds > 0
    assert on.migrated_bytes == pytest.approx(on.migration_seconds * 1e10)
    assert on.imbalance_max_over_mean < off.imbalance_max_over_mean
    assert on.tokens == off.tokens  # every request still generates all of its tokens


def test_a_moved_sequence_is_released_on_its_source_but_never_listed_as_ended() -> None:
    # gpu_dense drops the token history (penalties, grammars) of the step's `ended` sequences: a
    # migration's release of the source copy must not end a sequence that decodes on.
    core = SchedulerCore([ShardSpec(4000, block_size=4) for _ in range(2)], [0])
    fleet = Fleet(core, 2)
    for i in range(4):
        core.submit(Request(f"r{i}", [1 + i, 2, 3 + i], max_tokens=12))
    for _ in range(3):
        fleet.step()
    core.drain_shard(0)
    moves, _ = core.drain_moves(limit=8)
    assert moves
    for m in moves:
        _copy(fleet, m)
        assert core.end_move(m, ok=True)
    step = fleet.step()
    assert step is not None
    moved = {m.seq_id for m in moves}
    assert moved <= {sid for sid, _ in step.release} and not moved & set(step.ended)
    ended: list[str] = list(step.ended)
    while (step := fleet.step()) is not None:
        ended += step.ended
    assert sorted(ended) == [f"r{i}" for i in range(4)]  # each listed once, when it finished
