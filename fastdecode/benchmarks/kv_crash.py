"""`fastdecode bench kv-crash`: kill -9 a process appending to a persistent KV pool, many times, at
random moments, and check what each restart finds (fastdecode/kv/persist.py).

Each round forks a child that re-attaches the pool (KVStore with a pool file), then decodes its
sequences in a loop, a layer per Attend item, replacing a finished sequence by a new one (whose first
blocks are a prefix every sequence shares, so prefix blocks are published, read and evicted). The
parent kills it with SIGKILL after a random delay, re-attaches the pool itself and compares every
committed position of every live sequence, on every layer, with the KV that position must hold
(a function of its token, position and layer): a wrong row is a failure. It reports how many kills
found appends in flight (the journal's marks), the positions they tore (computed again by the next
child), and pools discarded as inconsistent (never expected)."""

from __future__ import annotations

import os
import random
import select
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from fastdecode.kv import KV_DTYPES, AttendBatch, KVStore
from fastdecode.runtime.errors import InvalidInput
from fastdecode.runtime.geometry import KVGeometry

GEOMETRY = KVGeometry(num_layers=3, num_kv_heads=2, head_dim=16)
LIVE = 6  # sequences decoding at once
SHARED = [5, 6, 7, 8, 9, 10, 11, 12]  # every sequence's first tokens: two shared blocks of 4
BLOCK = 4
CAPACITY_TOKENS = 512


def tokens_of(seq: int, n: int) -> list[int]:
    """A sequence's token ids: the shared prefix, then its own."""
    return [*SHARED, *((seq * 7919 + p * 104729) % 1000 for p in range(len(SHARED), n))][:n]


def length_of(seq: int) -> int:
    return 20 + (seq * 37) % 40


