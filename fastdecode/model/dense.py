"""The S-part of a Llama-family transformer: everything that has weights.

The split (ARCHITECTURE.md, "The FastDecode idea"): embed -> per layer [pre_attention -> (R-part attends) ->
post_attention] -> logits. The math matches transformers' LlamaForCausalLM (fp32
RMSNorm, rotate-half RoPE, SiLU-gated MLP) so greedy tokens are equal.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from fastdecode.model.config import ModelConfig
from fastdecode.model.rope import rope_inv_freq
from fastdecode.model.weights import load_weights
from fastdecode.runtime.errors import InvalidInput


@dataclass
class Layer:
    input_norm: torch.Tensor
    qkv_w: torch.Tensor  # q, k, v projections fused: one GEMM instead of three
    qkv_b: torch.Tensor | None
    o_w: torch.Tensor
    o_b: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up_w: torch.Tensor  # gate and up fused
    gate_up_b: torch.Tensor | None
    down_w: torch.Tensor
    down_b: torch.Tensor | None


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise InvalidInput("device cuda requested but CUDA is not available")
    return torch.device(device)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


class DenseModel:
    def __init__(
        self, config: ModelConfig, tensors: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype
    ) -> None:
        self.config = config
        self.device = device
        self.dtype = dtype
        c = config
        self.embed_w = tensors["model.embed_tokens.weight"]
        self.final_norm = tensors["model.norm.weight"]
        self.lm_head_w = self.embed_w if c.tie_word_embeddings else tensors["lm_head.weight"]
        self.layers: list[Layer] = []
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."

            def bias(*names: str) -> torch.Tensor | None:
                got = [tensors.get(n) for n in names]
                return None if any(b is None for b in got) else torch.cat(got)  # type: ignore[arg-type]

            self.layers.append(
                Layer(
                    input_norm=tensors[p + "input_layernorm.weight"],
                    qkv_w=torch.cat([tensors[a + f"{n}_proj.weight"] for n in "qkv"]),
                    qkv_b=bias(*(a + f"{n}_proj.bias" for n in "qkv")),
                    o_w=tensors[a + "o_proj.weight"],
                    o_b=tensors.get(a + "o_proj.bias"),
                    post_norm=tensors[p + "post_attention_layernorm.weight"],
                    gate_up_w=torch.cat(
                        [tensors[p + "mlp.gate_proj.weight"], tensors[p + "mlp.up_proj.weight"]]
                    ),
                    gate_up_b=bias(p + "mlp.gate_proj.bias", p + "mlp.up_proj.bias"),
                    down_w=tensors[p + "mlp.down_proj.weight"],
                    down_b=tensors.get(p + "mlp.down_proj.bias"),
                )
            )
        self.inv_freq = rope_inv_freq(c.rope, c.head_dim).to(device)
        self.q_size = c.num_attention_heads * c.head_dim
        self.kv_size = c.num_key_value_heads * c.head_dim

    @staticmethod
    def tensor_names(config: ModelConfig) -> tuple[list[str], list[str]]:
        """(required, optional) HuggingFace tensor names for this config."""
        req = ["model.embed_tokens.weight", "model.norm.weight"]
        if not config.tie_word_embeddings:
            req.append("lm_head.weight")
        for i in range(config.num_hidden_layers):
            p = f"model.layers.{i}."
            req += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
            req += [p + f"self_attn.{n}_proj.weight" for n in "qkvo"]
            req += [p + f"mlp.{n}_proj.weight" for n in ("gate", "up", "down")]
            if config.qkv_bias:
                req += [p + f"self_attn.{n}_proj.bias" for n in "qkv"]
            if config.o_bias:
                req.append(p + "self_attn.o_proj.bias")
            if config.mlp_bias:
                req += [p + f"mlp.{n}_proj.bias" for n in ("gate", "up", "down")]
        return req, ([] if not config.tie_word_embeddings else ["lm_head.weight"])

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        progress: Callable[[int, int], None] | None = None,
    ) -> DenseModel:
        """Load config and weights; `progress(done, total)` gets checkpoint bytes read (see load_weights)."""
        config = ModelConfig.from_pretrained(path)
        dev = resolve_device(device) if isinstance(device, str) else device
        required, optional = cls.tensor_names(config)
        tensors = load_weights(path, required, dtype=dtype, device=dev, optional=optional, progress=progress)
        return cls(config, tensors, dev, dtype)

    # ---- S-part ---------------------------------------------------------------------------
    @torch.inference_mode()
    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """[T] token ids -> [T, hidden]."""
        if token_ids.numel() and (int(token_ids.min()) < 0 or int(token_ids.max()) >= self.config.vocab_size):
            raise InvalidInput(f"token id outside the vocabulary [0, {self.config.vocab_size})")
        return F.embedding(token_ids.to(self.device), self.embed_w)

    def rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate-half RoPE on [T, heads, head_dim], cos/sin computed in fp32 as transformers does."""
        freqs = positions.to(self.device).float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos().to(x.dtype)[:, None, :]
        sin = emb.sin().to(x.dtype)[:, None, :]
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    @torch.inference_mode()
    def pre_attention(
        self, layer: int, hidden: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Norm, fused QKV, RoPE. Returns q [T, H, D], k [T, KVH, D], v [T, KVH, D], contiguous."""
        c, w = self.config, self.layers[layer]
        x = rms_norm(hidden, w.input_norm, c.rms_norm_eps)
        qkv = F.linear(x, w.qkv_w, w.qkv_b)
        t = hidden.shape[0]
        q = qkv[:, : self.q_size].view(t, c.num_attention_heads, c.head_dim)
        k = qkv[:, self.q_size : self.q_size + self.kv_size].view(t, c.num_key_value_heads, c.head_dim)
        v = qkv[:, self.q_size + self.kv_size :].reshape(t, c.num_key_value_heads, c.head_dim)
        return self.rope(q, positions).contiguous(), self.rope(k, positions).contiguous(), v.contiguous()

    @torch.inference_mode()
    def post_attention(self, layer: int, hidden: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """O projection + residual, then the MLP block + residual."""
        c, w = self.config, self.layers[layer]
        h = hidden + F.linear(attn_out.to(hidden.dtype), w.o_w, w.o_b)
        x = rms_norm(h, w.post_norm, c.rms_norm_eps)
        gate, up = F.linear(x, w.gate_up_w, w.gate_up_b).chunk(2, dim=-1)
        return h + F.linear(F.silu(gate) * up, w.down_w, w.down_b)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head on [N, hidden]; fp32 logits [N, vocab]."""
        x = rms_norm(hidden, self.final_norm, self.config.rms_norm_eps)
        return F.linear(x, self.lm_head_w).float()
