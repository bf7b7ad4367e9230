"""Model core against transformers: greedy tokens equal, logits within 1e-4, clear load errors."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from fastdecode.dense.engine import LocalEngine, SeqChunk
from fastdecode.model import ModelConfig
from fastdecode.model.dense import DenseModel
from fastdecode.model.rope import rope_inv_freq
from fastdecode.runtime.errors import ModelLoadError
from tests.support import PROMPTS

ARCHS = ["llama", "mistral", "qwen2", "qwen3_moe"]


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tokens_equal_transformers(arch: str, model_factory: Callable, hf_greedy: Callable) -> None:
    path = model_factory(arch)
    engine = LocalEngine.from_pretrained(path)
    ours = engine.generate(PROMPTS, max_tokens=24)  # one batch, prompts of different lengths
    for prompt, gen in zip(PROMPTS, ours, strict=True):
        ref = hf_greedy(path, tuple(prompt), 24)
        assert gen.token_ids == ref, f"{arch}: prompt of {len(prompt)} tokens diverges"
    assert any(len(set(g.token_ids)) > 3 for g in ours), "degenerate checkpoint: outputs barely vary"


@pytest.mark.parametrize("arch", ARCHS)
def test_first_step_logits_within_1e4(arch: str, model_factory: Callable, hf_greedy: Callable) -> None:
    path = model_factory(arch)
    hf = hf_greedy.load(path)
    engine = LocalEngine.from_pretrained(path)
    chunks = [SeqChunk(f"s{i}", p, 0) for i, p in enumerate(PROMPTS)]
    for c in chunks:
        engine.kv.reserve(c.seq_id, len(c.token_ids))
    ours = engine.forward(chunks)
    for i, p in enumerate(PROMPTS):
        with torch.no_grad():
            ref = hf(torch.tensor([p])).logits[0, -1].float()
        assert (ours[i] - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize("chunk", [1, 3, 7])
def test_chunked_prefill_equals_one_piece(chunk: int, llama_dir: Path) -> None:
    engine = LocalEngine.from_pretrained(llama_dir)
    whole = engine.generate(PROMPTS, max_tokens=12)
    parts = engine.generate(PROMPTS, max_tokens=12, prefill_chunk=chunk)
    assert [g.token_ids for g in parts] == [g.token_ids for g in whole]


def test_gqa_and_tied_embeddings_are_read(model_factory: Callable) -> None:
    mistral = ModelConfig.from_pretrained(model_factory("mistral"))
    qwen = ModelConfig.from_pretrained(model_factory("qwen2"))
    assert mistral.num_key_value_heads < mistral.num_attention_heads
    assert qwen.tie_word_embeddings and qwen.qkv_bias and not qwen.o_bias
    model = DenseModel.from_pretrained(model_factory("qwen2"))
    assert model.lm_head_w is model.embed_w


def test_missing_tensor_is_named(llama_dir: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(llama_dir, broken)
    tensors = load_file(broken / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"missing tensor 'model\.layers\.1\.mlp\.up_proj\.weight'"):
        DenseModel.from_pretrained(broken)


def test_unknown_model_type_is_named(llama_dir: Path, tmp_path: Path) -> None:
    broken = tmp_path / "gpt"
    shutil.copytree(llama_dir, broken)
    cfg = json.loads((broken / "config.json").read_text())
    cfg["model_type"] = "gpt_neox"
    (broken / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="unsupported model_type 'gpt_neox'"):
        DenseModel.from_pretrained(broken)


def test_sharded_checkpoint_loads_like_single(llama_dir: Path, tmp_path: Path) -> None:
    sharded = tmp_path / "sharded"
    shutil.copytree(llama_dir, sharded)
    tensors = load_file(sharded / "model.safetensors")
    (sharded / "model.safetensors").unlink()
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for fname, part in halves.items():
        save_file({n: tensors[n] for n in part}, sharded / fname, metadata={"format": "pt"})
        weight_map.update({n: fname for n in part})
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    a = LocalEngine.from_pretrained(llama_dir).generate(PROMPTS[:2], max_tokens=8)
    b = LocalEngine.from_pretrained(sharded).generate(PROMPTS[:2], max_tokens=8)
    assert [g.token_ids for g in a] == [g.token_ids for g in b]


BASE = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "vocab_size": 100,
    "max_position_embeddings": 4096,
}


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_theta": 500000.0},
        {"rope_theta": 10000.0, "rope_scaling": {"type": "linear", "factor": 4.0}},
        {
            "rope_theta": 500000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        },
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            }
        },
        {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}},
    ],
)
def test_rope_forms_match_transformers(rope: dict) -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = {**BASE, **rope}
    ours = rope_inv_freq(ModelConfig.from_dict(cfg).rope, 16)
    hf_cfg = LlamaConfig(**cfg)
    rope_type = hf_cfg.rope_parameters.get("rope_type", "default")
    if rope_type == "default":
        theta = hf_cfg.rope_parameters["rope_theta"]
        ref = 1.0 / (theta ** (torch.arange(0, 16, 2, dtype=torch.int64).float() / 16))
    else:
        ref, _ = ROPE_INIT_FUNCTIONS[rope_type](hf_cfg, "cpu")
    torch.testing.assert_close(ours, ref)


def test_eos_ids_merge_config_and_generation_config() -> None:
    cfg = ModelConfig.from_dict({**BASE, "eos_token_id": 2}, {"eos_token_id": [2, 7]})
    assert cfg.eos_token_ids == (2, 7)
