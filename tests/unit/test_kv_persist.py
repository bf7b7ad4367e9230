"""A KV pool in files that outlive the process (fastdecode/kv/persist.py): re-attached after a
"crash" (the files let go without a clean close) it holds every sequence at its committed position
and attends exactly as a pool that never stopped; appends in flight are marked torn and never read;
a pool of another dtype, block size, geometry or model is discarded; the files are 0600."""

from __future__ import annotations

import logging
import struct
import zlib
from pathlib import Path

import pytest
import torch

from fastdecode.kv import AttendBatch, KVStore
from fastdecode.kv.persist import read_journal
from fastdecode.kv.shard import ShardCore
from fastdecode.runtime.errors import FailedPrecondition, InvalidInput
from fastdecode.runtime.geometry import KVGeometry

G = KVGeometry(2, 2, 16)
WINDOWED = KVGeometry(2, 2, 16, (8, 0))
CAP = 1 << 22


def _data(gen: torch.Generator, n: int) -> list[tuple[torch.Tensor, ...]]:
    return [
        (
            torch.randn(n, 4, 16, generator=gen),
            torch.randn(n, 2, 16, generator=gen),
            torch.randn(n, 2, 16, generator=gen),
        )
        for _ in range(2)
    ]


def _step(
    stores: list[KVStore], ids: list[str], starts: list[int], ns: list[int], gen: torch.Generator
) -> list:
    data = _data(gen, sum(ns))
    outs = []
    for s in stores:
        outs.append([s.attend(layer, AttendBatch(ids, ns, starts, *data[layer])) for layer in range(2)])
    return outs


def _crash(store: KVStore) -> None:
    """What kill -9 leaves: the files as they are, no clean close (the lock let go)."""
    assert store.pool is not None
    store.pool.detach()


@pytest.mark.parametrize("geometry", [G, WINDOWED], ids=["full", "windowed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn], ids=["fp32", "fp8"])
def test_a_reattached_pool_attends_as_one_that_never_stopped(
    tmp_path: Path, geometry: KVGeometry, dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(0)
    base = tmp_path / "shard-0"
    live, ref = KVStore(geometry, CAP, dtype, pool_file=base), KVStore(geometry, CAP, dtype)
    prompts = {"a": list(range(40)), "b": list(range(20)), "c": list(range(33))}
    for s in (live, ref):
        s.reserve_many([(sid, len(p), p) for sid, p in prompts.items()], "m")
    ids = list(prompts)
    _step([live, ref], ids, [0, 0, 0], [40, 20, 33], gen)
    for t in range(20):  # past block boundaries: tables grow, prefixes publish, windows recycle
        _step([live, ref], ids, [40 + t, 20 + t, 33 + t], [1, 1, 1], gen)
    live.release("b")
    ref.release("b")
    live.journal.flush()  # type: ignore[union-attr]  (ShardCore flushes after every call)
    _crash(live)
    back = KVStore(geometry, CAP, dtype, pool_file=base)
    assert back.reattached.positions == {"a": 60, "c": 53}
    assert back.reattached.torn_positions == 0
    assert (
        back.blocks_free == ref.blocks_free
        and back.prefix_stats["cached_blocks"] == ref.prefix_stats["cached_blocks"]
    )
    for t in range(3):
        got, want = _step([back, ref], ["a", "c"], [60 + t, 53 + t], [1, 1], gen)
        assert all(torch.equal(x, y) for x, y in zip(got, want, strict=True))
    # a new sequence with the released one's prompt reads the prefix blocks the pool kept
    assert back.reserve_many([("d", 20, prompts["b"])], "m") == ref.reserve_many(
        [("d", 20, prompts["b"])], "m"
    )


def test_an_append_in_flight_is_torn_and_never_read(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(1)
    base = tmp_path / "shard-0"
    live = KVStore(G, CAP, pool_file=base)
    live.reserve_many([("a", 8), ("b", 8)])
    _step([live], ["a", "b"], [0, 0], [8, 8], gen)
    # a step cut mid-way: layer 0 appended position 8 of both; layer 1 was appending when it died
    q, k, v = _data(gen, 2)[0]
    live.attend(0, AttendBatch(["a", "b"], [1, 1], [8, 8], q, k, v))
    assert live.journal is not None
    live.journal.begin(1, [live.seqs["a"], live.seqs["b"]], [9, 9])
    live.k[1].fill_(float("nan"))  # whatever the cut append left behind
    _crash(live)
    back = KVStore(G, CAP, pool_file=base)
    r = back.reattached
    assert r.positions == {"a": 8, "b": 8} and r.torn_positions == 2 and r.torn_sequences == 2
    assert all(back.seqs[s].lengths == [8, 8] for s in "ab")


def test_a_torn_last_journal_frame_is_ignored(tmp_path: Path) -> None:
    base = tmp_path / "shard-0"
    live = KVStore(G, CAP, pool_file=base)
    live.reserve_many([("a", 8)])
    assert live.journal is not None
    live.journal.flush()
    _crash(live)
    log = base.with_suffix(".log")
    body = b"half a frame"
    log.write_bytes(log.read_bytes() + struct.pack("<II", 100, zlib.crc32(body)) + body)
    state, good = read_journal(log)
    assert list(s.seq_id for s in state.seqs.values()) == ["a"] and good < log.stat().st_size
    back = KVStore(G, CAP, pool_file=base)
    assert list(back.seqs) == ["a"]


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"dtype": torch.bfloat16}, "dtype"),
        ({"block_size": 32}, "block_size"),
        ({"geometry": KVGeometry(2, 2, 32)}, "geometry"),
    ],
)
def test_a_pool_of_another_dtype_block_size_or_geometry_is_discarded(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, change: dict, why: str
) -> None:
    base = tmp_path / "shard-0"
    live = KVStore(G, CAP, pool_file=base)
    live.reserve_many([("a", 8, list(range(8)))], "m")
    _crash(live)
    kw = {"geometry": G, "dtype": torch.float32, "block_size": 16, **change}
    with caplog.at_level(logging.WARNING, "fastdecode.kv_attention"):
        other = KVStore(kw["geometry"], CAP, kw["dtype"], kw["block_size"], pool_file=base)
    assert not other.seqs and other.pool is not None and why in other.pool.discarded
    assert sum("discarded" in r.message for r in caplog.records) == 1


