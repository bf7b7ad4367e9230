"""KVStore's batched equal-length decode path (added for `fastdecode bench attention`) against a
naive reference and against the per-sequence path it replaces."""

from __future__ import annotations

import math

import pytest
import torch

from fastdecode.kv import AttendBatch, KVStore
from fastdecode.runtime.geometry import KVGeometry


def naive(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Decode attention of q [H, D] over keys/values [L, KVH, D] -> [H*D], in float64."""
    heads, dim = q.shape
    group = heads // keys.shape[1]
    k = keys.double().repeat_interleave(group, dim=1)
    v = values.double().repeat_interleave(group, dim=1)
    p = (torch.einsum("hd,lhd->hl", q.double(), k) / math.sqrt(dim)).softmax(-1)
    return torch.einsum("hl,lhd->hd", p, v).reshape(-1).float()


def filled(heads: int, kv_heads: int, lengths: list[int], dtype: torch.dtype = torch.float32):
    torch.manual_seed(3)
    itemsize = torch.empty((), dtype=dtype).element_size()
    # the torch backend: the batched path is its own (the native kernel is the default backend)
    cap = 64 * 16 * 2 * 2 * kv_heads * 8 * itemsize
    store = KVStore(KVGeometry(2, kv_heads, 8), capacity_bytes=cap, dtype=dtype, backend="torch")
    hist = {}
    for i, n in enumerate(lengths):
        sid = f"s{i}"
        store.reserve(sid, 40)
        k, v = torch.randn(n + 1, kv_heads, 8), torch.randn(n + 1, kv_heads, 8)
        hist[sid] = (k, v)
        for layer in range(2):
            store.attend(layer, AttendBatch([sid], [n], [0], torch.randn(n, heads, 8), k[:n], v[:n]))
    return store, hist


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (4, 2), (4, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_uniform_decode_is_batched_and_matches_naive(
    heads: int, kv_heads: int, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    lengths = [9] * 5
    store, hist = filled(heads, kv_heads, lengths, dtype)
    monkeypatch.setattr(store, "_attend_each", lambda *a: pytest.fail("per-sequence path taken"))
    ids = list(hist)
    q = torch.randn(5, heads, 8)
    k = torch.stack([hist[s][0][9] for s in ids])
    v = torch.stack([hist[s][1][9] for s in ids])
    out = store.attend(1, AttendBatch(ids, [1] * 5, [9] * 5, q, k, v))
    assert out.shape == (5, heads * 8) and out.dtype == torch.float32
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for i, s in enumerate(ids):
        ref = naive(q[i], hist[s][0][:10].to(dtype), hist[s][1][:10].to(dtype))
        torch.testing.assert_close(out[i], ref, atol=tol, rtol=tol)
    assert all(store.seqs[s].lengths == [9, 10] for s in ids)


def test_uneven_decode_falls_back_and_agrees_with_batched() -> None:
    uneven, hist = filled(4, 2, [9, 7, 9, 5])
    q = torch.randn(4, 4, 8)
    ids = list(hist)
    k = torch.stack([hist[s][0][n] for s, n in zip(ids, [9, 7, 9, 5], strict=True)])
    v = torch.stack([hist[s][1][n] for s, n in zip(ids, [9, 7, 9, 5], strict=True)])
    out = uneven.attend(0, AttendBatch(ids, [1] * 4, [9, 7, 9, 5], q, k, v))
    for i, (s, n) in enumerate(zip(ids, [9, 7, 9, 5], strict=True)):
        torch.testing.assert_close(out[i], naive(q[i], hist[s][0][: n + 1], hist[s][1][: n + 1]))
    # the same two equal-length sequences, batched (every other one: evenly spaced runs)
    sub = [ids[0], ids[2]]
    again = uneven.attend(1, AttendBatch(sub, [1, 1], [9, 9], q[[0, 2]], k[[0, 2]], v[[0, 2]]))
    torch.testing.assert_close(again, out[[0, 2]], atol=1e-6, rtol=1e-5)


def naive_causal(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int) -> torch.Tensor:
    """q [n, H, D] at positions start.. over keys/values [start + n, KVH, D], causal -> [n, H*D]."""
    return torch.stack([naive(q[t], keys[: start + t + 1], values[: start + t + 1]) for t in range(len(q))])


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (4, 2), (4, 1)])
@pytest.mark.parametrize("n", [2, 4, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_uniform_positions_are_one_batched_pass_and_causal(
    heads: int, kv_heads: int, n: int, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A speculative verification step (k + 1 = n new positions per sequence, equal lengths) takes
    the batched path too: one SDPA over every sequence's keys, each position seeing the cache and
    the new positions up to its own."""
    store, hist = filled(heads, kv_heads, [9] * 5, dtype)
    monkeypatch.setattr(store, "_attend_each", lambda *a: pytest.fail("per-sequence path taken"))
    ids = list(hist)
    extra = {s: (torch.randn(n, kv_heads, 8), torch.randn(n, kv_heads, 8)) for s in ids}
    q = torch.randn(5 * n, heads, 8)
    k = torch.cat([extra[s][0] for s in ids])
    v = torch.cat([extra[s][1] for s in ids])
    out = store.attend(1, AttendBatch(ids, [n] * 5, [9] * 5, q, k, v))
    assert out.shape == (5 * n, heads * 8) and out.dtype == torch.float32
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for i, s in enumerate(ids):
        keys = torch.cat([hist[s][0][:9], extra[s][0]]).to(dtype)
        values = torch.cat([hist[s][1][:9], extra[s][1]]).to(dtype)
        ref = naive_causal(q[i * n : (i + 1) * n], keys, values, 9)
        torch.testing.assert_close(out[i * n : (i + 1) * n], ref, atol=tol, rtol=tol)
    assert all(store.seqs[s].lengths == [9, 9 + n] for s in ids)
    # the same call through the per-sequence path (one sequence at a time) agrees
    monkeypatch.undo()
    again = torch.cat(
        [
            store.attend(0, AttendBatch([s], [n], [9], q[i * n : (i + 1) * n], extra[s][0], extra[s][1]))
            for i, s in enumerate(ids)
        ]
    )
    torch.testing.assert_close(again, out, atol=tol, rtol=tol)