def kv_rows(tokens: list[int], start: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k, v [n, KVH, D] positions start.. must hold: a function of token, position and layer
    only, so a shared prefix block is the same whoever computed it."""
    t = torch.tensor(tokens[start:], dtype=torch.float32)[:, None, None]
    pos = torch.arange(start, len(tokens), dtype=torch.float32)[:, None, None]
    ch = torch.arange(GEOMETRY.num_kv_heads * GEOMETRY.head_dim, dtype=torch.float32)
    ch = ch.view(1, GEOMETRY.num_kv_heads, GEOMETRY.head_dim)
    k = torch.sin(t * 0.013 + pos * 0.7 + ch * 0.11 + layer)
    return k, torch.cos(k * 1.3 + layer)


def _store(base: Path, dtype: torch.dtype) -> KVStore:
    cap = CAPACITY_TOKENS * GEOMETRY.bytes_per_token(dtype.itemsize)
    return KVStore(GEOMETRY, cap, dtype, block_size=BLOCK, pool_file=base)


def _attend(store: KVStore, ids: list[str], seqs: list[int], starts: list[int], ends: list[int]) -> None:
    counts = [e - s for s, e in zip(starts, ends, strict=True)]
    for layer in range(GEOMETRY.num_layers):
        rows = [kv_rows(tokens_of(s, e), st, layer) for s, st, e in zip(seqs, starts, ends, strict=True)]
        k, v = torch.cat([r[0] for r in rows]), torch.cat([r[1] for r in rows])
        q = torch.zeros(k.shape[0], GEOMETRY.num_kv_heads, GEOMETRY.head_dim)
        store.attend(layer, AttendBatch(ids, counts, starts, q, k, v))


def _child(base: Path, dtype: torch.dtype, seed: int, ready: int) -> None:
    """Decode forever (until killed): resume what the pool holds, start new sequences as others end.
    A byte on the `ready` pipe tells the parent the pool is open and decoding begins."""
    torch.set_num_threads(1)
    store = _store(base, dtype)
    os.write(ready, b"r")
    rng = random.Random(seed)
    live = {sid: int(sid[1:]) for sid in store.seqs}
    nxt = max(live.values(), default=0) + 1
    while True:
        while len(live) < LIVE:  # a new sequence: reserve with its prompt's ids, prefill what is not cached
            s = nxt
            nxt += 1
            prompt = tokens_of(s, 10 + rng.randrange(6))
            (cached,) = store.reserve_many([(f"s{s}", length_of(s), prompt)])
            _attend(store, [f"s{s}"], [s], [cached], [len(prompt)])
            store.journal.flush()  # type: ignore[union-attr]  (as ShardCore does after each call)
            live[f"s{s}"] = s
        ids = list(live)
        starts = [min(store.seqs[i].lengths) for i in ids]
        ends = [st + 1 for st in starts]
        _attend(store, ids, [live[i] for i in ids], starts, ends)
        for i, e in zip(ids, ends, strict=True):
            if e >= length_of(live[i]):
                store.release(i)
                del live[i]
        store.journal.flush()  # type: ignore[union-attr]


def _check(store: KVStore) -> int:
    """Wrong committed rows across the live sequences and layers (0 expected)."""
    wrong = 0
    for sid, seq in store.seqs.items():
        n = min(seq.lengths)
        if n == 0:
            continue
        toks = tokens_of(int(sid[1:]), n)
        for layer in range(GEOMETRY.num_layers):
            k, v, _, _ = store.export_layer(sid, layer)
            ek, ev = kv_rows(toks, 0, layer)
            ek, ev = ek.to(store.dtype).transpose(0, 1), ev.to(store.dtype).transpose(0, 1)
            wrong += int((k != ek).any(-1).sum() + (v != ev).any(-1).sum())
    return wrong


def run_kv_crash(
    kills: int = 200, kv_dtype: str = "float32", seed: int = 0, max_delay_ms: float = 80.0
) -> dict[str, Any]:
    dtype = KV_DTYPES[kv_dtype]
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise InvalidInput("kv-crash checks exact rows: float32, bfloat16 or float16 KV")
    torch.set_num_threads(1)  # forked children: the parent never starts a thread pool
    rng = random.Random(seed)
    out: dict[str, Any] = {
        "kills": 0,
        "kills_with_appends_in_flight": 0,
        "torn_positions": 0,
        "wrong_rows": 0,
        "pools_discarded": 0,
        "sequences_resumed": 0,
        "kv_dtype": kv_dtype,
    }
    with tempfile.TemporaryDirectory(prefix="fastdecode-kv-crash-") as d:
        base = Path(d) / "shard-0"
        t0 = time.perf_counter()
        started = 0
        for round_no in range(kills):
            ready_r, ready_w = os.pipe()
            pid = os.fork()
            if pid == 0:  # the child: decode until killed (never returns)
                try:
                    os.close(ready_r)
                    _child(base, dtype, seed * 100003 + round_no, ready_w)
                finally:
                    os._exit(1)
            os.close(ready_w)
            # the delay counts from the decode loop's start, not the fork: on a loaded host the
            # re-attach alone outlasted it, and the kills stopped reaching any decoding
            select.select([ready_r], [], [], 60)
            os.close(ready_r)
            time.sleep(0.02 + rng.random() * max_delay_ms / 1000)
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            store = _store(base, dtype)
            r = store.reattached
            out["kills"] += 1
            out["kills_with_appends_in_flight"] += r.torn_sequences > 0
            out["torn_positions"] += r.torn_positions
            out["pools_discarded"] += bool(store.pool and store.pool.discarded)
            out["sequences_resumed"] += len(r.positions)
            ids = {int(s[1:]) for s in store.seqs}
            started = max([started, *ids])
            out["wrong_rows"] += _check(store)
            store.pool.detach()  # type: ignore[union-attr]  (as a killed parent would: no clean close)
        out["sequences_started"] = started
        out["seconds"] = round(time.perf_counter() - t0, 2)
    out["ok"] = out["wrong_rows"] == 0 and out["pools_discarded"] == 0
    return out
