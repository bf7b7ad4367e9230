"""fastdecode.tools.checkpoint: random-weight HF checkpoints that transformers loads, with a real BPE
tokenizer."""

from __future__ import annotations

import json
import math
import struct
import threading
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from tokenizers import Tokenizer

from fastdecode.runtime.errors import InvalidInput
from fastdecode.tools import checkpoint as ck

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

REPO = Path(__file__).resolve().parents[2]

TEXTS = [
    "Hello, world! The KV cache holds 1,234 tokens.",
    "def greedy_step(logits):\n    return int(logits.argmax(dim=-1))\n",
    "  two leading spaces, a\ttab and\n\nblank lines",
    "caf\u00e9 na\u00efve \u65e5\u672c\u8a9e \U0001f642 \u2014 I'll see; we've got 3.14159",
]


def _header(path: Path) -> dict:
    with open(path, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        return json.loads(fh.read(n))


def _n_params(path: Path) -> int:
    return sum(math.prod(v["shape"]) for k, v in _header(path).items() if k != "__metadata__")


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpt")
    return {arch: ck.make_model(arch, "tiny", root / arch) for arch in ck.ARCHS}


@pytest.mark.parametrize("arch", ck.ARCHS)
def test_transformers_loads_model_and_tokenizer(tiny_dirs, arch):
    d = tiny_dirs[arch]
    cfg = json.loads((d / "config.json").read_text())
    model, info = transformers.AutoModelForCausalLM.from_pretrained(d, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert type(model).__name__ == cfg["architectures"][0]
    assert model.config.model_type == arch
    assert model.config.vocab_size == cfg["vocab_size"] == 2048
    assert model.config.num_key_value_heads == cfg["num_key_value_heads"]
    assert model.config.rope_parameters["rope_theta"] == cfg["rope_theta"]
    assert model.generation_config.eos_token_id == ck.EOS_TOKEN_ID
    assert model.generation_config.do_sample is False

    tok = transformers.AutoTokenizer.from_pretrained(d)
    assert len(tok) == cfg["vocab_size"]
    assert tok.bos_token_id == cfg["bos_token_id"] == ck.BOS_TOKEN_ID
    assert tok.eos_token_id == cfg["eos_token_id"] == ck.EOS_TOKEN_ID
    assert tok.pad_token_id == cfg["pad_token_id"]
    assert tok.convert_ids_to_tokens([0, 1, 2]) == ["<s>", "</s>", "<pad>"]

    # The runtime tokenizes with the plain `tokenizers` library: it must agree with transformers.
    raw = Tokenizer.from_file(str(d / "tokenizer.json"))
    assert raw.get_vocab_size(with_added_tokens=True) == cfg["vocab_size"]
    for text in TEXTS:
        ids = tok(text).input_ids
        assert ids == raw.encode(text).ids
        assert ids[0] == ck.BOS_TOKEN_ID and ck.EOS_TOKEN_ID not in ids
        assert tok.decode(ids, skip_special_tokens=True) == text
        assert raw.decode(ids) == text
    # Byte-level: text never seen in training still round-trips, and merges were learned.
    assert len(tok("the attention layers").input_ids) < len("the attention layers") // 2


@pytest.mark.parametrize("arch", ck.ARCHS)
def test_greedy_generation_is_varied(tiny_dirs, arch):
    d = tiny_dirs[arch]
    model = transformers.AutoModelForCausalLM.from_pretrained(d).eval()
    tok = transformers.AutoTokenizer.from_pretrained(d)
    firsts = set()
    for prompt in ["The KV cache", "Hello, world! How are you?", "1 2 3 4"]:
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False)
        new = out[0, ids.shape[1] :].tolist()
        assert len(set(new)) >= 12, new
        firsts.add(tuple(new[:4]))
    assert len(firsts) == 3


def test_arch_specific_tensors(tiny_dirs):
    heads = {}
    for arch, d in tiny_dirs.items():
        cfg = json.loads((d / "config.json").read_text())
        hdr = _header(d / "model.safetensors")
        assert hdr["__metadata__"] == {"format": "pt"}
        assert all(v["dtype"] == "F32" for k, v in hdr.items() if k != "__metadata__")
        has_bias = "model.layers.0.self_attn.q_proj.bias" in hdr
        assert has_bias == (arch == "qwen2")
        assert ("lm_head.weight" in hdr) == (not cfg["tie_word_embeddings"])
        assert cfg["tie_word_embeddings"] == (arch == "qwen2")
        hd = cfg["head_dim"]
        assert hdr["model.layers.3.self_attn.k_proj.weight"]["shape"] == [
            cfg["num_key_value_heads"] * hd,
            256,
        ]
        assert hdr["model.layers.3.self_attn.q_proj.weight"]["shape"] == [
            cfg["num_attention_heads"] * hd,
            256,
        ]
        assert "model.layers.4.input_layernorm.weight" not in hdr
        moe = "model.layers.0.mlp.experts.7.down_proj.weight" in hdr
        assert moe == (arch == "qwen3_moe") == ("model.layers.0.self_attn.q_norm.weight" in hdr)
        assert ("model.layers.0.mlp.gate_proj.weight" in hdr) == (not moe)
        heads[arch] = (cfg["num_attention_heads"], cfg["num_key_value_heads"])
    assert heads == {"llama": (8, 8), "mistral": (8, 2), "qwen2": (8, 4), "qwen3_moe": (8, 4)}
    mistral = json.loads((tiny_dirs["mistral"] / "config.json").read_text())
    assert mistral["sliding_window"] is None
    assert json.loads((tiny_dirs["qwen2"] / "config.json").read_text())["rope_theta"] == 1e6
    # Norm weights are 1 + noise (not exactly 1) so norm bugs show.
    with safe_open(str(tiny_dirs["llama"] / "model.safetensors"), "pt") as f:
        w = f.get_tensor("model.norm.weight")
    assert 0.9 < float(w.mean()) < 1.1 and float(w.std()) > 0.05


def test_deterministic_files(tmp_path):
    a = ck.make_model("qwen2", "tiny", tmp_path / "a", seed=3)
    b = ck.make_model("qwen2", "tiny", tmp_path / "b", seed=3)
    c = ck.make_model("qwen2", "tiny", tmp_path / "c", seed=4)
    for name in ("model.safetensors", "tokenizer.json", "config.json", "tokenizer_config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
    assert (a / "tokenizer.json").read_bytes() == (c / "tokenizer.json").read_bytes()
    with (
        safe_open(str(a / "model.safetensors"), "pt") as fa,
        safe_open(str(c / "model.safetensors"), "pt") as fc,
    ):
        for name in ("model.embed_tokens.weight", "model.layers.2.mlp.down_proj.weight"):
            assert not torch.equal(fa.get_tensor(name), fc.get_tensor(name))


def test_small_preset_parameter_counts(tmp_path):
    d = ck.make_model("llama", "small", tmp_path / "small")
    n = _n_params(d / "model.safetensors")
    assert 100e6 < n < 150e6, n
    assert Tokenizer.from_file(str(d / "tokenizer.json")).get_vocab_size(with_added_tokens=True) == 8192
    assert json.loads((d / "config.json").read_text())["vocab_size"] == 8192
    # The other architectures, counted from the tensor plan without writing 0.5 GB each.
    for arch in ("mistral", "qwen2"):
        plan = ck._tensor_shapes(ck.build_config(arch, "small"))
        assert 100e6 < sum(math.prod(shape) for _, shape, _ in plan) < 150e6


def test_invalid_arguments(tmp_path):
    with pytest.raises(InvalidInput):
        ck.make_model("gpt2", "tiny", tmp_path / "x")
    with pytest.raises(InvalidInput):
        ck.make_model("llama", "huge", tmp_path / "x")


def test_default_model_dir_and_ensure(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("FASTDECODE_MODELS_DIR", raising=False)
    assert ck.default_model_dir() == tmp_path / ".models" / "tiny-llama"
    monkeypatch.setenv("FASTDECODE_MODELS_DIR", "models")
    target = tmp_path / "models" / "tiny-llama"
    assert ck.default_model_dir() == target

    # Two racing makers: both return the same complete directory, no temp dirs are left behind.
    results: list[Path] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            results.append(ck.ensure_default_model())
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and results == [target, target]
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == ["tiny-llama"]
    cfg = json.loads((target / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["hidden_size"] == 256

    # Idempotent: an existing model is not rewritten.
    mtime = (target / "model.safetensors").stat().st_mtime_ns
    assert ck.ensure_default_model() == target
    assert (target / "model.safetensors").stat().st_mtime_ns == mtime
