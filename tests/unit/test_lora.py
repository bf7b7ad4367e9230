"""LoRA adapters in the dense step, against transformers + PEFT as the oracle: two adapters and the
base model in one batch (both mini-batches) give PEFT's greedy tokens each, on the real SmolLM2 in
fp32; an adapter this model cannot apply is refused at load in one line, and a row naming an
adapter not loaded fails alone, NOT_FOUND."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from fastdecode.contract import PlannedSeq, SamplingParams
from fastdecode.dense import StepRunner
from fastdecode.dense.loras import LoraBank, parse_modules
from fastdecode.model.dense import DenseModel
from fastdecode.runtime.errors import FailedPrecondition, InvalidInput, NotFound
from tests.support.lora import TARGETS, adapter_dir, make_adapters, peft_greedy
from tests.unit.test_dense_runner import InProcessShards

pytest.importorskip("peft")

NEW = 10
PROMPTS = [[1, 504, 3937, 282, 4649, 314], [1, 1780, 253, 1345, 563, 260, 4296], [1, 22, 1312, 2136]]


def decode(runner: StepRunner, shards: InProcessShards, loras: list[str], n: int) -> dict[str, list]:
    """Greedy decode of PROMPTS, row i with adapter loras[i] ("" the base), all rows in one step."""
    out: dict[str, list] = {f"s{i}": [] for i in range(len(PROMPTS))}
    for i in range(len(PROMPTS)):
        shards.stores[i % 2].reserve(f"s{i}", 64)
    sampling = [SamplingParams(lora=name) for name in loras]
    seqs = [PlannedSeq(f"s{i}", i % 2, i % 2, p, 0, sampling[i]) for i, p in enumerate(PROMPTS)]

    async def run() -> None:
        nonlocal seqs
        for _ in range(n):
            outcomes, _ = await runner.run(seqs, True)
            nxt = []
            for s in seqs:
                o = outcomes[s.seq_id]
                out[s.seq_id].append(o.error if o.error is not None else o.token_id)
                if o.error is None:
                    nxt.append(
                        PlannedSeq(
                            s.seq_id,
                            s.shard,
                            s.mini_batch,
                            [o.token_id],
                            s.start_pos + len(s.token_ids),
                            s.sampling,
                        )
                    )
            seqs = nxt

    asyncio.run(run())
    return out


@pytest.fixture(scope="module")
def smollm2_peft(smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple:
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    out = tmp_path_factory.mktemp("adapters")
    pm = make_adapters(base, out, TARGETS)
    return pm, out


def test_two_adapters_and_the_base_in_one_batch_give_peft_greedy_tokens(
    smollm2: Path, smollm2_peft: tuple
) -> None:
    pm, out = smollm2_peft
    model = DenseModel.from_pretrained(smollm2, "cpu", torch.float32)
    bank = LoraBank(model, max_loras=4, max_rank=16)
    for name in TARGETS:
        bank.load(name, adapter_dir(out, name))
    shards = InProcessShards(model, 2)
    runner = StepRunner(model, shards, loras=bank)
    loras = ["sql", "", "poet"]
    got = decode(runner, shards, loras, NEW)
    want = {
        f"s{i}": peft_greedy(pm, name or None, p, NEW)
        for i, (p, name) in enumerate(zip(PROMPTS, loras, strict=True))
    }
    assert got == want
    # the adapters change the tokens: the test would see a row that ran without its adapter
    assert want["s0"] != peft_greedy(pm, None, PROMPTS[0], NEW)
    assert want["s2"] != peft_greedy(pm, None, PROMPTS[2], NEW)


def test_a_row_naming_an_adapter_not_loaded_fails_alone(smollm2: Path, smollm2_peft: tuple) -> None:
    _, out = smollm2_peft
    model = DenseModel.from_pretrained(smollm2, "cpu", torch.float32)
    bank = LoraBank(model, max_loras=2, max_rank=16)
    bank.load("sql", adapter_dir(out, "sql"))
    shards = InProcessShards(model, 2)
    got = decode(StepRunner(model, shards, loras=bank), shards, ["sql", "", "nope"], 2)
    assert all(isinstance(t, int) for t in got["s0"] + got["s1"])
    (err,) = got["s2"]
    assert isinstance(err, NotFound) and "'nope' is not loaded" in str(err)
    off = InProcessShards(model, 2)  # LoRA off: FAILED_PRECONDITION, saying how to turn it on
    (err,) = decode(StepRunner(model, off), off, ["", "", "sql"], 1)["s2"]
    assert isinstance(err, FailedPrecondition) and "--enable-lora" in str(err)


def test_load_unload_and_the_limits(smollm2: Path, smollm2_peft: tuple) -> None:
    _, out = smollm2_peft
    model = DenseModel.from_pretrained(smollm2, "cpu", torch.float32)
    bank = LoraBank(model, max_loras=1, max_rank=4)
    with pytest.raises(InvalidInput, match="rank 8 exceeds --max-lora-rank 4"):
        bank.load("sql", adapter_dir(out, "sql"))
    bank.max_rank = 8
    bank.load("sql", adapter_dir(out, "sql"))
    with pytest.raises(InvalidInput, match="already loaded"):
        bank.load("sql", adapter_dir(out, "sql"))
    with pytest.raises(InvalidInput, match="--max-loras"):
        bank.load("poet", adapter_dir(out, "poet"))
    bank.unload("sql")
    with pytest.raises(NotFound, match="not loaded"):
        bank.unload("sql")
    bank.load("poet", adapter_dir(out, "poet"))
    assert [a.name for a in bank.adapters()] == ["poet"]
    bank.unload("poet")
    with pytest.raises(InvalidInput, match="is not a directory"):
        bank.load("c", out / "missing")
    assert parse_modules(" x=/p/x, y=/p/y ") == [("x", "/p/x"), ("y", "/p/y")]
    with pytest.raises(InvalidInput, match="NAME=PATH"):
        parse_modules("x")


def _one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_an_adapter_of_another_shape_is_refused_in_one_line(
    model_factory: Callable, smollm2: Path, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    tiny = AutoModelForCausalLM.from_pretrained(model_factory("llama"), dtype=torch.float32)
    make_adapters(tiny, tmp_path / "tiny", {"tiny": ["q_proj", "v_proj"]})
    model = DenseModel.from_pretrained(smollm2, "cpu", torch.float32)
    bank = LoraBank(model, max_loras=4, max_rank=64)
    with pytest.raises(InvalidInput) as e:
        bank.load("tiny", adapter_dir(tmp_path / "tiny", "tiny"))
    msg = _one_line(e)
    assert "this model needs A" in msg, msg
    # a target module the model lacks (as another architecture's adapter would name)
    wrong = tmp_path / "fc"
    wrong.mkdir()
    (wrong / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 4}))
    from safetensors.torch import save_file

    save_file(
        {
            "base_model.model.model.layers.0.mlp.fc1.lora_A.weight": torch.zeros(2, 576),
            "base_model.model.model.layers.0.mlp.fc1.lora_B.weight": torch.zeros(1536, 2),
        },
        str(wrong / "adapter_model.safetensors"),
    )
    with pytest.raises(InvalidInput) as e:
        bank.load("fc", wrong)
    assert "targets fc1 of layer 0, which this llama model lacks" in _one_line(e)
    (wrong / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, "use_dora": True}))
    with pytest.raises(InvalidInput, match="not supported: use_dora"):
        bank.load("fc", wrong)
    assert bank.adapters() == []


def test_a_corrupt_adapter_file_is_refused_in_one_line(smollm2: Path, tmp_path: Path) -> None:
    model = DenseModel.from_pretrained(smollm2, "cpu", torch.float32)
    bank = LoraBank(model, max_loras=4, max_rank=64)
    (tmp_path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 4}))
    (tmp_path / "adapter_model.safetensors").write_bytes(b"\x00" * 7)
    with pytest.raises(InvalidInput) as e:
        bank.load("broken", tmp_path)
    assert "weights unreadable" in _one_line(e)
    (tmp_path / "adapter_config.json").write_text("{not json")
    with pytest.raises(InvalidInput) as e:
        bank.load("broken", tmp_path)
    assert "adapter_config.json" in _one_line(e)
