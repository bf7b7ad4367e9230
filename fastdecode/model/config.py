"""Model configuration read from a HuggingFace checkpoint directory (config.json).

Supports the Llama family: model_type llama, mistral and qwen2, with RoPE given in
the classic form (rope_theta + rope_scaling) or transformers 5's rope_parameters.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastdecode.runtime.errors import ModelLoadError
from fastdecode.runtime.geometry import KVGeometry

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"  # default | linear | llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


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
    # Attention window per layer (0 = full; empty = full on every layer): a query at position p
    # attends keys p - w + 1 .. p, as transformers' sliding-window mask.
    layer_windows: tuple[int, ...] = field(default_factory=tuple)
    # Attention logit soft-cap: score = cap * tanh(score / cap) before the mask (0.0 = none).
    attn_logit_softcap: float = 0.0

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

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], generation: dict[str, Any] | None = None) -> ModelConfig:
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelLoadError(
                f"unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
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
            attention_bias = bool(cfg.get("attention_bias", False))
            eos = _ids(cfg.get("eos_token_id")) + _ids((generation or {}).get("eos_token_id"))
            bos = cfg.get("bos_token_id", (generation or {}).get("bos_token_id"))
            return cls(
                model_type=model_type,
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_hidden_layers=int(cfg["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=kv_heads,
                head_dim=head_dim,
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope=_rope(cfg),
                max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
                vocab_size=int(cfg["vocab_size"]),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                # Qwen2 always has q/k/v bias and no o bias; Llama's attention_bias covers all four.
                qkv_bias=model_type == "qwen2" or attention_bias,
                o_bias=model_type == "llama" and attention_bias,
                mlp_bias=model_type == "llama" and bool(cfg.get("mlp_bias", False)),
                bos_token_id=int(bos) if bos is not None else None,
                eos_token_ids=tuple(dict.fromkeys(eos)),
                layer_windows=_mistral_windows(cfg, model_type),
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


def _read_json(file: Path) -> dict[str, Any]:
    try:
        obj = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ModelLoadError(f"cannot read {file}: {e}") from None
    if not isinstance(obj, dict):
        raise ModelLoadError(f"{file} is not a JSON object")
    return obj


def _mistral_windows(cfg: dict[str, Any], model_type: str) -> tuple[int, ...]:
    """Mistral's sliding_window (every layer; null = none). Other families fill theirs elsewhere."""
    window = cfg.get("sliding_window") if model_type == "mistral" else None
    if not window:
        return ()
    if int(window) < 1:
        raise ModelLoadError(f"config.json: sliding_window must be positive, got {window}")
    return (int(window),) * int(cfg["num_hidden_layers"])


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, list):
        return [int(v) for v in value]
    return [int(value)]


def _rope(cfg: dict[str, Any]) -> RopeConfig:
    # transformers 5 writes rope_parameters (theta inside); older configs use rope_theta + rope_scaling.
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    merged = {**scaling, **params}
    theta = float(merged.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = merged.get("rope_type", merged.get("type", "default")) or "default"
    if rope_type not in ("default", "linear", "llama3"):
        raise ModelLoadError(f"unsupported rope type {rope_type!r}; supported: default, linear, llama3")
    return RopeConfig(
        theta=theta,
        rope_type=rope_type,
        factor=float(merged.get("factor", 1.0)),
        low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
        high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(
            merged.get("original_max_position_embeddings", cfg.get("max_position_embeddings", 8192))
        ),
    )
