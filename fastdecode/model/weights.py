"""Load safetensors weights (single file or sharded with an index) by HuggingFace names."""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from safetensors import safe_open

from fastdecode.runtime.errors import ModelLoadError


def _tensor_files(path: Path) -> dict[str, Path]:
    """Map every tensor name to the file holding it."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text()).get("weight_map", {})
        except (OSError, ValueError, AttributeError) as e:
            raise ModelLoadError(f"cannot read {index}: {e}") from None
        return {name: path / fname for name, fname in weight_map.items()}
    single = path / "model.safetensors"
    if not single.is_file():
        raise ModelLoadError(f"no model.safetensors or model.safetensors.index.json in {path}")
    try:
        with safe_open(str(single), framework="pt") as f:
            return {name: single for name in f.keys()}
    except Exception as e:  # SafetensorError on a truncated or corrupt file
        raise ModelLoadError(f"cannot read {single}: {e}") from None


def _stored_bytes(file: Path) -> dict[str, int]:
    """Bytes each tensor occupies in a safetensors file, from its JSON header (no tensor is read)."""
    with open(file, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    return {
        name: int(meta["data_offsets"][1]) - int(meta["data_offsets"][0])
        for name, meta in header.items()
        if name != "__metadata__"
    }


def load_weights(
    path: str | Path,
    names: Iterable[str],
    *,
    dtype: torch.dtype,
    device: str | torch.device,
    optional: Iterable[str] = (),
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, torch.Tensor]:
    """Load the named tensors into `dtype` on `device`; a missing required tensor is named in the error.

    `progress(done, total)` is called with checkpoint bytes read: once with done=0 before the
    first tensor, then after each tensor, ending with done == total.
    """
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
    for file in by_file:
        if not file.is_file():
            raise ModelLoadError(f"checkpoint shard {file} is missing")
    sizes: dict[str, int] = {}
    if progress is not None:
        for file, file_names in by_file.items():
            stored = _stored_bytes(file)
            sizes.update((n, stored.get(n, 0)) for n in file_names)
    total, done = sum(sizes.values()), 0
    if progress is not None:
        progress(0, total)
    out: dict[str, torch.Tensor] = {}
    for file, file_names in by_file.items():
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in file_names:
                    out[name] = f.get_tensor(name).to(device=device, dtype=dtype)
                    if progress is not None:
                        done += sizes[name]
                        progress(done, total)
        except ModelLoadError:
            raise
        except Exception as e:  # SafetensorError: a truncated or corrupt file
            raise ModelLoadError(f"cannot read {file}: {e}") from None
    return out


FINGERPRINT_SAMPLES = 16  # 64 KiB windows read per weights file, evenly spaced


def weights_fingerprint(path: str | Path) -> str:
    """A short name for a checkpoint's bytes: sha256 over each weights file's name, size, header
    and 16 evenly spaced 64 KiB windows of its data (~1 MiB read per file, whatever its size). A
    fine-tune of the same shapes differs in its sampled bytes; a copy of the same files does not.
    A persistent KV pool (fastdecode/kv/persist.py) keeps KV of these weights only."""
    h = hashlib.sha256()
    path = Path(path)
    files = sorted(path.glob("*.safetensors")) + sorted(path.glob("*.gguf"))
    if not files:
        raise ModelLoadError(f"no weights files (*.safetensors, *.gguf) in {path}")
    for file in files:
        size = file.stat().st_size
        h.update(f"{file.name}\0{size}\0".encode())
        with open(file, "rb") as f:
            h.update(f.read(1 << 16))  # the header (names, dtypes, shapes, offsets)
            for i in range(FINGERPRINT_SAMPLES):
                f.seek(size * i // FINGERPRINT_SAMPLES)
                h.update(f.read(1 << 16))
    return h.hexdigest()[:16]
