"""Random-weight checkpoints in HuggingFace layout, with a real byte-level BPE tokenizer.

`make_model(arch, preset, out)` writes a directory that `transformers.AutoModelForCausalLM`
and `AutoTokenizer` load offline: config.json, generation_config.json, model.safetensors
(fp32), tokenizer.json and tokenizer_config.json. The weights are random (seeded, so the same
arguments give byte-identical files); the tokenizer is trained on fastdecode/data/corpus.txt.

The runtime never imports transformers, and neither does this module: tensors are built with
torch and saved with safetensors, the tokenizer with the `tokenizers` library.

Vocabulary: ids 0/1/2 are <s>/</s>/<pad>; encoding prepends <s> (every arch). The corpus yields
about 3.5k BPE tokens, so tiny (2048) is all learned tokens while small (8192) is topped up with
~4.7k `<|reserved_N|>` special tokens; a random model emits those often, and decoding with
skip_special_tokens drops them.
"""

from __future__ import annotations

import functools
import json
import math
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastdecode.runtime.errors import InvalidInput, ModelLoadError

if TYPE_CHECKING:  # torch only where weights are built: `fastdecode up` checks a checkpoint without it
    import torch

ARCHS = ("llama", "mistral", "qwen2", "qwen3_moe")
PRESETS = ("tiny", "small")

CORPUS_PATH = Path(__file__).resolve().parents[1] / "data" / "corpus.txt"

BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
PAD_TOKEN = "<pad>"
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN)  # ids 0, 1, 2 (trained first, in this order)
BOS_TOKEN_ID = 0
EOS_TOKEN_ID = 1
PAD_TOKEN_ID = 2
RESERVED_TOKEN = "<|reserved_{}|>"

DEFAULT_ARCH = "llama"
DEFAULT_PRESET = "tiny"
DEFAULT_MODEL_NAME = "tiny-llama"

# Init scales, chosen so that every part of the network visibly moves the greedy outputs (an
# implementation bug in attention, RoPE, a norm or a bias changes the tokens) while fp32 logits stay
# far apart compared with rounding noise:
# - linear weights: std LINEAR_GAIN / sqrt(fan_in), so activations keep a unit-ish scale through
#   the stack (with a flat std 0.02 the tiny model's layers barely touch the residual stream and the
#   next token hardly depends on the context);
# - embedding: std 0.02 (also the tied LM head of qwen2; a wide embedding makes a tied model repeat
#   its last token forever);
# - RMSNorm weights: 1 + noise, so a missing or misplaced norm weight changes the outputs;
# - qwen2's q/k/v biases: large enough to matter.
LINEAR_GAIN = 1.5
EMBED_STD = 0.02
NORM_NOISE_STD = 0.1
BIAS_STD = 0.5


@dataclass(frozen=True)
class Preset:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


_PRESETS = {
    "tiny": Preset(
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=8,
        intermediate_size=688,
        vocab_size=2048,
        max_position_embeddings=1024,
    ),
    "small": Preset(
        hidden_size=768,
        num_hidden_layers=12,
        num_attention_heads=12,
        intermediate_size=3072,
        vocab_size=8192,
        max_position_embeddings=2048,
    ),
}

# kv heads = attention heads // divisor: llama MHA, mistral GQA 4:1, qwen2 and qwen3_moe GQA 2:1.
_KV_DIVISOR = {"llama": 1, "mistral": 4, "qwen2": 2, "qwen3_moe": 2}
_ARCH_CLASS = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}
_ROPE_THETA = {"llama": 10000.0, "mistral": 10000.0, "qwen2": 1000000.0, "qwen3_moe": 1000000.0}
# qwen3_moe: a mixture of experts shaped like Qwen3-30B-A3B (top-8 of 128 there): each expert's MLP
# is intermediate_size // MOE_EXPERT_DIVISOR wide, so the active MLP per token stays about the
# preset's dense one while the weights are MOE_EXPERTS / MOE_TOP_K times as many.
MOE_EXPERTS = 8
MOE_TOP_K = 2
MOE_EXPERT_DIVISOR = 2


