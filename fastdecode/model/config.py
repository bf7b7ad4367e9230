"""Model configuration read from a HuggingFace checkpoint directory (config.json).

Supports model_type llama, mistral, qwen2, qwen3, gemma2, gemma3_text, phi3, mixtral, qwen3_moe and
olmoe, with every key read in its classic spelling (rope_theta + rope_scaling, sliding_window_pattern,
rope_local_base_freq, num_experts) and in transformers 5's (rope_parameters, per layer type for
Gemma 3; layer_types; num_local_experts). A key naming a feature none of them implements (attention
sinks, chunked attention) is refused at load.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastdecode.runtime.errors import InvalidInput, ModelLoadError
from fastdecode.runtime.geometry import KVGeometry


@dataclass(frozen=True)
class Family:
    """What a model family does differently, as data: config.json's keys are read alike for all
    (ModelConfig.from_dict), and these traits say what a family makes of them."""

    gemma: bool = False  # (1 + w) norms, sandwich norms, sqrt(hidden) embeddings, soft-caps, tied
    qkv_bias: bool = False  # q, k, v biases always (Qwen2), whatever attention_bias says
    o_bias: bool = False  # attention_bias biases o too (Llama, Gemma)
    mlp_bias: bool = False  # the MLP's bias from mlp_bias (Llama)
    qk_norm: str = ""  # "head" | "full" (see ModelConfig.qk_norm)
    clip_qkv: bool = False  # OLMoE's clip_qkv
    fused: bool = False  # Phi-3's qkv_proj and gate_up_proj
    window_switch: bool = False  # a window only with use_sliding_window (the Qwen families)
    # Where a classic config (no layer_types) puts its windows: "from_layer" (max_window_layers on),
    # "pattern" (all but every window_pattern-th layer), "" (every layer)
    classic_windows: str = ""
    window_pattern: int = 0
    moe: str = ""  # "" | "mixtral" (block_sparse_moe naming, top-k renormalized) | "mlp" (mlp.experts)
    sparse_step: bool = False  # decoder_sparse_step, mlp_only_layers, moe_intermediate_size (Qwen3-MoE)
    local_rope: bool = False  # window layers have a RoPE of their own (Gemma 3)


FAMILIES: dict[str, Family] = {
    "llama": Family(o_bias=True, mlp_bias=True),
    "mistral": Family(),
    "qwen2": Family(qkv_bias=True, window_switch=True, classic_windows="from_layer"),
    "qwen3": Family(qk_norm="head", window_switch=True, classic_windows="from_layer"),
    "gemma2": Family(gemma=True, o_bias=True, classic_windows="pattern", window_pattern=2),
    "gemma3_text": Family(
        gemma=True, o_bias=True, qk_norm="head", classic_windows="pattern", window_pattern=6, local_rope=True
    ),
    "phi3": Family(fused=True),
    "mixtral": Family(moe="mixtral"),
    "qwen3_moe": Family(qk_norm="head", window_switch=True, moe="mlp", sparse_step=True),
    "olmoe": Family(qk_norm="full", clip_qkv=True, moe="mlp"),
}
SUPPORTED_MODEL_TYPES = tuple(FAMILIES)
_UNSUPPORTED_KEYS = {
    "sinks": "attention sinks",
    "attention_sinks": "attention sinks",
    "attention_chunk_size": "chunked attention",
    "use_bidirectional_attention": "bidirectional attention",
    "shared_expert_intermediate_size": "shared experts",
    "n_shared_experts": "shared experts",
}
_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"  # default | linear | llama3 | longrope
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # longrope (Phi-3 long-context): per-frequency divisors below / from original_max_position_embeddings
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0  # cos/sin scale
    rotary_dim: int = 0  # rotated dims of a head (partial_rotary_factor); 0 = all


@dataclass(frozen=True)
class MoEConfig:
    """A router's top-k over experts in the MLP (Mixtral, Qwen3-MoE, OLMoE)."""

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool
    layers: tuple[bool, ...]  # per layer: sparse (True) or a dense MLP
    naming: str  # "mixtral": block_sparse_moe.experts.N.w1/w3/w2; "mlp": mlp.experts.N.gate/up/down_proj


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    vocab_size: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    # Per layer: the sliding window in tokens (a query sees itself and the window-1 tokens before
    # it, as transformers' sliding mask does); 0 = full attention; () = full everywhere.
    layer_windows: tuple[int, ...] = ()
    # Attention scores are (q . k) * head_dim**-0.5, then softcap * tanh(score / softcap); 0 = none.
    attn_logit_softcap: float = 0.0
    final_logit_softcap: float = 0.0
    # RoPE of window layers when it differs from `rope` (Gemma 3: base 10k local, 1M global).
    rope_local: RopeConfig | None = None
    qk_norm: str = ""  # "" | "head" (Qwen3, Gemma 3: per head) | "full" (OLMoE: the whole projection)
    gemma_norms: bool = False  # RMSNorm weight as (1 + w); norms after attention and around the MLP
    hidden_act: str = "silu"
    embed_scale: float = 1.0  # Gemma: embeddings times sqrt(hidden)
    # Folded into q so that the shards' head_dim**-0.5 gives the model's own scale (Gemma's
    # query_pre_attn_scalar**-0.5).
    query_scale: float = 1.0
    clip_qkv: float = 0.0  # OLMoE: clamp q, k, v to [-clip, clip]; 0 = none
    fused_projections: bool = False  # Phi-3: qkv_proj and gate_up_proj
    moe: MoEConfig | None = None

    @property
    def kv_geometry(self) -> KVGeometry:
        return KVGeometry(
            self.num_hidden_layers,
            self.num_key_value_heads,
            self.head_dim,
            self.layer_windows,
            self.attn_logit_softcap,
        )

    def kv_bytes_per_token(self, itemsize: int) -> int:
        return self.kv_geometry.bytes_per_token(itemsize)

    def window(self, layer: int) -> int:
        return self.layer_windows[layer] if self.layer_windows else 0

    def rope_for(self, layer: int) -> RopeConfig:
        return self.rope_local if self.rope_local is not None and self.window(layer) else self.rope

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], generation: dict[str, Any] | None = None) -> ModelConfig:
        model_type = cfg.get("model_type")
        if model_type == "gemma3" and isinstance(cfg.get("text_config"), dict):
            raise ModelLoadError(
                "unsupported model_type 'gemma3' (the multimodal model); load its text model (gemma3_text)"
            )
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelLoadError(
                f"unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        for key, feature in _UNSUPPORTED_KEYS.items():
            if cfg.get(key):
                raise ModelLoadError(f"unsupported feature: {feature} ({key} in config.json)")
        try:
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            kv_heads = int(cfg.get("num_key_value_heads") or heads)
            if heads <= 0:
                raise ModelLoadError(f"config.json: num_attention_heads must be positive, got {heads}")
            head_dim = int(cfg.get("head_dim") or hidden // heads)
            for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size"):
                if int(cfg[name]) <= 0:
                    raise ModelLoadError(f"config.json: {name} must be positive, got {cfg[name]}")
            if heads <= 0 or kv_heads <= 0 or head_dim <= 0 or head_dim % 2:
                raise ModelLoadError(
                    f"config.json: bad attention: heads {heads}, kv heads {kv_heads}, head_dim {head_dim}"
                )
            if heads % kv_heads:
                raise ModelLoadError(f"num_attention_heads {heads} not divisible by kv heads {kv_heads}")
            layers = int(cfg["num_hidden_layers"])
            fam = FAMILIES[model_type]
            gemma = fam.gemma
            act = str(cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu")
            if gemma and act == "gelu":  # old Gemma configs say gelu and mean the tanh form
                act = "gelu_pytorch_tanh"
            if act not in _ACTIVATIONS:
                raise ModelLoadError(f"unsupported hidden_act {act!r}; supported: {', '.join(_ACTIVATIONS)}")
            attention_bias = bool(cfg.get("attention_bias", False))
            eos = _ids(cfg.get("eos_token_id")) + _ids((generation or {}).get("eos_token_id"))
            bos = cfg.get("bos_token_id", (generation or {}).get("bos_token_id"))
            windows = _layer_windows(fam, cfg, layers)
            rope, rope_local = _ropes(fam, cfg, head_dim)
            scalar = float(cfg.get("query_pre_attn_scalar") or head_dim) if gemma else float(head_dim)
            return cls(
                model_type=model_type,
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_hidden_layers=layers,
                num_attention_heads=heads,
                num_key_value_heads=kv_heads,
                head_dim=head_dim,
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope=rope,
                max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
                vocab_size=int(cfg["vocab_size"]),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", gemma)),
                # Qwen2 always has q/k/v bias and no o bias; Llama's attention_bias covers all four.
                qkv_bias=fam.qkv_bias or attention_bias,
                o_bias=fam.o_bias and attention_bias,
                mlp_bias=fam.mlp_bias and bool(cfg.get("mlp_bias", False)),
                bos_token_id=int(bos) if bos is not None else None,
                eos_token_ids=tuple(dict.fromkeys(eos)),
                layer_windows=windows,
                attn_logit_softcap=float(cfg.get("attn_logit_softcapping") or 0.0) if gemma else 0.0,
                final_logit_softcap=float(cfg.get("final_logit_softcapping") or 0.0) if gemma else 0.0,
                rope_local=rope_local,
                qk_norm=fam.qk_norm,
                gemma_norms=gemma,
                hidden_act=act,
                embed_scale=math.sqrt(hidden) if gemma else 1.0,
                query_scale=math.sqrt(head_dim / scalar),
                clip_qkv=float(cfg.get("clip_qkv") or 0.0) if fam.clip_qkv else 0.0,
                fused_projections=fam.fused,
                moe=_moe(fam, cfg, layers),
            )
        except KeyError as e:
            raise ModelLoadError(f"config.json lacks required field {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:  # e.g. "hidden_size": "big" or null
            raise ModelLoadError(f"config.json has a value of the wrong type: {e}") from None

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise ModelLoadError(f"no config.json in {path}")
        cfg = _read_json(cfg_file)
        gen_file = path / "generation_config.json"
        gen = _read_json(gen_file) if gen_file.is_file() else None
        return cls.from_dict(cfg, gen)


def _layer_windows(fam: Family, cfg: dict[str, Any], layers: int) -> tuple[int, ...]:
    """Per-layer sliding windows as transformers applies them, from either spelling of the config."""
    window = int(cfg.get("sliding_window") or 0)
    if fam.window_switch and not cfg.get("use_sliding_window", False):
        window = 0
    if window <= 0:
        return ()
    types = cfg.get("layer_types")
    if fam.classic_windows and types is None:
        if fam.classic_windows == "from_layer":  # classic Qwen: window on layers from max_window_layers on
            first = int(cfg.get("max_window_layers", 28))
            types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
        else:  # classic Gemma: every layer but each pattern-th (2 for Gemma 2, 6 for Gemma 3)
            pattern = int(cfg.get("sliding_window_pattern") or fam.window_pattern)
            types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    if types is None:  # mistral, mixtral, phi3, qwen3_moe: one window on every layer
        return (window,) * layers
    if not isinstance(types, list) or len(types) != layers:
        raise ModelLoadError(f"config.json: layer_types must list {layers} layers")
    unknown = sorted({t for t in types if t not in ("sliding_attention", "full_attention")})
    if unknown:
        raise ModelLoadError(f"unsupported layer type {unknown[0]!r} in layer_types")
    out = tuple(window if t == "sliding_attention" else 0 for t in types)
    return out if any(out) else ()


def _moe(fam: Family, cfg: dict[str, Any], layers: int) -> MoEConfig | None:
    if not fam.moe:
        return None
    # transformers 5 writes num_local_experts for every family; classic Qwen3-MoE and OLMoE num_experts.
    experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0)
    top_k = int(cfg.get("num_experts_per_tok") or 0)
    if experts <= 0 or not 0 < top_k <= experts:
        raise ModelLoadError(f"config.json: bad experts: {experts} experts, top-k {top_k}")
    if fam.sparse_step:
        step = int(cfg.get("decoder_sparse_step") or 1)
        dense = set(cfg.get("mlp_only_layers") or [])
        sparse = tuple(i not in dense and (i + 1) % step == 0 for i in range(layers))
        inter = int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"])
    else:
        sparse, inter = (True,) * layers, int(cfg["intermediate_size"])
    return MoEConfig(
        num_experts=experts,
        top_k=top_k,
        intermediate_size=inter,
        norm_topk_prob=fam.moe == "mixtral" or bool(cfg.get("norm_topk_prob", False)),
        layers=sparse,
        naming=fam.moe,
    )


def _read_json(file: Path) -> dict[str, Any]:
    try:
        obj = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ModelLoadError(f"cannot read {file}: {e}") from None
    if not isinstance(obj, dict):
        raise ModelLoadError(f"{file} is not a JSON object")
    return obj


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, list):
        return [int(v) for v in value]
    return [int(value)]


_ROPE_TYPES = ("default", "linear", "llama3", "longrope")


def _ropes(fam: Family, cfg: dict[str, Any], head_dim: int) -> tuple[RopeConfig, RopeConfig | None]:
    """(RoPE of full-attention layers, RoPE of window layers when it differs)."""
    params = cfg.get("rope_parameters") or {}
    if not fam.local_rope:
        return _rope(cfg, params, cfg.get("rope_scaling") or {}, head_dim), None
    # Gemma 3: transformers 5 keeps one parameter set per layer type; classic configs say rope_theta
    # (global, default 1M), rope_local_base_freq (default 10k) and rope_scaling (global layers only).
    if "full_attention" in params or "sliding_attention" in params:
        full = params.get("full_attention") or {"rope_theta": 1_000_000.0}
        local = params.get("sliding_attention") or {"rope_theta": 10_000.0}
        return _rope(cfg, full, {}, head_dim), _rope(cfg, local, {}, head_dim)
    full = {"rope_theta": cfg.get("rope_theta", 1_000_000.0), **(cfg.get("rope_scaling") or {})}
    local = {"rope_theta": cfg.get("rope_local_base_freq", 10_000.0)}
    return _rope(cfg, full, {}, head_dim), _rope(cfg, local, {}, head_dim)


def _rope(cfg: dict[str, Any], params: dict[str, Any], scaling: dict[str, Any], head_dim: int) -> RopeConfig:
    # transformers 5 writes rope_parameters (theta inside); older configs use rope_theta + rope_scaling.
    merged = {**scaling, **params}
    theta = float(merged.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = merged.get("rope_type", merged.get("type", "default")) or "default"
    if rope_type == "su":  # Phi-3's first long-context configs
        rope_type = "longrope"
    if rope_type not in _ROPE_TYPES:
        raise ModelLoadError(f"unsupported rope type {rope_type!r}; supported: {', '.join(_ROPE_TYPES)}")
    partial = float(merged.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)) or 1.0)
    rotary_dim = int(head_dim * partial)
    if rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > head_dim:
        raise ModelLoadError(f"config.json: bad partial_rotary_factor {partial} for head_dim {head_dim}")
    max_pos = int(cfg.get("max_position_embeddings", 8192))
    original = int(
        merged.get("original_max_position_embeddings", cfg.get("original_max_position_embeddings", max_pos))
    )
    factor = float(merged.get("factor", 1.0) or 1.0)
    short: tuple[float, ...] = ()
    long: tuple[float, ...] = ()
    attention_factor = 1.0
    if rope_type == "longrope":
        short = tuple(float(x) for x in merged["short_factor"])
        long = tuple(float(x) for x in merged["long_factor"])
        if len(short) != rotary_dim // 2 or len(long) != rotary_dim // 2:
            raise ModelLoadError(f"config.json: longrope factors must have {rotary_dim // 2} entries")
        if "factor" not in merged:  # transformers: the context extension when the config has none
            factor = max_pos / original
        attention_factor = merged.get("attention_factor")
        if attention_factor is None:
            attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return RopeConfig(
        theta=theta,
        rope_type=rope_type,
        factor=factor,
        low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
        high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=original,
        short_factor=short,
        long_factor=long,
        attention_factor=float(attention_factor),
        rotary_dim=rotary_dim if rotary_dim != head_dim else 0,
    )


def check_tensor_parallel(config: ModelConfig, world: int) -> None:
    """One line where `world` ranks cannot split this model's heads, MLP or norms (here, torch-free:
    `fastdecode up` checks it before any service starts)."""
    if world <= 1:
        return
    c = config
    inter = c.moe.intermediate_size if c.moe is not None else c.intermediate_size
    for what, n in (
        ("attention heads", c.num_attention_heads),
        ("key-value heads", c.num_key_value_heads),
        ("intermediate size", inter),
        ("intermediate size", c.intermediate_size),
    ):
        if n % world:
            raise InvalidInput(f"--tensor-parallel {world} must divide the model's {what} ({n})")
    if c.qk_norm == "full":  # a norm over all the heads' q would need a reduction of its own
        raise InvalidInput(f"--tensor-parallel does not serve {c.model_type} (its q/k norm spans every head)")
