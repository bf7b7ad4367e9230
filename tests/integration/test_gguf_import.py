"""fastdecode.tools.gguf_import: GGUF files imported as checkpoints, against the source checkpoint and
against transformers' own GGUF loader on the real model (SmolLM2-135M-Instruct)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer as HFTokenizer

from fastdecode.contract import SamplingParams
from fastdecode.dense.engine import LocalEngine
from fastdecode.runtime.errors import ModelLoadError
from fastdecode.runtime.tokenizer import Tokenizer
from fastdecode.tools.gguf_import import cached_import, import_gguf, unpermute_rotary
from tests.support.gguf import CHAT_QUESTIONS, hf_chat_greedy, llama_cpp_permute, write_gguf

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("heads", [1, 3, 9])
def test_unpermute_inverts_llama_cpp_permute(heads):
    w = np.random.default_rng(0).standard_normal((heads * 8, 5)).astype(np.float32)
    back = unpermute_rotary(torch.from_numpy(llama_cpp_permute(w, heads)), heads)
    assert torch.equal(back, torch.from_numpy(w))
    assert not np.array_equal(llama_cpp_permute(w, heads), w)  # it does move rows


# ---- round trip: checkpoint -> GGUF (as llama.cpp writes it) -> import ------------------------


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
def test_round_trip_is_exact(arch, model_factory, tmp_path):
    src = model_factory(arch)
    out = import_gguf(write_gguf(src, tmp_path / "m.gguf"), tmp_path / "imported")
    want, got = load_file(str(src / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert set(got) == set(want)
    for name, t in want.items():
        assert torch.equal(got[name], t), name  # F32 in, F32 out, rows un-permuted
    c_src = json.loads((src / "config.json").read_text())
    c_out = json.loads((out / "config.json").read_text())
    for key in (
        "model_type",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rms_norm_eps",
        "rope_theta",
        "vocab_size",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "max_position_embeddings",
    ):
        assert c_out[key] == pytest.approx(c_src[key]), key
    a, b = Tokenizer.from_pretrained(src), Tokenizer.from_pretrained(out)
    lines = (REPO / "fastdecode" / "data" / "corpus.txt").read_text(encoding="utf-8").splitlines()[:200]
    for line in lines + ["<s> a </s> b <pad>", "<|reserved_3|>x"]:
        assert b.encode(line) == a.encode(line), line
    # The imported model generates exactly what the source does.
    prompt = a.encode("The KV cache")
    gens = [
        LocalEngine.from_pretrained(d).generate([prompt], 8, SamplingParams())[0].token_ids
        for d in (src, out)
    ]
    assert gens[0] == gens[1]
    template = json.loads((out / "tokenizer_config.json").read_text())["chat_template"]
    assert template == json.loads((src / "tokenizer_config.json").read_text())["chat_template"]


def test_bfloat16_import(model_factory, tmp_path):
    src = model_factory("llama")
    out = import_gguf(write_gguf(src, tmp_path / "m.gguf"), tmp_path / "bf16", dtype="bfloat16")
    got = load_file(str(out / "model.safetensors"))
    want = load_file(str(src / "model.safetensors"))
    assert all(t.dtype == torch.bfloat16 for t in got.values())
    assert torch.equal(got["model.norm.weight"], want["model.norm.weight"].to(torch.bfloat16))


def test_cached_import_once(model_factory, tmp_path, monkeypatch):
    monkeypatch.setenv("FASTDECODE_MODELS_DIR", str(tmp_path / "cache"))
    file = write_gguf(model_factory("llama"), tmp_path / "m.gguf")
    first = cached_import(file)
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert cached_import(file) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp  # not imported twice


def test_unsupported_gguf_errors_name_the_cause(model_factory, tmp_path):
    src = model_factory("llama")
    with pytest.raises(ModelLoadError, match="unsupported GGUF architecture 'gpt2'"):
        import_gguf(write_gguf(src, tmp_path / "a.gguf", arch="gpt2"), tmp_path / "a")
    with pytest.raises(ModelLoadError, match="unsupported pre-tokenizer 'tekken'"):
        import_gguf(write_gguf(src, tmp_path / "b.gguf", pre="tekken"), tmp_path / "b")
    good = write_gguf(src, tmp_path / "c.gguf").read_bytes()
    (tmp_path / "t.gguf").write_bytes(good[: len(good) // 2])
    with pytest.raises(ModelLoadError, match="not a readable GGUF"):
        import_gguf(tmp_path / "t.gguf", tmp_path / "t")
    (tmp_path / "x.gguf").write_bytes(b"not a gguf at all")
    with pytest.raises(ModelLoadError, match="not a readable GGUF"):
        import_gguf(tmp_path / "x.gguf", tmp_path / "x")
    with pytest.raises(ModelLoadError, match="no such GGUF file"):
        import_gguf(tmp_path / "missing.gguf", tmp_path / "m")


# ---- the real model against transformers' GGUF loader -----------------------------------------


@pytest.mark.timeout(900)  # transformers' GGUF loader takes minutes on a small CI machine
def test_real_config_matches_transformers(smollm2, smollm2_hf):
    hf = smollm2_hf[0].config
    ours = json.loads((smollm2 / "config.json").read_text())
    assert ours["model_type"] == hf.model_type == "llama"
    for key in (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "vocab_size",
        "tie_word_embeddings",
        "max_position_embeddings",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
    ):
        assert ours[key] == getattr(hf, key), key
    assert ours["rms_norm_eps"] == pytest.approx(hf.rms_norm_eps)
    assert ours["rope_parameters"]["rope_theta"] == hf.rope_parameters["rope_theta"] == 100000.0
    assert (ours["num_hidden_layers"], ours["hidden_size"], ours["vocab_size"]) == (30, 576, 49152)


def _strings() -> list[str]:
    """A few hundred strings: corpus lines, unicode, digits, whitespace runs, special tokens."""
    rng = random.Random(0)
    lines = (REPO / "fastdecode" / "data" / "corpus.txt").read_text(encoding="utf-8").splitlines()
    pieces = [
        "caf\u00e9",
        "na\u00efve",
        "\u65e5\u672c\u8a9e",
        "\U0001f642",
        "\u2014",
        "\u00dcber",
        "\u0645\u0631\u062d\u0628\u0627",
        "\u043f\u0440\u0438\u0432\u0435\u0442",
        "12345",
        "3.14159",
        "1,000,000",
        "  ",
        "\t",
        "\n\n",
        "I'll",
        "we've",
        "<|im_start|>",
        "<|im_end|>",
        "<|endoftext|>",
        "x=y+1;",
        "    def f():",
        "e\u0301",
    ]
    out = [line for line in lines if line.strip()][:150]
    out += pieces
    for _ in range(150):
        out.append(
            "".join(rng.choice(pieces + ["the", " ", "KV", "cache", "."]) for _ in range(rng.randint(1, 8)))
        )
    return out


@pytest.mark.timeout(900)  # transformers' GGUF loader takes minutes on a small CI machine
def test_real_tokenizer_matches_transformers(smollm2, smollm2_hf):
    """Same ids and text as transformers' GGUF tokenizer, except where it ignores `smollm`.

    tokenizer.ggml.pre "smollm" means: split every digit apart, then the GPT-2 regex (llama.cpp's
    LLAMA_VOCAB_PRE_TYPE_SMOLLM; SmolLM2's own tokenizer.json: Digits + ByteLevel). transformers'
    GGUF loader has no entry for it and uses the GPT-2 regex alone, which groups a whitespace run
    before a digit differently ("a  \n1"). So the oracle is transformers' tokenizer with that
    pre-tokenizer set, and plain transformers must agree wherever no whitespace precedes a digit."""
    import copy
    import re

    from tokenizers import pre_tokenizers

    ours, hf = Tokenizer.from_pretrained(smollm2), smollm2_hf[1]
    smollm = copy.deepcopy(hf)
    smollm.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    strings = _strings()
    assert len(strings) >= 300
    differ = 0
    for s in strings:
        ids = ours.encode(s)
        assert ids == smollm.encode(s), s
        assert ours.encode(s, add_special_tokens=False) == smollm.encode(s, add_special_tokens=False), s
        if ids != hf.encode(s):
            differ += 1
            assert re.search(r"\s\d", s), s
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True), s
        assert ours.decode(ids, skip_special_tokens=False) == hf.decode(ids), s
    assert differ < len(strings) // 4
    assert ours.vocab_size == len(hf) == 49152
    cfg = json.loads((smollm2 / "tokenizer_config.json").read_text())
    assert cfg["chat_template"] == hf.chat_template
    assert (cfg["bos_token"], cfg["eos_token"]) == (hf.bos_token, hf.eos_token)
    assert (cfg["bos_token"], cfg["eos_token"]) == ("<|im_start|>", "<|im_end|>")


@pytest.mark.timeout(900)  # transformers' GGUF loader takes minutes on a small CI machine
def test_real_greedy_matches_transformers(smollm2, smollm2_hf):
    engine = LocalEngine.from_pretrained(smollm2)
    for question in CHAT_QUESTIONS[:2]:
        prompt, want = hf_chat_greedy(smollm2_hf, question, 12)
        got = engine.generate([prompt], 12, SamplingParams())[0].token_ids
        assert got == want, question
    prompt, _ = hf_chat_greedy(smollm2_hf, CHAT_QUESTIONS[0], 1)
    answer = engine.generate([prompt], 16, SamplingParams())[0].token_ids
    assert "Paris" in Tokenizer.from_pretrained(smollm2).decode(answer)


def test_import_gguf_command(model_factory, tmp_path):
    file = write_gguf(model_factory("qwen2"), tmp_path / "q.gguf")
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "fastdecode.cli", "import-gguf", str(file), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr
    assert Path(proc.stdout.strip()) == out
    assert HFTokenizer.from_file(str(out / "tokenizer.json")).get_vocab_size() == 2048
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32
    )  # loads as any checkpoint
    assert hf.config.model_type == "qwen2"
