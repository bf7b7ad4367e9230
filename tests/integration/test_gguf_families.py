"""GGUF import beyond Llama: a Qwen3 file (q/k norms, no Q/K permutation) equals transformers on
the checkpoint it was written from, and a Llama file with linear RoPE scaling loads with that scaling."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from fastdecode.dense.engine import LocalEngine
from fastdecode.tools.gguf_import import import_gguf
from tests.support import PROMPTS
from tests.support.gguf import write_gguf

pytestmark = pytest.mark.filterwarnings("ignore")


def test_qwen3_gguf_equals_transformers(
    family_factory: Callable, hf_greedy: Callable, tmp_path: Path
) -> None:
    """Against transformers on the checkpoint the file was written from (its GGUF loader assumes
    Qwen3's head_dim 128, which a tiny model does not have); llama.cpp's qwen3 has no window, so
    the source is made full-attention first."""
    src = tmp_path / "src"
    shutil.copytree(family_factory("qwen3"), src)
    cfg = json.loads((src / "config.json").read_text())
    layers = cfg["num_hidden_layers"]
    cfg |= {"use_sliding_window": False, "sliding_window": None, "layer_types": ["full_attention"] * layers}
    (src / "config.json").write_text(json.dumps(cfg))
    out = import_gguf(write_gguf(src, tmp_path / "qwen3.gguf"), tmp_path / "imported")
    assert json.loads((out / "config.json").read_text())["model_type"] == "qwen3"
    ours = LocalEngine.from_pretrained(out).generate(PROMPTS, max_tokens=16)
    for prompt, gen in zip(PROMPTS, ours, strict=True):
        assert gen.token_ids == hf_greedy(src, tuple(prompt), 16), len(prompt)


def test_linear_rope_scaling_is_loaded(model_factory: Callable, hf_greedy: Callable, tmp_path: Path) -> None:
    file = write_gguf(model_factory("llama"), tmp_path / "scaled.gguf", rope_scaling=("linear", 4.0))
    out = import_gguf(file, tmp_path / "imported")
    rope = json.loads((out / "config.json").read_text())["rope_parameters"]
    assert rope["rope_type"] == "linear" and rope["factor"] == 4.0
    ours = LocalEngine.from_pretrained(out).generate(PROMPTS, max_tokens=12)
    plain = LocalEngine.from_pretrained(model_factory("llama")).generate(PROMPTS, max_tokens=12)
    assert [g.token_ids for g in ours] != [g.token_ids for g in plain], "the scaling changed nothing"
    for prompt, gen in zip(PROMPTS, ours, strict=True):
        assert gen.token_ids == hf_greedy(out, tuple(prompt), 12), len(prompt)


def test_yarn_is_refused_by_name(model_factory: Callable, tmp_path: Path) -> None:
    from fastdecode.runtime.errors import ModelLoadError

    file = write_gguf(model_factory("llama"), tmp_path / "yarn.gguf", rope_scaling=("yarn", 4.0))
    with pytest.raises(ModelLoadError, match="unsupported RoPE scaling 'yarn'"):
        import_gguf(file, tmp_path / "imported")
