"""The S-part of a decoder-only transformer: everything that has weights.

The split (ARCHITECTURE.md, "The FastDecode idea"): embed -> per layer [pre_attention -> (R-part attends) ->
post_attention] -> logits. The math matches transformers' models of each family in
fastdecode.model.config (fp32 RMSNorm, rotate-half RoPE, gated MLPs, Gemma's norms and scales,
routed experts) so greedy tokens are equal.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from fastdecode.model.config import ModelConfig
from fastdecode.model.lora import LoraBatch
from fastdecode.model.rope import rope_inv_freq
from fastdecode.model.weights import load_weights
from fastdecode.runtime.errors import InvalidInput


@dataclass
class Experts:
    """A sparse MLP: the router and every expert's weights stacked, so a step dispatches by index."""

    router_w: torch.Tensor  # [E, hidden]
    gate_up_w: torch.Tensor  # [E, 2 * inter, hidden]
    down_w: torch.Tensor  # [E, hidden, inter]


@dataclass
class Layer:
    input_norm: torch.Tensor
    qkv_w: torch.Tensor  # q, k, v projections fused: one GEMM instead of three
    qkv_b: torch.Tensor | None
    o_w: torch.Tensor
    o_b: torch.Tensor | None
    post_norm: torch.Tensor  # the norm before the MLP (Gemma: pre_feedforward_layernorm)
    gate_up_w: torch.Tensor | None  # gate and up fused; None in a sparse layer
    gate_up_b: torch.Tensor | None
    down_w: torch.Tensor | None
    down_b: torch.Tensor | None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    attn_out_norm: torch.Tensor | None = None  # Gemma: post_attention_layernorm on the O projection
    mlp_out_norm: torch.Tensor | None = None  # Gemma: post_feedforward_layernorm
    experts: Experts | None = None


