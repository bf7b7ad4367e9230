"""The tensor-parallel layout (fastdecode/model/tensor_parallel.py) computes what one rank computes:
each rank's slices, their partial sums added and their heads and vocabulary gathered, give the whole
model's q, k, v, hidden states and logits, for every family that splits (dense, GQA, fused
projections, q/k norms, Gemma's norms and soft-caps, routed experts). Here the ranks are threads
and the collectives a barrier (tests/e2e/test_tensor_parallel.py runs them as processes over gloo);
also the refusals and the emulated roofline's share per GPU."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from fastdecode.dense.emulated import PROFILES, Roofline, load_emulated
from fastdecode.model.config import ModelConfig, check_tensor_parallel
from fastdecode.model.dense import DenseModel
from fastdecode.model.tensor_parallel import RankGroup, TensorParallelModel
from fastdecode.runtime.errors import InvalidInput
from fastdecode.runtime.geometry import GEOMETRIES

WORLD = 2


class ThreadGroup(RankGroup):
    """RankGroup's collectives between threads of this process."""

    def __init__(self, rank: int, shared: dict) -> None:
        super().__init__(rank, WORLD, torch.device("cpu"))
        self.shared = shared

    def _exchange(self, t: torch.Tensor) -> list[torch.Tensor]:
        slots, barrier = self.shared["slots"], self.shared["barrier"]
        slots[self.rank] = t.clone()
        barrier.wait()
        got = list(slots)
        barrier.wait()  # nobody overwrites a slot before everyone has read it
        return got

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        parts = self._exchange(t)
        return t.copy_(sum(parts[1:], parts[0].clone()))

    def gather(self, part: torch.Tensor) -> list[torch.Tensor] | None:
        parts = self._exchange(part)
        return parts if self.rank == 0 else None


def ranks(path: Path) -> list[TensorParallelModel]:
    shared = {"slots": [None] * WORLD, "barrier": threading.Barrier(WORLD, timeout=60)}
    return [
        TensorParallelModel.load(path, "cpu", torch.float32, ThreadGroup(r, shared)) for r in range(WORLD)
    ]


def on_ranks(models: list[TensorParallelModel], call: Callable[[TensorParallelModel], object]) -> object:
    with ThreadPoolExecutor(WORLD) as pool:
        return [f.result(timeout=60) for f in [pool.submit(call, m) for m in models]][0]


@pytest.mark.parametrize(
    "family", ["llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "mixtral", "qwen3_moe"]
)
def test_ranks_compute_what_one_model_computes(
    family: str, model_factory: Callable, family_factory: Callable
) -> None:
    path = model_factory("llama") if family == "llama" else family_factory(family)
    whole = DenseModel.from_pretrained(path)
    models = ranks(path)
    c = whole.config
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(5, c.hidden_size, generator=gen)
    positions = torch.tensor([0, 1, 2, 7, 30])
    for layer in range(c.num_hidden_layers):
        q, k, v = on_ranks(models, lambda m, n=layer: m._pre(n, hidden, positions))  # type: ignore[misc]
        wq, wk, wv = whole.pre_attention(layer, hidden, positions)
        for got, want in ((q, wq), (k, wk), (v, wv)):
            assert got.shape == want.shape
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        attn = torch.randn(5, whole.q_size, generator=gen)
        rows = torch.cat([hidden, attn], dim=1)
        out = on_ranks(models, lambda m, n=layer, r=rows: m._post(n, r))  # type: ignore[misc]
        torch.testing.assert_close(out, whole.post_attention(layer, hidden, attn), rtol=1e-5, atol=1e-5)
    logits = on_ranks(models, lambda m: DenseModel.logits(m, hidden))
    torch.testing.assert_close(logits, whole.logits(hidden), rtol=1e-5, atol=1e-5)
    assert models[1].embed_w.numel() == 0  # only rank 0 embeds
    assert models[0].layers[0].qkv_w.shape[0] * WORLD == whole.layers[0].qkv_w.shape[0]


def test_splits_the_model_cannot_take_are_refused_in_one_line(family_factory: Callable) -> None:
    qwen2 = ModelConfig.from_pretrained(family_factory("qwen2"))  # 4 heads over 2 KV heads
    check_tensor_parallel(qwen2, 2)
    with pytest.raises(InvalidInput, match="--tensor-parallel 4 must divide the model's key-value heads"):
        check_tensor_parallel(qwen2, 4)
    with pytest.raises(InvalidInput, match="q/k norm spans every head"):
        check_tensor_parallel(ModelConfig.from_pretrained(family_factory("olmoe")), 2)


def test_the_emulated_roofline_charges_each_gpu_its_share_and_the_collectives() -> None:
    g, h100 = GEOMETRIES["llama-3-70b"], PROFILES["h100"]
    one, four = Roofline(h100, g, 2, 1), Roofline(h100, g, 2, 4)
    pre, post = one.layer_params()
    assert four.layer_params() == (pre // 4, post // 4)
    # every GPU holds a quarter of the layers, rank 0 the whole embedding and a quarter of the head
    assert four.weight_bytes() == ((pre + post) // 4 * g.num_layers + g.hidden * g.vocab * 5 // 4) * 2
    # the collectives cost time: more than a quarter of one GPU's layer, less than the whole
    assert one.layer_seconds(128) / 4 < four.layer_seconds(128) < one.layer_seconds(128)
    assert Roofline(h100, g, 2, 4).pre_seconds(1) > Roofline(h100, g, 2, 4).profile.kernel_seconds(0, 0, 3)


def test_an_emulated_70b_needs_tensor_parallelism_to_fit(model_factory: Callable) -> None:
    path = model_factory("llama")
    with pytest.raises(InvalidInput, match="h100 has 80 GiB"):
        load_emulated(path, "emulated:h100", torch.bfloat16, "llama-3-70b")
    four = load_emulated(path, "emulated:h100", torch.bfloat16, "llama-3-70b", tensor_parallel=4)
    assert four.roofline.tensor_parallel == 4
    with pytest.raises(InvalidInput, match="--tensor-parallel 3 must divide"):
        load_emulated(path, "emulated:h100", torch.bfloat16, "llama-3-70b", tensor_parallel=3)
