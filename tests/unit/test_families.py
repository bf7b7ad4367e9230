"""Every supported family against transformers, on checkpoints transformers itself saved: greedy
fp32 tokens equal on prompts longer than the window, first-step logits within 1e-4, both config
spellings read alike, and unsupported features refused at load with one line."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from fastdecode.dense.engine import LocalEngine, SeqChunk
from fastdecode.model import ModelConfig
from fastdecode.model.dense import DenseModel
from fastdecode.runtime.errors import ModelLoadError
from tests.support import PROMPTS
from tests.support.families import FAMILIES, LONGROPE_ORIGINAL, WINDOW

pytestmark = pytest.mark.filterwarnings("ignore")


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_equal_transformers(family: str, family_factory: Callable, hf_greedy: Callable) -> None:
    path = family_factory(family)
    assert max(len(p) for p in PROMPTS) > WINDOW
    engine = LocalEngine.from_pretrained(path)
    ours = engine.generate(PROMPTS, max_tokens=24)
    for prompt, gen in zip(PROMPTS, ours, strict=True):
        assert gen.token_ids == hf_greedy(path, tuple(prompt), 24), (
            f"{family}: prompt of {len(prompt)} diverges"
        )
    assert any(len(set(g.token_ids)) > 3 for g in ours), "degenerate checkpoint: outputs barely vary"


@pytest.mark.parametrize("family", FAMILIES)
def test_first_step_logits_within_1e4(family: str, family_factory: Callable, hf_greedy: Callable) -> None:
    path = family_factory(family)
    hf = hf_greedy.load(path)
    engine = LocalEngine.from_pretrained(path)
    chunks = [SeqChunk(f"s{i}", p, 0) for i, p in enumerate(PROMPTS)]
    for c in chunks:
        engine.kv.reserve(c.seq_id, len(c.token_ids))
    ours = engine.forward(chunks)
    for i, p in enumerate(PROMPTS):
        with torch.no_grad():
            ref = hf(torch.tensor([p])).logits[0, -1].float()
        assert (ours[i] - ref).abs().max().item() < 1e-4, family


@pytest.mark.parametrize("family", ["gemma3", "gemma2", "qwen2"])
def test_chunked_prefill_across_the_window(family: str, family_factory: Callable) -> None:
    engine = LocalEngine.from_pretrained(family_factory(family))
    whole = engine.generate(PROMPTS, max_tokens=8)
    parts = engine.generate(PROMPTS, max_tokens=8, prefill_chunk=3)
    assert [g.token_ids for g in parts] == [g.token_ids for g in whole]


def test_longrope_past_the_original_length_equals_a_cached_transformers(
    family_factory: Callable, hf_greedy: Callable
) -> None:
    """Past original_max_position_embeddings each new token takes the long factors, as transformers'
    Phi-3 does on a cached decode step (its `generate` instead recomputes the whole cache there)."""
    from transformers import DynamicCache

    path = family_factory("phi3")
    hf = hf_greedy.load(path)
    engine = LocalEngine.from_pretrained(path)
    tokens = [(i * 37) % 2000 + 3 for i in range(LONGROPE_ORIGINAL + 8)]
    engine.kv.reserve("s", len(tokens))
    cache = DynamicCache(config=hf.config)
    with torch.no_grad():
        hf(torch.tensor([tokens[:4]]), past_key_values=cache, use_cache=True)
        engine.forward([SeqChunk("s", tokens[:4], 0)])
        for pos in range(4, len(tokens)):
            ref = hf(torch.tensor([[tokens[pos]]]), past_key_values=cache, position_ids=torch.tensor([[pos]]))
            ours = engine.forward([SeqChunk("s", [tokens[pos]], pos)])
            assert (ours[0] - ref.logits[0, -1]).abs().max().item() < 1e-4, pos


def _cfg(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def test_classic_and_transformers5_spellings_agree(family_factory: Callable) -> None:
    g3 = _cfg(family_factory("gemma3"))
    classic = {k: v for k, v in g3.items() if k not in ("layer_types", "rope_parameters")}
    classic |= {"sliding_window_pattern": 3, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0}
    new, old = ModelConfig.from_dict(g3), ModelConfig.from_dict(classic)
    assert new.layer_windows == old.layer_windows == (WINDOW, WINDOW, 0, WINDOW)
    assert (new.rope, new.rope_local) == (old.rope, old.rope_local)
    assert new.rope.theta == 1_000_000.0 and new.rope_local is not None and new.rope_local.theta == 10_000.0

    g2 = ModelConfig.from_dict(
        {k: v for k, v in _cfg(family_factory("gemma2")).items() if k != "layer_types"}
    )
    assert g2.layer_windows == (WINDOW, 0, WINDOW, 0) and g2.attn_logit_softcap == 2.0

    q2 = _cfg(family_factory("qwen2"))
    q2_classic = ModelConfig.from_dict({k: v for k, v in q2.items() if k != "layer_types"})
    assert ModelConfig.from_dict(q2).layer_windows == q2_classic.layer_windows == (0,) + (WINDOW,) * 3
    assert ModelConfig.from_dict({**q2, "use_sliding_window": False, "layer_types": None}).layer_windows == ()

    moe = _cfg(family_factory("qwen3_moe"))
    experts = moe.get("num_local_experts") or moe.get("num_experts")
    classic_moe = {k: v for k, v in moe.items() if k != "num_local_experts"} | {"num_experts": experts}
    assert ModelConfig.from_dict(moe).moe == ModelConfig.from_dict(classic_moe).moe
    assert ModelConfig.from_dict(moe).moe.layers == (True, False, True, True)  # type: ignore[union-attr]

    mistral = ModelConfig.from_dict(_cfg(family_factory("mistral")))
    assert mistral.layer_windows == (WINDOW,) * 4


def test_gemma_scale_is_folded_into_q(family_factory: Callable) -> None:
    c = ModelConfig.from_pretrained(family_factory("gemma3"))
    # the shards scale by head_dim**-0.5; Gemma's query_pre_attn_scalar (24 here) rides in q
    assert c.query_scale == pytest.approx((24**-0.5) / (c.head_dim**-0.5))


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"sinks": True}, "attention sinks"),
        ({"attention_chunk_size": 8192}, "chunked attention"),
        ({"model_type": "gpt_oss"}, "unsupported model_type 'gpt_oss'"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "unsupported rope type 'yarn'"),
        ({"hidden_act": "relu"}, "unsupported hidden_act 'relu'"),
    ],
)
def test_unsupported_is_refused_at_load(
    change: dict, needle: str, family_factory: Callable, tmp_path: Path
) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(family_factory("qwen3"), broken)
    (broken / "config.json").write_text(json.dumps(_cfg(broken) | change))
    with pytest.raises(ModelLoadError, match=needle) as e:
        DenseModel.from_pretrained(broken)
    assert "\n" not in str(e.value)


def test_moe_dispatch_equals_one_token_at_a_time(family_factory: Callable) -> None:
    """The step's tokens go to their experts in one batched dispatch; the result is each token's own."""
    model = DenseModel.from_pretrained(family_factory("qwen3_moe"))
    layer = model.layers[0]
    assert layer.experts is not None
    x = torch.randn(37, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    batched = model._moe(x, layer.experts)
    single = torch.cat([model._moe(x[i : i + 1], layer.experts) for i in range(x.shape[0])])
    assert torch.allclose(batched, single, atol=1e-5)