@dataclass
class LayerRope:
    inv_freq: torch.Tensor
    long_inv_freq: torch.Tensor | None  # longrope: used from original_max_position_embeddings on
    original: int
    attention_factor: float
    rotary_dim: int


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise InvalidInput("device cuda requested but CUDA is not available")
    return torch.device(device)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool = False) -> torch.Tensor:
    """Llama's RMSNorm (weight * normed.to(dtype)), or Gemma's ((normed * weight).to(dtype), the
    weight already holding 1 + w in fp32)."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if gemma:
        return (h * weight).to(dtype)
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
        self.final_norm = self._norm(tensors["model.norm.weight"])
        self.lm_head_w = self.embed_w if c.tie_word_embeddings else tensors["lm_head.weight"]
        # Gemma rounds its sqrt(hidden) scale to the weights' dtype, as transformers does.
        self.embed_scale = (
            torch.tensor(c.embed_scale, dtype=self.embed_w.dtype, device=device)
            if c.embed_scale != 1.0
            else None
        )
        self.layers = [self._layer(tensors, i) for i in range(c.num_hidden_layers)]
        self.ropes = [self._layer_rope(i) for i in range(c.num_hidden_layers)]
        self.inv_freq = self.ropes[0].inv_freq if self.ropes else rope_inv_freq(c.rope, c.head_dim).to(device)
        self.q_size = c.num_attention_heads * c.head_dim
        self.kv_size = c.num_key_value_heads * c.head_dim
        # Tensor parallelism (fastdecode/model/tensor_parallel.py): the heads this rank's slices of
        # the weights compute, and the sum over the ranks of a row-parallel projection's partial
        # outputs. All the heads and None in one process.
        self.heads, self.kv_heads = c.num_attention_heads, c.num_key_value_heads
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None

    def _norm(self, w: torch.Tensor) -> torch.Tensor:
        return 1.0 + w.float() if self.config.gemma_norms else w

    def _layer(self, tensors: dict[str, torch.Tensor], i: int) -> Layer:
        c = self.config
        p = f"model.layers.{i}."
        a = p + "self_attn."

        def bias(*names: str) -> torch.Tensor | None:
            got = [tensors.get(n) for n in names]
            return None if any(b is None for b in got) else torch.cat(got)  # type: ignore[arg-type]

        if c.fused_projections:
            qkv_w, gate_up = tensors[a + "qkv_proj.weight"], tensors.get(p + "mlp.gate_up_proj.weight")
        else:
            qkv_w = torch.cat([tensors[a + f"{n}_proj.weight"] for n in "qkv"])
            gate_up = None
        experts = None
        if c.moe is not None and c.moe.layers[i]:
            experts = self._experts(tensors, p)
        elif gate_up is None:
            gate_up = torch.cat([tensors[p + "mlp.gate_proj.weight"], tensors[p + "mlp.up_proj.weight"]])
        gemma = c.gemma_norms
        return Layer(
            input_norm=self._norm(tensors[p + "input_layernorm.weight"]),
            qkv_w=qkv_w,
            qkv_b=bias(*(a + f"{n}_proj.bias" for n in "qkv")),
            o_w=tensors[a + "o_proj.weight"],
            o_b=tensors.get(a + "o_proj.bias"),
            post_norm=self._norm(
                tensors[
                    p + ("pre_feedforward_layernorm" if gemma else "post_attention_layernorm") + ".weight"
                ]
            ),
            gate_up_w=gate_up,
            gate_up_b=bias(p + "mlp.gate_proj.bias", p + "mlp.up_proj.bias") if experts is None else None,
            down_w=tensors[p + "mlp.down_proj.weight"] if experts is None else None,
            down_b=tensors.get(p + "mlp.down_proj.bias"),
            q_norm=self._norm(tensors[a + "q_norm.weight"]) if c.qk_norm else None,
            k_norm=self._norm(tensors[a + "k_norm.weight"]) if c.qk_norm else None,
            attn_out_norm=self._norm(tensors[p + "post_attention_layernorm.weight"]) if gemma else None,
            mlp_out_norm=self._norm(tensors[p + "post_feedforward_layernorm.weight"]) if gemma else None,
            experts=experts,
        )

    def _experts(self, tensors: dict[str, torch.Tensor], p: str) -> Experts:
        moe = self.config.moe
        assert moe is not None
        names = _expert_names(moe.naming)
        base = p + names["block"]
        gate_up = [
            torch.cat(
                [
                    tensors[f"{base}experts.{e}.{names['gate']}.weight"],
                    tensors[f"{base}experts.{e}.{names['up']}.weight"],
                ]
            )
            for e in range(moe.num_experts)
        ]
        down = [tensors.pop(f"{base}experts.{e}.{names['down']}.weight") for e in range(moe.num_experts)]
        for e in range(moe.num_experts):  # the stacked copies replace the per-expert tensors
            tensors.pop(f"{base}experts.{e}.{names['gate']}.weight")
            tensors.pop(f"{base}experts.{e}.{names['up']}.weight")
        return Experts(tensors[base + "gate.weight"], torch.stack(gate_up), torch.stack(down))

    def _layer_rope(self, i: int) -> LayerRope:
        c = self.config
        r = c.rope_for(i)
        long = rope_inv_freq(r, c.head_dim, long=True).to(self.device) if r.rope_type == "longrope" else None
        return LayerRope(
            inv_freq=rope_inv_freq(r, c.head_dim).to(self.device),
            long_inv_freq=long,
            original=r.original_max_position_embeddings,
            attention_factor=r.attention_factor,
            rotary_dim=r.rotary_dim or c.head_dim,
        )

    @staticmethod
    def tensor_names(config: ModelConfig) -> tuple[list[str], list[str]]:
        """(required, optional) HuggingFace tensor names for this config."""
        c = config
        req = ["model.embed_tokens.weight", "model.norm.weight"]
        if not c.tie_word_embeddings:
            req.append("lm_head.weight")
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            req += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
            if c.gemma_norms:
                req += [p + "pre_feedforward_layernorm.weight", p + "post_feedforward_layernorm.weight"]
            if c.fused_projections:
                req += [p + "self_attn.qkv_proj.weight", p + "self_attn.o_proj.weight"]
            else:
                req += [p + f"self_attn.{n}_proj.weight" for n in "qkvo"]
            if c.qk_norm:
                req += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
            if c.moe is not None and c.moe.layers[i]:
                names = _expert_names(c.moe.naming)
                base = p + names["block"]
                req.append(base + "gate.weight")
                for e in range(c.moe.num_experts):
                    req += [f"{base}experts.{e}.{names[n]}.weight" for n in ("gate", "up", "down")]
            elif c.fused_projections:
                req += [p + "mlp.gate_up_proj.weight", p + "mlp.down_proj.weight"]
            else:
                req += [p + f"mlp.{n}_proj.weight" for n in ("gate", "up", "down")]
            if c.qkv_bias:
                req += [p + f"self_attn.{n}_proj.bias" for n in "qkv"]
            if c.o_bias:
                req.append(p + "self_attn.o_proj.bias")
            if c.mlp_bias:
                req += [p + f"mlp.{n}_proj.bias" for n in ("gate", "up", "down")]
        return req, ([] if not c.tie_word_embeddings else ["lm_head.weight"])

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

    async def settle(self) -> None:
        """Wait for the device's queued work. Nothing to wait for: CPU computes synchronously, and
        on CUDA the copy of q, k, v to the host (the codec) waits for the kernels."""

    # ---- S-part ---------------------------------------------------------------------------
    @torch.inference_mode()
    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """[T] token ids -> [T, hidden]."""
        if token_ids.numel() and (int(token_ids.min()) < 0 or int(token_ids.max()) >= self.config.vocab_size):
            raise InvalidInput(f"token id outside the vocabulary [0, {self.config.vocab_size})")
        x = F.embedding(token_ids.to(self.device), self.embed_w)
        return x if self.embed_scale is None else x * self.embed_scale

    def rope(self, x: torch.Tensor, positions: torch.Tensor, layer: int = 0) -> torch.Tensor:
        """Rotate-half RoPE on [T, heads, head_dim], cos/sin computed in fp32 as transformers does.

        LongRoPE's long factors apply to positions from original_max_position_embeddings on: what
        transformers does on a decode step there (it picks them for a whole forward by its last
        position, so a prompt longer than that gets them on every token; a chunk here does not)."""
        r = self.ropes[layer]
        pos = positions.to(self.device).float()[:, None]
        freqs = pos * r.inv_freq[None, :]
        if r.long_inv_freq is not None:
            freqs = torch.where(pos >= r.original, pos * r.long_inv_freq[None, :], freqs)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if r.attention_factor != 1.0:
            cos, sin = cos * r.attention_factor, sin * r.attention_factor
        cos = cos.to(x.dtype)[:, None, :]
        sin = sin.to(x.dtype)[:, None, :]
        rot, rest = x[..., : r.rotary_dim], x[..., r.rotary_dim :]
        half = r.rotary_dim // 2
        rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
        out = rot * cos + rotated * sin
        return out if not rest.shape[-1] else torch.cat((out, rest), dim=-1)

    @torch.inference_mode()
    def pre_attention(
        self, layer: int, hidden: torch.Tensor, positions: torch.Tensor, lora: LoraBatch | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Norm, fused QKV, q/k norms, RoPE. Returns q [T, H, D], k [T, KVH, D], v [T, KVH, D], contiguous.

        q carries the model's attention scale relative to head_dim**-0.5 (Gemma's
        query_pre_attn_scalar), which is all the attention side applies. `lora`: each row's adapter
        updates of q, k and v (fastdecode.model.lora)."""
        c, w = self.config, self.layers[layer]
        gemma = c.gemma_norms
        x = rms_norm(hidden, w.input_norm, c.rms_norm_eps, gemma)
        qkv = F.linear(x, w.qkv_w, w.qkv_b)
        qs, ks = self.heads * c.head_dim, (self.heads + self.kv_heads) * c.head_dim
        if lora is not None:
            lora.add(qkv, x, layer, "q_proj", slice(0, qs))
            lora.add(qkv, x, layer, "k_proj", slice(qs, ks))
            lora.add(qkv, x, layer, "v_proj", slice(ks, None))
        t = hidden.shape[0]
        q, k, v = qkv[:, :qs], qkv[:, qs:ks], qkv[:, ks:]
        if c.qk_norm == "full":  # OLMoE: over the whole projection, before the split into heads
            q, k = rms_norm(q, w.q_norm, c.rms_norm_eps), rms_norm(k, w.k_norm, c.rms_norm_eps)  # type: ignore[arg-type]
        if c.clip_qkv:  # OLMoE: after its norms
            q, k, v = (x.clamp(-c.clip_qkv, c.clip_qkv) for x in (q, k, v))
        q = q.reshape(t, self.heads, c.head_dim)
        k = k.reshape(t, self.kv_heads, c.head_dim)
        v = v.reshape(t, self.kv_heads, c.head_dim)
        if c.qk_norm == "head":  # Qwen3, Gemma 3: per head, before RoPE
            q = rms_norm(q, w.q_norm, c.rms_norm_eps, gemma)  # type: ignore[arg-type]
            k = rms_norm(k, w.k_norm, c.rms_norm_eps, gemma)  # type: ignore[arg-type]
        q = self.rope(q, positions, layer)
        if c.query_scale != 1.0:
            q = q * c.query_scale
        return q.contiguous(), self.rope(k, positions, layer).contiguous(), v.contiguous()

    @torch.inference_mode()
    def post_attention(
        self, layer: int, hidden: torch.Tensor, attn_out: torch.Tensor, lora: LoraBatch | None = None
    ) -> torch.Tensor:
        """O projection + residual, then the MLP block + residual (Gemma: each output normed first);
        `lora`: each row's adapter updates of the O and MLP projections."""
        c, w = self.config, self.layers[layer]
        gemma = c.gemma_norms
        attn_out = attn_out.to(hidden.dtype)
        o = self._row_parallel(attn_out, w.o_w, w.o_b)
        if lora is not None:
            lora.add(o, attn_out, layer, "o_proj")
        if w.attn_out_norm is not None:
            o = rms_norm(o, w.attn_out_norm, c.rms_norm_eps, gemma)
        h = hidden + o
        x = rms_norm(h, w.post_norm, c.rms_norm_eps, gemma)
        if w.experts is not None:
            m = self._moe(x, w.experts)
            m = m if self.reduce is None else self.reduce(m)
        elif lora is None:
            gate, up = F.linear(x, w.gate_up_w, w.gate_up_b).chunk(2, dim=-1)  # type: ignore[arg-type]
            m = self._row_parallel(self._act(gate) * up, w.down_w, w.down_b)  # type: ignore[arg-type]
        else:
            gate_up = F.linear(x, w.gate_up_w, w.gate_up_b)  # type: ignore[arg-type]
            inter = gate_up.shape[-1] // 2
            lora.add(gate_up, x, layer, "gate_proj", slice(0, inter))
            lora.add(gate_up, x, layer, "up_proj", slice(inter, None))
            gate, up = gate_up.chunk(2, dim=-1)
            y = self._act(gate) * up
            m = F.linear(y, w.down_w, w.down_b)  # type: ignore[arg-type]
            lora.add(m, y, layer, "down_proj")
        if w.mlp_out_norm is not None:
            m = rms_norm(m, w.mlp_out_norm, c.rms_norm_eps, gemma)
        return h + m

    def _row_parallel(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        """x @ w.T + b; under tensor parallelism each rank's product is a partial sum over its
        slice of the input features, summed over the ranks before the bias is added once."""
        if self.reduce is None:
            return F.linear(x, w, b)
        y = self.reduce(F.linear(x, w))
        return y if b is None else y + b

    def _act(self, x: torch.Tensor) -> torch.Tensor:
        if self.config.hidden_act == "gelu_pytorch_tanh":
            return F.gelu(x, approximate="tanh")
        return F.silu(x)

    def _moe(self, x: torch.Tensor, e: Experts) -> torch.Tensor:
        """Router top-k, then each expert once over all the step's tokens routed to it.

        The (token, choice) pairs are sorted by expert, so each expert reads one contiguous run of
        gathered rows; the weighted outputs go back with one index_add. The loop is over experts,
        never tokens, and holds no device sync but the one read of the per-expert counts."""
        moe = self.config.moe
        assert moe is not None
        probs = torch.softmax(F.linear(x, e.router_w).float(), dim=-1)
        weights, chosen = torch.topk(probs, moe.top_k, dim=-1)  # [T, k]
        if moe.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if moe.naming != "mixtral":  # Qwen3-MoE and OLMoE weigh in the activations' dtype
            weights = weights.to(x.dtype)
        flat = chosen.reshape(-1)
        order = torch.argsort(flat, stable=True)
        tokens = order // moe.top_k
        counts = torch.bincount(flat, minlength=moe.num_experts).tolist()
        rows = x.index_select(0, tokens)
        out = torch.empty_like(rows)
        start = 0
        for expert, n in enumerate(counts):
            if n:
                part = rows[start : start + n]
                gate, up = F.linear(part, e.gate_up_w[expert]).chunk(2, dim=-1)
                out[start : start + n] = F.linear(self._act(gate) * up, e.down_w[expert])
                start += n
        weighted = (out * weights.reshape(-1)[order, None]).to(x.dtype)
        return torch.zeros_like(x).index_add_(0, tokens, weighted)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head on [N, hidden]; fp32 logits [N, vocab] (Gemma 2: soft-capped)."""
        c = self.config
        x = rms_norm(hidden, self.final_norm, c.rms_norm_eps, c.gemma_norms)
        out = self._lm_head(x)
        if c.final_logit_softcap:
            out = torch.tanh(out / c.final_logit_softcap) * c.final_logit_softcap
        return out

    def _lm_head(self, x: torch.Tensor) -> torch.Tensor:
        """fp32 logits of the normed rows (tensor parallelism: gathered from each rank's slice of
        the vocabulary)."""
        return F.linear(x, self.lm_head_w).float()


def _expert_names(naming: str) -> dict[str, str]:
    if naming == "mixtral":
        return {"block": "block_sparse_moe.", "gate": "w1", "up": "w3", "down": "w2"}
    return {"block": "mlp.", "gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