def _check(arch: str, preset: str) -> Preset:
    if arch not in ARCHS:
        raise InvalidInput(f"unknown architecture {arch!r}; expected one of {ARCHS}")
    if preset not in PRESETS:
        raise InvalidInput(f"unknown preset {preset!r}; expected one of {PRESETS}")
    return _PRESETS[preset]


def build_config(arch: str, preset: str) -> dict:
    """The config.json contents for (arch, preset), as transformers 5.x expects them.

    rope_theta is written both at the top level (older readers, our own loader) and inside
    rope_parameters (where transformers 5 keeps it).
    """
    p = _check(arch, preset)
    kv_heads = p.num_attention_heads // _KV_DIVISOR[arch]
    theta = _ROPE_THETA[arch]
    cfg: dict = {
        "architectures": [_ARCH_CLASS[arch]],
        "model_type": arch,
        "hidden_size": p.hidden_size,
        "intermediate_size": p.intermediate_size,
        "num_hidden_layers": p.num_hidden_layers,
        "num_attention_heads": p.num_attention_heads,
        "num_key_value_heads": kv_heads,
        "head_dim": p.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        "max_position_embeddings": p.max_position_embeddings,
        "vocab_size": p.vocab_size,
        "tie_word_embeddings": arch == "qwen2",
        "bos_token_id": BOS_TOKEN_ID,
        "eos_token_id": EOS_TOKEN_ID,
        "pad_token_id": PAD_TOKEN_ID,
        "initializer_range": EMBED_STD,
        "attention_dropout": 0.0,
        "use_cache": True,
        "torch_dtype": "float32",
    }
    if arch == "llama":
        cfg["attention_bias"] = False
        cfg["mlp_bias"] = False
    elif arch == "mistral":
        cfg["sliding_window"] = None
    elif arch == "qwen3_moe":
        cfg |= {
            "attention_bias": False,
            "use_sliding_window": False,
            "sliding_window": None,
            "num_experts": MOE_EXPERTS,
            "num_experts_per_tok": MOE_TOP_K,
            "moe_intermediate_size": p.intermediate_size // MOE_EXPERT_DIVISOR,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
        }
        cfg["tie_word_embeddings"] = False
    else:  # qwen2: q/k/v biases are built into the architecture, no config switch
        cfg["use_sliding_window"] = False
        cfg["sliding_window"] = None
        cfg["max_window_layers"] = p.num_hidden_layers
    return cfg


