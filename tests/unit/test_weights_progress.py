"""The weight loader reports bytes read, and gpu_dense's progress file carries it to a supervisor."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from fastdecode.model import ModelConfig
from fastdecode.model.dense import DenseModel
from fastdecode.model.weights import load_weights
from fastdecode.runtime.progress import ProgressFile, read_progress


def _load_with_progress(path: Path) -> tuple[dict[str, torch.Tensor], list[tuple[int, int]]]:
    calls: list[tuple[int, int]] = []
    required, optional = DenseModel.tensor_names(ModelConfig.from_pretrained(path))
    tensors = load_weights(
        path,
        required,
        dtype=torch.float32,
        device="cpu",
        optional=optional,
        progress=lambda done, total: calls.append((done, total)),
    )
    return tensors, calls


def _assert_monotonic_to_total(calls: list[tuple[int, int]], tensors: dict[str, torch.Tensor]) -> None:
    total = calls[0][1]
    # The checkpoint is fp32, loaded as fp32: bytes read == bytes held.
    assert total == sum(t.numel() * t.element_size() for t in tensors.values()) > 0
    assert {t for _, t in calls} == {total}
    done = [d for d, _ in calls]
    assert done[0] == 0 and done[-1] == total
    assert all(b > a for a, b in zip(done, done[1:], strict=False))  # every tensor adds its bytes
    assert len(calls) == len(tensors) + 1


def test_progress_is_monotonic_up_to_the_total(llama_dir: Path) -> None:
    tensors, calls = _load_with_progress(llama_dir)
    _assert_monotonic_to_total(calls, tensors)


def test_progress_spans_every_file_of_a_sharded_checkpoint(llama_dir: Path, tmp_path: Path) -> None:
    sharded = tmp_path / "sharded"
    shutil.copytree(llama_dir, sharded)
    (sharded / "model.safetensors").unlink()
    everything = load_file(str(llama_dir / "model.safetensors"))
    names = sorted(everything)
    weight_map = {}
    for i, part in enumerate((names[::2], names[1::2])):
        fname = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({n: everything[n] for n in part}, str(sharded / fname))
        weight_map.update(dict.fromkeys(part, fname))
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    tensors, calls = _load_with_progress(sharded)
    _assert_monotonic_to_total(calls, tensors)


def test_dense_model_writes_a_progress_file(llama_dir: Path, tmp_path: Path) -> None:
    path = tmp_path / "gpu_dense.progress.json"
    assert read_progress(path) is None
    # A long interval keeps only the first and the final snapshot: a reader always sees the end.
    writes: list[tuple[str, int, int] | None] = []
    writer = ProgressFile(path, "loading weights", interval=3600)

    def spy(done: int, total: int) -> None:
        writer(done, total)
        writes.append(read_progress(path))

    DenseModel.from_pretrained(llama_dir, "cpu", progress=spy)
    final = read_progress(path)
    assert final is not None and final[0] == "loading weights" and final[1] == final[2] > 0
    assert writes[0] == ("loading weights", 0, final[2])
    assert writes[-2] == writes[0]  # throttled: the in-between snapshots were not written
    assert not list(tmp_path.glob("*.tmp"))  # written through tmp + rename
