"""Tiny random checkpoints of every supported family, saved by transformers itself.

`save_family(name, out, tokenizer_from)` builds the family's config with transformers' own config
class (so config.json carries transformers 5's spellings), makes the model with `from_config`,
rescales its random weights so that every part visibly moves the greedy tokens (transformers'
std-0.02 init barely lets a layer touch the residual stream), saves it with `save_pretrained`, and
copies a tokenizer next to it. Windows are 8 tokens, shorter than most of tests.support.PROMPTS.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path
from typing import Any

import torch

WINDOW = 8
# Phi-3's LongRoPE switches to its long factors from here; transformers then recomputes the whole
# cache (Phi3ForCausalLM.prepare_inputs_for_generation), so greedy comparisons stay below it.
LONGROPE_ORIGINAL = 64
VOCAB = 2048
_COMMON: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 2,
}


def _configs() -> dict[str, Any]:
    from transformers import (
        Gemma2Config,
        Gemma3TextConfig,
        MistralConfig,
        MixtralConfig,
        OlmoeConfig,
        Phi3Config,
        Qwen2Config,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    half = 32 // 2  # head_dim 32 -> 16 rotary frequencies
    return {
        "qwen3": lambda: Qwen3Config(
            **_COMMON, head_dim=32, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2
        ),
        "gemma3": lambda: Gemma3TextConfig(
            **_COMMON,
            head_dim=32,
            query_pre_attn_scalar=24,
            sliding_window=WINDOW,
            layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        ),
        "gemma2": lambda: Gemma2Config(
            **_COMMON,
            head_dim=32,
            query_pre_attn_scalar=24,
            sliding_window=WINDOW,
            attn_logit_softcapping=2.0,
            final_logit_softcapping=3.0,
        ),
        "phi3": lambda: Phi3Config(
            **{**_COMMON, "max_position_embeddings": 4 * LONGROPE_ORIGINAL},
            original_max_position_embeddings=LONGROPE_ORIGINAL,
            sliding_window=WINDOW,
            rope_scaling={
                "rope_type": "longrope",
                "short_factor": [1.0 + 0.1 * i for i in range(half)],
                "long_factor": [1.0 + 0.5 * i for i in range(half)],
            },
        ),
        "mistral": lambda: MistralConfig(**_COMMON, sliding_window=WINDOW),
        "qwen2": lambda: Qwen2Config(
            **_COMMON, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1
        ),
        "mixtral": lambda: MixtralConfig(**_COMMON, num_local_experts=4, num_experts_per_tok=2),
        "qwen3_moe": lambda: Qwen3MoeConfig(
            **_COMMON,
            head_dim=32,
            moe_intermediate_size=96,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            mlp_only_layers=[1],
        ),
        "olmoe": lambda: OlmoeConfig(**_COMMON, num_experts=8, num_experts_per_tok=2, clip_qkv=4.0),
    }


FAMILIES = ("qwen3", "gemma3", "gemma2", "phi3", "mistral", "qwen2", "mixtral", "qwen3_moe", "olmoe")


def save_family(name: str, out: Path, tokenizer_from: Path, seed: int = 1234) -> Path:
    from transformers import AutoModelForCausalLM

    config = _configs()[name]()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    gemma = name.startswith("gemma")
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:  # Gemma's norms hold w in (1 + w)
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1 + (0.0 if gemma else 1.0))
            elif "embed_tokens" in pname:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
            elif p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) * (1.5 / math.sqrt(p.shape[-1])))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    model.save_pretrained(out)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_from / f, out / f)
    return out
