"""The prefix registry's listener (fastdecode/scheduling/prefixes.py `PrefixListener`, what
`--kv-events` publishes): blocks announced once their shard holds them, evictions from the registry
and a lost shard's blocks announced removed, blocks still being computed never announced."""

from __future__ import annotations

from fastdecode.scheduling import Request, SchedulerCore, ShardSpec
from fastdecode.scheduling.prefixes import StoredBlocks

BS = 4


class Recorder:
    def __init__(self) -> None:
        self.stores: list[tuple[int, list[bytes], list[list[int]], str]] = []
        self.removals: list[tuple[int, list[bytes]]] = []

    def stored_blocks(self) -> list[bytes]:
        return [n for _, names, _, _ in self.stores for n in names]

    def stored(self, blocks: StoredBlocks) -> None:
        bs = blocks.block_size
        names = [blocks.names[i] for i in blocks.blocks]
        tokens = [list(blocks.tokens[i * bs : (i + 1) * bs]) for i in blocks.blocks]
        self.stores.append((blocks.shard, names, tokens, blocks.salt))

    def removed(self, shard: int, names: list[bytes]) -> None:
        self.removals.append((shard, list(names)))


def _core(capacity: int = 1000, shards: int = 2) -> tuple[SchedulerCore, Recorder]:
    core = SchedulerCore(
        [ShardSpec(capacity, block_size=BS) for _ in range(shards)], [0], prefix_sharing=True, kv_lookahead=0
    )
    rec = Recorder()
    core.prefixes.listener = rec
    return core, rec


def _run(core: SchedulerCore, *requests: Request) -> None:
    """Submit, prefill (nothing cached) and finish: one token each."""
    for r in requests:
        core.submit(r)
    step = core.next_step()
    assert step is not None
    step = core.prefix_cached(step, {})
    core.apply(step, {p.seq_id: (50, 0.0) for p in step.seqs if p.sample})


def test_blocks_are_announced_when_held_and_removed_with_their_shard() -> None:
    core, rec = _core()
    prompt = list(range(1, 14))  # 3 full blocks and a token
    core.submit(Request("a", prompt, 4, cache_salt="s"))
    step = core.next_step()
    assert step is not None and rec.stores == []  # placed: computing, not held yet
    core.apply(core.prefix_cached(step, {}), {"a": (50, 0.0)})
    shard = core.shard_of("a")
    assert shard is not None
    [(at, names, tokens, salt)] = rec.stores
    assert at == shard and len(names) == 3 and salt == "s"
    assert tokens == [prompt[0:4], prompt[4:8], prompt[8:12]]
    core.shard_lost(shard)
    assert rec.removals == [(shard, names)]


def test_registry_evictions_are_announced_and_pending_blocks_are_not() -> None:
    core, rec = _core(capacity=32, shards=1)  # the registry keeps 8 blocks a shard
    first = list(range(100, 121))  # 5 full blocks
    _run(core, Request("a", first, 1))
    assert len(rec.stored_blocks()) == 5
    _run(core, Request("b", list(range(200, 221)), 1))
    # b's 5 claimed blocks pushed a's 2 oldest out of the registry: removed; b's own announced
    [(_, gone)] = rec.removals
    assert gone == rec.stores[0][1][:2]
    assert len(rec.stores) == 2 and len(rec.stores[1][1]) == 5
