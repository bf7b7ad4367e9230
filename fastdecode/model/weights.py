"""Load safetensors weights (single file or sharded with an index) by HuggingFace names."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import safe_open

from fastdecode.errors import ModelLoadError


def _tensor_files(path: Path) -> dict[str, Path]:
    """Map every tensor name to the file holding it."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        return {name: path / fname for name, fname in weight_map.items()}
    single = path / "model.safetensors"
    if not single.is_file():
        raise ModelLoadError(f"no model.safetensors or model.safetensors.index.json in {path}")
    with safe_open(str(single), framework="pt") as f:
        return {name: single for name in f.keys()}


def load_weights(
    path: str | Path,
    names: Iterable[str],
    *,
    dtype: torch.dtype,
    device: str | torch.device,
    optional: Iterable[str] = (),
) -> dict[str, torch.Tensor]:
    """Load the named tensors into `dtype` on `device`; a missing required tensor is named in the error."""
    path = Path(path)
    files = _tensor_files(path)
    wanted = list(names)
    missing = [n for n in wanted if n not in files]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ModelLoadError(f"checkpoint {path} is missing tensor {missing[0]!r}{more}")
    want = set(wanted) | {n for n in optional if n in files}
    by_file: dict[Path, list[str]] = {}
    for name in want:
        by_file.setdefault(files[name], []).append(name)
    out: dict[str, torch.Tensor] = {}
    for file, file_names in by_file.items():
        if not file.is_file():
            raise ModelLoadError(f"checkpoint shard {file} is missing")
        with safe_open(str(file), framework="pt") as f:
            for name in file_names:
                out[name] = f.get_tensor(name).to(device=device, dtype=dtype)
    return out