def test_a_pool_of_another_model_is_discarded_by_the_shard(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    base = tmp_path / "shard-0"
    core = ShardCore(CAP, torch.float32, 16, pool_file=base)
    core.reserve(G, [("a", 32, list(range(32)))], "model-a|float32|1111")
    core.fill(["a"], 32, 0)  # every layer written: its two full blocks are cached
    core.release(None)
    assert core.store is not None and core.store.prefix_stats["cached_blocks"] == 2
    core.store.pool.detach()  # type: ignore[union-attr]
    again = ShardCore(CAP, torch.float32, 16, pool_file=base)  # a restart finds it, model unknown yet
    assert again.store is not None and again.store.prefix_stats["cached_blocks"] == 2
    with caplog.at_level(logging.WARNING, "fastdecode.kv_attention"):
        r = again.reattach(G, "model-b|float32|2222", [])
    assert "model" in r.discarded and again.store.prefix_stats["cached_blocks"] == 0
    assert sum("discarded" in rec.message for rec in caplog.records) == 1
    # the same model keeps it: a restart, then the fleet of the same weights
    again.store.pool.detach()  # type: ignore[union-attr]
    third = ShardCore(CAP, torch.float32, 16, pool_file=base)
    assert third.reattach(G, "model-b|float32|2222", []).discarded == ""


def test_reattach_keeps_what_the_scheduler_runs_and_frees_the_rest(tmp_path: Path) -> None:
    base = tmp_path / "shard-0"
    core = ShardCore(CAP, torch.float32, 16, pool_file=base)
    core.reserve(G, [("a", 8), ("b", 8), ("c", 8)], "m")
    core.store.pool.detach()  # type: ignore[union-attr]
    back = ShardCore(CAP, torch.float32, 16, pool_file=base)
    r = back.reattach(G, "m", ["a", "c", "gone"])
    assert r.positions == {"a": 0, "c": 0} and r.released == 1
    with pytest.raises(InvalidInput):  # sequences of one model held: another model's reservation is refused
        back.reserve(G, [("x", 8)], "other")


def test_files_are_private_and_one_process_holds_a_pool(tmp_path: Path) -> None:
    base = tmp_path / "kv" / "shard-0"
    live = KVStore(G, CAP, pool_file=base)
    assert (base.with_suffix(".kv").stat().st_mode & 0o777) == 0o600
    assert (base.with_suffix(".log").stat().st_mode & 0o777) == 0o600
    assert (base.parent.stat().st_mode & 0o777) == 0o700
    with pytest.raises(FailedPrecondition, match="in use by another process"):
        KVStore(G, CAP, pool_file=base)
    live.close()
    KVStore(G, CAP, pool_file=base).close()  # a clean close lets the next one in


def test_an_unclean_pool_from_before_a_reboot_is_discarded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    base = tmp_path / "shard-0"
    live = KVStore(G, CAP, pool_file=base)
    live.reserve_many([("a", 8)])
    _crash(live)
    monkeypatch.setattr("fastdecode.kv.persist.boot_id", lambda: "another-boot")
    back = KVStore(G, CAP, pool_file=base)
    assert not back.seqs and "host restarted" in back.pool.discarded  # type: ignore[union-attr]
    back.reserve_many([("b", 8)])
    back.close()  # closed cleanly: the next boot may keep it
    monkeypatch.setattr("fastdecode.kv.persist.boot_id", lambda: "a third boot")
    assert list(KVStore(G, CAP, pool_file=base).seqs) == ["b"]


def test_a_shard_takes_its_pool_room_before_it_serves(tmp_path: Path) -> None:
    base = tmp_path / "kv" / "shard-0"
    core = ShardCore(CAP, torch.float32, 16, pool_file=base)  # no pool yet: its pages taken now
    kv = base.with_suffix(".kv")
    assert core.store is None and kv.stat().st_blocks * 512 >= CAP
    core.reserve(G, [("a", 8)], "m")  # the first reservation cuts it to the pool's size
    assert core.store is not None and core.store.pool is not None and not core.store.pool.discarded
    assert kv.stat().st_size < CAP + (32 << 20)
