"""Rotary position embeddings' inverse frequencies, as transformers computes them (default, linear,
llama3 and longrope scaling; partial rotary)."""

from __future__ import annotations

import math

import torch

from fastdecode.model.config import RopeConfig


def rope_inv_freq(rope: RopeConfig, head_dim: int, long: bool = False) -> torch.Tensor:
    """Inverse frequencies as transformers computes them (fp32); `long`: longrope's long factors."""
    dim = rope.rotary_dim or head_dim
    inv = 1.0 / (rope.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if rope.rope_type == "longrope":
        factors = rope.long_factor if long else rope.short_factor
        return 1.0 / (
            torch.tensor(factors, dtype=torch.float32)
            * rope.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
        )
    if rope.rope_type == "linear":
        return inv / rope.factor
    if rope.rope_type == "llama3":
        old = rope.original_max_position_embeddings
        low_wavelen = old / rope.low_freq_factor
        high_wavelen = old / rope.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / rope.factor, inv)
        smooth = (old / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv
