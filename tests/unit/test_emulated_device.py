"""The emulated accelerator: its roofline, its errors, and the real step runner on it (real KV
stores attend its synthetic q, k, v; the step lasts the profile's device time; sampling runs)."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest
import torch

from fastdecode.dense import LayerPlane, StepRunner
from fastdecode.dense.emulated import (
    PROFILE_RANGES,
    PROFILES,
    EmulatedModel,
    GPUProfile,
    Roofline,
    apply_geometry,
    load_emulated,
    load_profile,
)
from fastdecode.dense.sampling import SamplingParams
from fastdecode.model.config import ModelConfig
from fastdecode.runtime.errors import InvalidInput
from fastdecode.runtime.geometry import GEOMETRIES
from fastdecode.scheduling import PlannedSeq
from tests.unit.test_dense_runner import InProcessShards


def test_h100_llama3_8b_step_is_the_documented_roofline() -> None:
    roof = Roofline(PROFILES["h100"], GEOMETRIES["llama-3-8b"], 2)
    pre, post = roof.layer_params()
    assert pre == 4096 * (4096 + 2 * 1024) and post == 4096 * 4096 + 3 * 4096 * 14336
    # B=128 a mini-batch is memory-bound: the weights' bytes over HBM (activations add ~6%), / efficiency,
    # + 8 kernel floors
    weights = (pre + post) * 2
    assert roof.layer_seconds(128) == pytest.approx(weights / 3350e9 / 0.8 + 8 * 3e-6, rel=0.08)
    step = roof.step_seconds(256)
    assert 4e-3 <= step["gpu_step_s"] <= 15e-3
    # one batch reads the weights once: faster on the GPU than two mini-batches
    assert roof.step_seconds(256, pipelined=False)["gpu_step_s"] < step["gpu_step_s"]
    # compute-bound at a large enough batch: the time grows with it
    assert roof.layer_seconds(8192) > 2 * roof.layer_seconds(1024)


def test_unknown_profile_and_too_big_geometry_are_one_clear_error(tmp_path: Path, llama_dir: Path) -> None:
    with pytest.raises(InvalidInput, match="unknown GPU profile 'b200'"):
        load_profile("emulated:b200")
    with pytest.raises(InvalidInput, match="llama-3-70b needs .* GiB .* h100 has 80 GiB"):
        load_emulated(llama_dir, "emulated:h100", torch.bfloat16, "llama-3-70b")
    load_emulated(llama_dir, "emulated:h200", torch.float8_e4m3fn, "llama-3-70b")  # 1 byte: it fits
    with pytest.raises(InvalidInput, match="unknown geometry"):
        load_emulated(llama_dir, "emulated:h100", torch.bfloat16, "llama-9")
    custom = tmp_path / "mygpu.json"
    custom.write_text(
        json.dumps(
            {
                "hbm_gbps": 1000,
                "peak_tflops": 200,
                "efficiency": 0.7,
                "kernel_floor_us": 5,
                "pcie_gbps": 20,
                "memory_gib": 48,
            }
        )
    )
    assert load_profile(f"emulated:{custom}").name == "mygpu"
    custom.write_text(json.dumps({"hbm_gbps": 1000}))
    with pytest.raises(InvalidInput, match="fields:"):
        load_profile(f"emulated:{custom}")
    custom.write_text(json.dumps({**PROFILES["l4"].__dict__, "efficiency": 1.5}))
    with pytest.raises(InvalidInput, match="efficiency"):
        load_profile(f"emulated:{custom}")


ODD_VALUES = ["NaN", "Infinity", "-Infinity", "-1", "0", "1e30", '"300"', "true", "null"]


@pytest.mark.parametrize(
    "field, bad",
    # a kernel floor of 0 is a profile with no launch cost: allowed
    [
        (f, b)
        for f in sorted(PROFILE_RANGES)
        for b in ODD_VALUES
        if not (b == "0" and PROFILE_RANGES[f][0] == 0)
    ],
)
def test_a_profile_field_nan_infinite_or_absurd_is_refused_by_name(
    tmp_path: Path, field: str, bad: str
) -> None:
    """Every numeric field of a profile file is a finite number in its range: a NaN
    bandwidth made every emulated step take no time; an infinite one, forever."""
    fields = {k: v for k, v in PROFILES["l4"].__dict__.items() if k != "name"}
    custom = tmp_path / "odd.json"
    # json.dumps cannot write NaN as a literal value of our choice: splice the raw token in
    custom.write_text(json.dumps({**fields, field: "@"}).replace('"@"', bad))
    with pytest.raises(InvalidInput) as info:
        load_profile(f"emulated:{custom}")
    assert f"{field} must be a finite number in" in info.value.message, info.value.message


def test_every_builtin_profile_is_within_the_ranges(tmp_path: Path) -> None:
    for p in PROFILES.values():
        assert GPUProfile(**p.__dict__) == p
    custom = tmp_path / "list.json"
    custom.write_text("[1, 2]")
    with pytest.raises(InvalidInput, match="one JSON object"):
        load_profile(f"emulated:{custom}")
    custom.write_text(json.dumps({**PROFILES["l4"].__dict__, "name": 7}))
    with pytest.raises(InvalidInput, match="name must be a non-empty string"):
        load_profile(f"emulated:{custom}")


def test_geometry_over_the_checkpoint(llama_dir: Path) -> None:
    base = ModelConfig.from_pretrained(llama_dir)
    c = apply_geometry(base, "llama-3-8b")
    assert (c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (4096, 32, 8, 128)
    assert (c.num_hidden_layers, c.intermediate_size, c.vocab_size) == (32, 14336, 128256)
    assert c.eos_token_ids == base.eos_token_ids and apply_geometry(base, None) is base


def test_runner_on_the_emulated_device(llama_dir: Path) -> None:
    """Real KV stores attend the synthetic q, k, v; tokens come from the tokenizer's range; the step
    waits the device's time (two mini-batches: each layer twice) without computing it."""
    model = load_emulated(llama_dir, "emulated:l4", torch.bfloat16, None)
    assert isinstance(model, EmulatedModel) and model.device.type == "meta"
    base_vocab = ModelConfig.from_pretrained(llama_dir).vocab_size
    shards = InProcessShards(model, 2)  # type: ignore[arg-type]
    runner = StepRunner(model, shards)  # type: ignore[arg-type]
    prompts = [[1, 5, 9, 3], [1, 7, 2], [1, 4, 4, 8, 6], [1, 3]]
    for i in range(len(prompts)):
        shards.stores[i % 2].reserve(f"s{i}", 64)
    seqs = [
        PlannedSeq(
            f"s{i}", i % 2, i % 2, p, 0, sampling=SamplingParams(temperature=0.0 if i else 1.0, seed=3)
        )
        for i, p in enumerate(prompts)
    ]

    async def run() -> tuple[dict, float, float]:
        t0 = time.perf_counter()
        outcomes, t = await runner.run(seqs, True)
        return outcomes, time.perf_counter() - t0, t.s_part_seconds

    before = model.clock.compute_seconds
    outcomes, wall, _ = asyncio.run(run())
    device = model.clock.compute_seconds - before
    expected = sum(
        model.config.num_hidden_layers * model.roofline.layer_seconds(n) for n in (9, 5)
    ) + model.roofline.head_seconds(4)
    assert device == pytest.approx(expected, rel=1e-6)
    assert wall >= device * 0.95  # the step waited for the device
    for o in outcomes.values():
        assert o.error is None and 0 <= o.token_id < base_vocab and o.logprob <= 0
    # every prompt token's K and V was written: 4 + 5 on shard 0, 3 + 2 on shard 1
    assert [s.tokens_held for s in shards.stores] == [9, 5]


