"""Sliding windows and the logit soft-cap in both attention backends, against an fp64 reference.

The native kernel (every KV dtype, every ISA level this CPU has) and the torch backend attend decode
steps, causal prefill chunks that start mid-cache and speculative verification steps (k + 1
positions per sequence), where each query token of a chunk has its own window start; scores are
q . k / sqrt(D), then cap * tanh(score / cap), then the mask.
"""

from __future__ import annotations

import math

import pytest
import torch

from fastdecode.kv import KV_DTYPES, AttendBatch, KVStore, native
from fastdecode.kv.memory import kv_bytes_per_element
from fastdecode.runtime.geometry import KVGeometry

kernel = native.load()
ISAS = native.isas()  # every level this CPU can run, scalar first
# The kernel's own arithmetic against fp64 over what the pool holds (as test_kv_native.py); the
# soft-cap's vector tanh (1 - 2 / (e^2x + 1)) adds ~1e-7 of the cap to each score.
TOL = {"float32": 5e-5, "float16": 5e-5, "bfloat16": 5e-5, "int8": 1e-3, "float8_e4m3": 5e-5}


def reference(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int, window: int, cap: float
) -> torch.Tensor:
    """fp64 attention of q [n, H, D] at positions start.. over keys/values [L, KVH, D] -> [n, H*D]."""
    n, heads, dim = q.shape
    group = heads // keys.shape[1]
    k = keys.double().repeat_interleave(group, dim=1)
    v = values.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q.double(), k) / math.sqrt(dim)
    if cap:
        scores = cap * torch.tanh(scores / cap)
    key = torch.arange(keys.shape[0])[None, :]
    pos = torch.arange(start, start + n)[:, None]
    hidden = key > pos
    if window:
        hidden |= key <= pos - window
    scores = scores.masked_fill(hidden[None], float("-inf"))
    assert not scores.isnan().any(), "a query sees a key whose block was given back"
    return torch.einsum("hnl,lhd->nhd", scores.softmax(-1), v.nan_to_num(0.0)).reshape(n, heads * dim)


def stored(store: KVStore, layer: int, seq_id: str, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What the pool holds for positions 0..length-1 as fp64 [length, KVH, D] (int8 dequantized);
    positions whose blocks a window gave back read as NaN (a test that looks at them fails)."""
    seq = store.seqs[seq_id]
    slots = store._slots(seq, length, store._group_of[layer])
    gone = slots < 0
    m = store._member[layer]
    out = []
    for pool, scales in ((store.k, store.k_scale), (store.v, store.v_scale)):
        x = pool[m][:, slots.clamp(min=0)].double()
        if store.quantized:
            x = x * scales[m][:, slots.clamp(min=0), None].double()
        x[:, gone] = float("nan")
        out.append(x.transpose(0, 1))
    return out[0], out[1]


def make(
    dtype: str, windows: tuple[int, ...], cap: float, backend: str, kvh: int = 2, dim: int = 64
) -> KVStore:
    per_token = 2 * len(windows) * kvh * dim * kv_bytes_per_element(KV_DTYPES[dtype], dim)
    return KVStore(
        KVGeometry(len(windows), kvh, dim, windows, cap),
        int(per_token * 4096),
        KV_DTYPES[dtype],
        16,
        backend=backend,
        prefix_sharing=False,
    )


# Windows smaller than a tile, across tile and block edges, and longer than the context; caps
# that bend most scores (q is scaled up so that |score| reaches several caps) or none.
CASES = [(7, 0.0), (37, 0.0), (0, 3.0), (21, 3.0), (500, 50.0)]


def _run(store: KVStore, layer: int, tol: float, window: int, cap: float, gen: torch.Generator) -> None:
    kvh, dim, heads = store.num_kv_heads, store.head_dim, 3 * store.num_kv_heads
    lengths = {"a": 90, "b": 45, "c": 3}
    hist = {
        s: (torch.randn(n + 40, kvh, dim, generator=gen), torch.randn(n + 40, kvh, dim, generator=gen))
        for s, n in lengths.items()
    }
    for sid, n in lengths.items():
        store.reserve(sid, n + 40)
    # prefill chunks: a from 0 (52 tokens), then a second chunk mid-cache; b and c in one call
    calls = [
        [("a", 0, 52)],
        [("a", 52, 38), ("b", 0, 45), ("c", 0, 3)],
        [("a", 90, 1), ("b", 45, 1), ("c", 3, 1)],  # decode
        [("a", 91, 1), ("b", 46, 17), ("c", 4, 1)],  # decode beside a chunk
        [("a", 92, 4), ("b", 63, 5), ("c", 5, 4)],  # speculative verification: k + 1 positions each
    ]
    for call in calls:
        total = sum(n for *_, n in call)
        q = torch.randn(total, heads, dim, generator=gen) * (4.0 if cap else 1.0)
        k = torch.cat([hist[s][0][p : p + n] for s, p, n in call])
        v = torch.cat([hist[s][1][p : p + n] for s, p, n in call])
        o = store.attend(
            layer, AttendBatch([s for s, *_ in call], [n for *_, n in call], [p for _, p, _ in call], q, k, v)
        )
        row = 0
        for s, p, n in call:
            sk, sv = stored(store, layer, s, p + n)
            want = reference(q[row : row + n], sk, sv, p, window, cap)
            torch.testing.assert_close(o[row : row + n].double(), want, atol=tol, rtol=tol)
            row += n


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", list(KV_DTYPES))
@pytest.mark.parametrize(("window", "cap"), CASES)
def test_native_window_and_softcap(isa: str, dtype: str, window: int, cap: float) -> None:
    kernel.set_isa(isa)
    try:
        store = make(dtype, (window, 0), cap, "native")
        _run(store, 0, TOL[dtype], window, cap, torch.Generator().manual_seed(window * 7 + int(cap)))
    finally:
        kernel.set_isa("auto")


@pytest.mark.parametrize("dtype", list(KV_DTYPES))
@pytest.mark.parametrize(("window", "cap"), CASES)
def test_torch_window_and_softcap(dtype: str, window: int, cap: float) -> None:
    store = make(dtype, (0, window), cap, "torch")
    # the torch backend computes bfloat16/float16 scores from q rounded to the pool's dtype
    tol = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 3e-2, "int8": 1e-4, "float8_e4m3": 1e-4}[dtype]
    _run(store, 1, tol, window, cap, torch.Generator().manual_seed(window + 1))


def test_full_layer_beside_window_layer_sees_everything() -> None:
    """The window is per layer: layer 0 (window 5) and layer 1 (full) of one store differ."""
    store = make("float32", (5, 0), 0.0, "native")
    store.reserve("s", 40)
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(30, 6, 64, generator=gen)
    k, v = torch.randn(30, 2, 64, generator=gen), torch.randn(30, 2, 64, generator=gen)
    o0 = store.attend(0, AttendBatch(["s"], [30], [0], q, k, v))
    o1 = store.attend(1, AttendBatch(["s"], [30], [0], q, k, v))
    torch.testing.assert_close(o0[:5], o1[:5])  # the first 5 positions see the same keys
    assert not torch.allclose(o0[10:], o1[10:])
    torch.testing.assert_close(o0.double(), reference(q, k, v, 0, 5, 0.0), atol=5e-5, rtol=5e-5)
