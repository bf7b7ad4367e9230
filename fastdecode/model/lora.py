"""LoRA adapters on the S-part: their low-rank updates applied per row of a step (rows of another
adapter, or of none, skip it); fastdecode.model.lora_files reads and checks an adapter directory.

An adapter is what `peft` saves (`adapter_config.json` and `adapter_model.safetensors`): for each
targeted projection of each layer, A [r, in] and B [out, r]; the projection's output gains
(x @ A^T) @ B^T * alpha / r (alpha / sqrt(r) with rsLoRA), as PEFT computes it, so greedy tokens equal
transformers + PEFT's. The step groups its rows by adapter (punica's idea, in plain torch): each
adapter present runs one pair of small GEMMs over its rows per projection.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LoraPair:
    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [out, r]
    scale: float


@dataclass
class LoraAdapter:
    """One adapter's weights: layer -> module name -> its pair."""

    name: str
    path: str
    rank: int
    layers: list[dict[str, LoraPair]]


@dataclass
class LoraBatch:
    """A step's rows grouped by adapter: for each adapter present, its rows (None: every row)."""

    groups: list[tuple[LoraAdapter, torch.Tensor | None]]

    @classmethod
    def of(cls, rows: list[LoraAdapter | None], device: torch.device) -> LoraBatch | None:
        """`rows`: each token row's adapter (None: the base model). None when no row has one."""
        by: dict[int, tuple[LoraAdapter, list[int]]] = {}
        for i, a in enumerate(rows):
            if a is not None:
                by.setdefault(id(a), (a, []))[1].append(i)
        if not by:
            return None
        total = len(rows)
        return cls(
            [
                (a, None if len(idx) == total else torch.tensor(idx, dtype=torch.long, device=device))
                for a, idx in by.values()
            ]
        )

    def add(
        self, out: torch.Tensor, x: torch.Tensor, layer: int, module: str, cols: slice | None = None
    ) -> None:
        """out[:, cols] += each adapter's update of `module` on its rows of x (in place)."""
        for adapter, rows in self.groups:
            pair = adapter.layers[layer].get(module)
            if pair is None:
                continue
            xs = x if rows is None else x.index_select(0, rows)
            delta = (xs @ pair.a.t()) @ pair.b.t() * pair.scale
            target = out if cols is None else out[:, cols]
            if rows is None:
                target += delta
            else:
                target.index_add_(0, rows, delta)