def test_gpu_check_compares_the_profile_with_a_measured_layer() -> None:
    """`make gpu-check`'s comparison, run here on the CPU at a small geometry: the measured T(B) of a
    random-weight layer of the geometry's shapes beside the profile's roofline for each batch."""
    from fastdecode.benchmarks.gpu_check import geometry_model, profile_vs_measured

    m = geometry_model("smollm2", "cpu", torch.bfloat16, layers=1)
    assert m.layers[0].gate_up_w.shape == (2 * 1536, 576) and m.layers[0].qkv_w.shape == ((9 + 6) * 64, 576)
    r = profile_vs_measured("smollm2", (2, 8), "cpu")
    assert [row["batch"] for row in r["rows"]] == [2, 8]
    for row in r["rows"]:
        assert row["measured_ms"] > 0 and row["measured_over_profile"] == pytest.approx(
            row["measured_ms"] / row["profile_ms"]
        )


class DeviceWaitingShards(InProcessShards, LayerPlane):
    """A plane that holds each layer until the device's q, k, v are ready (as exchange workers do):
    it declares attend_layer_at, and no other capability."""

    attend_layer_blocking = None
    staging = None

    def __init__(self, model: EmulatedModel, n: int) -> None:
        super().__init__(model, n)  # type: ignore[arg-type]
        self.calls: list[tuple[int, int, float, float]] = []  # slot, layer, not_before, handed over

    async def attend_layer_at(self, slot, layer, items, not_before: float):  # type: ignore[no-untyped-def]
        self.calls.append((slot, layer, not_before, time.monotonic()))
        await asyncio.sleep(max(0.0, not_before - time.monotonic()))
        return await self.attend_layer(slot, layer, items)


def test_a_plane_that_waits_for_the_device_gets_each_layers_ready_time(llama_dir: Path) -> None:
    """The runner hands a layer over as soon as its device work is queued, with the time its q, k, v
    are ready, instead of waking to wait itself; the step still lasts the device's time and the
    tokens are the ones the waiting runner samples."""
    prompts = [[1, 5, 9, 3], [1, 7, 2], [1, 4, 4, 8, 6], [1, 3]]

    def step(plane_type: type) -> tuple[dict, float, float, InProcessShards]:
        model = load_emulated(llama_dir, "emulated:l4", torch.bfloat16, None)
        settle = model.settle

        async def counted() -> None:  # the runner's own waits for the device
            model.settles += 1  # type: ignore[attr-defined]
            await settle()

        model.settles = 0  # type: ignore[attr-defined]
        model.settle = counted  # type: ignore[method-assign]
        shards = plane_type(model, 2)
        runner = StepRunner(model, shards)  # type: ignore[arg-type]
        for i in range(len(prompts)):
            shards.stores[i % 2].reserve(f"s{i}", 64)
        seqs = [PlannedSeq(f"s{i}", i % 2, i % 2, p, 0) for i, p in enumerate(prompts)]

        async def run() -> tuple[dict, float]:
            t0 = time.perf_counter()
            outcomes, _ = await runner.run(seqs, True)
            return outcomes, time.perf_counter() - t0

        outcomes, wall = asyncio.run(run())
        shards.settles = model.settles  # type: ignore[attr-defined]
        return outcomes, wall, model.clock.compute_seconds, shards

    waiting, wall, device, shards = step(DeviceWaitingShards)
    plain, *_, plain_shards = step(InProcessShards)
    assert {s: o.token_id for s, o in waiting.items()} == {s: o.token_id for s, o in plain.items()}
    assert all(o.error is None for o in waiting.values())
    assert wall >= device * 0.95  # the device's time was still waited for, by the plane
    calls = shards.calls  # type: ignore[attr-defined]
    layers = ModelConfig.from_pretrained(llama_dir).num_hidden_layers
    assert sorted((s, lyr) for s, lyr, *_ in calls) == [(s, lyr) for s in (0, 1) for lyr in range(layers)]
    for slot in (0, 1):
        ready = [nb for s, _, nb, _ in calls if s == slot]
        assert all(b > a for a, b in zip(ready, ready[1:], strict=False))  # one layer after another
    # The runner did not wait for the device itself, but for each mini-batch's last layer (whose
    # hidden states the LM head reads) and the head; the plain runner waits at every layer pass.
    assert shards.settles == 2 + 1  # type: ignore[attr-defined]
    assert plain_shards.settles == 2 * (1 + layers) + 1  # type: ignore[attr-defined]