def _tensor_shapes(cfg: dict) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, kind) for every tensor, in a fixed order; kind picks the init."""
    h = cfg["hidden_size"]
    inter = cfg["intermediate_size"]
    hd = cfg["head_dim"]
    q_out = cfg["num_attention_heads"] * hd
    kv_out = cfg["num_key_value_heads"] * hd
    qkv_bias = cfg["model_type"] == "qwen2"
    moe = cfg["model_type"] == "qwen3_moe"
    out: list[tuple[str, tuple[int, ...], str]] = [
        ("model.embed_tokens.weight", (cfg["vocab_size"], h), "embed")
    ]
    for i in range(cfg["num_hidden_layers"]):
        pre = f"model.layers.{i}."
        out.append((pre + "input_layernorm.weight", (h,), "norm"))
        out.append((pre + "self_attn.q_proj.weight", (q_out, h), "linear"))
        out.append((pre + "self_attn.k_proj.weight", (kv_out, h), "linear"))
        out.append((pre + "self_attn.v_proj.weight", (kv_out, h), "linear"))
        if qkv_bias:
            out.append((pre + "self_attn.q_proj.bias", (q_out,), "bias"))
            out.append((pre + "self_attn.k_proj.bias", (kv_out,), "bias"))
            out.append((pre + "self_attn.v_proj.bias", (kv_out,), "bias"))
        out.append((pre + "self_attn.o_proj.weight", (h, q_out), "linear"))
        if moe:
            out.append((pre + "self_attn.q_norm.weight", (hd,), "norm"))
            out.append((pre + "self_attn.k_norm.weight", (hd,), "norm"))
        out.append((pre + "post_attention_layernorm.weight", (h,), "norm"))
        if moe:
            e_inter = cfg["moe_intermediate_size"]
            out.append((pre + "mlp.gate.weight", (cfg["num_experts"], h), "linear"))
            for e in range(cfg["num_experts"]):
                out.append((pre + f"mlp.experts.{e}.gate_proj.weight", (e_inter, h), "linear"))
                out.append((pre + f"mlp.experts.{e}.up_proj.weight", (e_inter, h), "linear"))
                out.append((pre + f"mlp.experts.{e}.down_proj.weight", (h, e_inter), "linear"))
            continue
        out.append((pre + "mlp.gate_proj.weight", (inter, h), "linear"))
        out.append((pre + "mlp.up_proj.weight", (inter, h), "linear"))
        out.append((pre + "mlp.down_proj.weight", (h, inter), "linear"))
    out.append(("model.norm.weight", (h,), "norm"))
    if not cfg["tie_word_embeddings"]:
        out.append(("lm_head.weight", (cfg["vocab_size"], h), "linear"))
    return out


def _build_weights(cfg: dict, seed: int) -> dict[str, torch.Tensor]:
    import torch

    gen = torch.Generator(device="cpu")
    gen.manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, shape, kind in _tensor_shapes(cfg):
        t = torch.empty(shape, dtype=torch.float32)
        if kind == "embed":
            t.normal_(0.0, EMBED_STD, generator=gen)
        elif kind == "linear":
            t.normal_(0.0, LINEAR_GAIN / math.sqrt(shape[1]), generator=gen)
        elif kind == "bias":
            t.normal_(0.0, BIAS_STD, generator=gen)
        else:  # norm
            t.normal_(1.0, NORM_NOISE_STD, generator=gen)
        tensors[name] = t
    return tensors


# Same split regex as transformers' Qwen2Tokenizer (digits one by one, NFC first).
_QWEN2_SPLIT_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


@functools.lru_cache(maxsize=8)
def train_tokenizer(vocab_size: int, style: str = "bytelevel") -> str:
    """Train a byte-level BPE on the repo corpus; return tokenizer.json text with exactly vocab_size
    entries (learned tokens topped up with `<|reserved_N|>` special tokens).

    style "bytelevel": GPT-2 style ByteLevel pre-tokenizer (llama, mistral). style "qwen2": NFC
    normalizer + Qwen2's split regex + ByteLevel without regex, exactly what transformers'
    Qwen2Tokenizer rebuilds (transformers 5 forces that class for model_type qwen2, whatever
    tokenizer_config.json says), so transformers and the plain `tokenizers` library agree.

    Deterministic (checked: same bytes across processes and thread counts). Cached per argument.
    """
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )

    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise InvalidInput(f"vocab_size {vocab_size} is below the byte alphabet plus special tokens")
    text = CORPUS_PATH.read_text(encoding="utf-8")
    tok = Tokenizer(models.BPE())
    if style == "bytelevel":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    elif style == "qwen2":
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_QWEN2_SPLIT_REGEX), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:
        raise InvalidInput(f"unknown tokenizer style {style!r}")
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(text.splitlines(keepends=True), trainer)
    vocab = tok.get_vocab(with_added_tokens=True)
    for i, name in enumerate(SPECIAL_TOKENS):
        if vocab.get(name) != i:
            raise RuntimeError(f"special token {name!r} got id {vocab.get(name)}, expected {i}")
    n = tok.get_vocab_size(with_added_tokens=True)
    if n < vocab_size:
        tok.add_special_tokens(
            [AddedToken(RESERVED_TOKEN.format(i), special=True) for i in range(vocab_size - n)]
        )
    if tok.get_vocab_size(with_added_tokens=True) != vocab_size:
        got = tok.get_vocab_size(with_added_tokens=True)
        raise RuntimeError(f"tokenizer has {got} entries, want {vocab_size}")
    # Llama convention: encoding prepends <s>; no </s> is appended.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN}:1 $B:1",
        special_tokens=[(BOS_TOKEN, BOS_TOKEN_ID)],
    )
    return tok.to_str(pretty=True)


# ChatML (as Qwen's), opened with BOS like Llama's templates: the gateway renders it for
# /v1/chat/completions and encodes the result without adding special tokens again.
CHATML_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _tokenizer_config(max_len: int, chat_template: bool = True) -> dict:
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "add_bos_token": True,
        "add_eos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_len,
    }
    if chat_template:
        config["chat_template"] = CHATML_TEMPLATE
    return config


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n", encoding="utf-8")


def make_model(arch: str, preset: str, out: Path | str, seed: int = 0, chat_template: bool = True) -> Path:
    """Write a random-weight checkpoint for (arch, preset) into directory `out`; return it.

    chat_template: put a ChatML template in tokenizer_config.json (False: a model that cannot chat)."""
    cfg = build_config(arch, preset)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    from safetensors.torch import save_file

    tensors = _build_weights(cfg, seed)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    del tensors
    _write_json(out / "config.json", cfg)
    _write_json(
        out / "generation_config.json",
        {
            "bos_token_id": BOS_TOKEN_ID,
            "eos_token_id": EOS_TOKEN_ID,
            "pad_token_id": PAD_TOKEN_ID,
            "do_sample": False,
        },
    )
    style = "qwen2" if arch in ("qwen2", "qwen3_moe") else "bytelevel"
    (out / "tokenizer.json").write_text(train_tokenizer(cfg["vocab_size"], style), encoding="utf-8")
    _write_json(
        out / "tokenizer_config.json", _tokenizer_config(cfg["max_position_embeddings"], chat_template)
    )
    return out


def default_model_dir() -> Path:
    """Where the embedded default model (tiny llama) lives: $FASTDECODE_MODELS_DIR or ./.models."""
    from fastdecode.runtime.settings import LocalSettings  # the settings layer reads the environment

    return (LocalSettings().models_dir / DEFAULT_MODEL_NAME).resolve()


_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def ensure_model(arch: str, preset: str, target: Path) -> Path:
    """Make a checkpoint at `target` once if missing; idempotent and safe when processes race.

    The model is written to a private temp dir next to the target and renamed into place, so a
    reader never sees a half-written directory; the loser of a race discards its copy.
    """
    if all((target / f).is_file() for f in _REQUIRED_FILES):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.tmp-{os.getpid()}-{uuid.uuid4().hex}"
    try:
        make_model(arch, preset, tmp)
        try:
            os.rename(tmp, target)
        except OSError as e:
            # Someone else won the race (target now exists and is non-empty) -- or a stale,
            # incomplete directory is in the way.
            if not all((target / f).is_file() for f in _REQUIRED_FILES):
                raise ModelLoadError(f"{target} exists but is not a complete model; remove it") from e
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def ensure_default_model() -> Path:
    """The embedded default model (tiny llama), made on first use."""
    return ensure_model(DEFAULT_ARCH, DEFAULT_PRESET, default_model_dir())


# ---- checking a checkpoint before anything loads it ---------------------------------------------


def _safetensors_header(file: Path) -> dict[str, dict]:
    """A safetensors file's tensor table, checked against the file's size (no tensor is read)."""
    import struct

    try:
        size = file.stat().st_size
        with open(file, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ModelLoadError(f"{file} is truncated ({size} bytes)")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                raise ModelLoadError(f"{file} is truncated: its header claims {n} bytes, the file has {size}")
            header = json.loads(f.read(n))
    except OSError as e:
        raise ModelLoadError(f"cannot read {file}: {e}") from None
    except ValueError as e:
        raise ModelLoadError(f"{file} has a corrupt header: {e}") from None
    if not isinstance(header, dict):
        raise ModelLoadError(f"{file} has a corrupt header")
    header.pop("__metadata__", None)
    try:
        end = max((int(m["data_offsets"][1]) for m in header.values()), default=0)
    except (KeyError, TypeError, ValueError, IndexError):
        raise ModelLoadError(f"{file} has a corrupt header") from None
    if 8 + n + end > size:
        raise ModelLoadError(f"{file} is truncated: {size} bytes, its tensors need {8 + n + end}")
    return header


def expected_shapes(config: Any) -> dict[str, tuple[int, ...]]:
    """Shape of every tensor a ModelConfig needs (HuggingFace names; the names as
    fastdecode.model.dense.DenseModel.tensor_names lists them)."""
    c = config
    h, hd, inter = c.hidden_size, c.head_dim, c.intermediate_size
    q, kv = c.num_attention_heads * hd, c.num_key_value_heads * hd
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c.vocab_size, h)}
    out["model.norm.weight"] = (h,)
    if not c.tie_word_embeddings:
        out["lm_head.weight"] = (c.vocab_size, h)
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        out |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)}
        if c.gemma_norms:
            out |= {
                p + "pre_feedforward_layernorm.weight": (h,),
                p + "post_feedforward_layernorm.weight": (h,),
            }
        out[p + "self_attn.o_proj.weight"] = (h, q)
        if c.fused_projections:
            out[p + "self_attn.qkv_proj.weight"] = (q + 2 * kv, h)
        else:
            out[p + "self_attn.q_proj.weight"] = (q, h)
            out |= {p + f"self_attn.{n}_proj.weight": (kv, h) for n in "kv"}
        if c.qk_norm == "head":
            out |= {p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)}
        elif c.qk_norm == "full":
            out |= {p + "self_attn.q_norm.weight": (q,), p + "self_attn.k_norm.weight": (kv,)}
        if c.moe is not None and c.moe.layers[i]:
            e_inter = c.moe.intermediate_size
            block, gate, up, down = (
                ("block_sparse_moe.", "w1", "w3", "w2")
                if c.moe.naming == "mixtral"
                else ("mlp.", "gate_proj", "up_proj", "down_proj")
            )
            out[p + block + "gate.weight"] = (c.moe.num_experts, h)
            for e in range(c.moe.num_experts):
                x = f"{p}{block}experts.{e}."
                out |= {x + f"{gate}.weight": (e_inter, h), x + f"{up}.weight": (e_inter, h)}
                out[x + f"{down}.weight"] = (h, e_inter)
        elif c.fused_projections:
            out |= {p + "mlp.gate_up_proj.weight": (2 * inter, h), p + "mlp.down_proj.weight": (h, inter)}
        else:
            out |= {p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h)}
            out[p + "mlp.down_proj.weight"] = (h, inter)
        if c.qkv_bias:
            out |= {p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,)}
            out[p + "self_attn.v_proj.bias"] = (kv,)
        if c.o_bias:
            out[p + "self_attn.o_proj.bias"] = (h,)
        if c.mlp_bias:
            out |= {p + "mlp.gate_proj.bias": (inter,), p + "mlp.up_proj.bias": (inter,)}
            out[p + "mlp.down_proj.bias"] = (h,)
    return out


def check_checkpoint(path: str | Path) -> Path:
    """Raise ModelLoadError naming the first problem of checkpoint directory `path`, or return it.

    Reads config.json, tokenizer.json and the safetensors headers (not the tensors): a missing file,
    a truncated or corrupt safetensors file, config values the tensors contradict, a tokenizer that
    does not load. Cheap enough to run before starting services, so a user gets one clear line
    rather than a service dying in its log."""
    from tokenizers import Tokenizer as _HFTokenizer

    from fastdecode.model.config import ModelConfig

    path = Path(path)
    if not path.exists():
        raise ModelLoadError(f"no such model directory: {path}")
    if not path.is_dir():
        raise ModelLoadError(f"{path} is not a checkpoint directory")
    config = ModelConfig.from_pretrained(path)
    tok_file = path / "tokenizer.json"
    if not tok_file.is_file():
        raise ModelLoadError(f"no tokenizer.json in {path}")
    try:
        _HFTokenizer.from_file(str(tok_file))
    except Exception as e:  # the tokenizers library raises a bare Exception on bad JSON
        raise ModelLoadError(f"{tok_file} does not load: {e}") from None
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ModelLoadError(f"cannot read {index}: {e}") from None
    elif (path / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise ModelLoadError(f"no model.safetensors or model.safetensors.index.json in {path}")
    shapes: dict[str, tuple[int, ...]] = {}
    for name in files:
        file = path / name
        if not file.is_file():
            raise ModelLoadError(f"checkpoint shard {file} is missing")
        for tensor, meta in _safetensors_header(file).items():
            shapes[tensor] = tuple(int(d) for d in meta.get("shape", ()))
    for tensor, want in expected_shapes(config).items():
        if tensor not in shapes:
            raise ModelLoadError(f"checkpoint {path} is missing tensor {tensor!r}")
        if shapes[tensor] != want:
            raise ModelLoadError(
                f"tensor {tensor!r} has shape {list(shapes[tensor])} but config.json implies {list(want)}"
            )
    return path
