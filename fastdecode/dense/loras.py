"""gpu_dense's LoRA adapters: the ones loaded, by name, within --max-loras and --max-lora-rank, and a
step's rows resolved to theirs (a row's adapter rides in its SamplingParams.lora; "" is the base model).

Loading reads and checks the adapter off the step (a worker thread), then adds it between steps; an
adapter unloaded while sequences use it fails their next step NOT_FOUND, and nothing else."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

import torch

from fastdecode.contract import LoraInfo, PlannedSeq
from fastdecode.model.dense import DenseModel
from fastdecode.model.lora import LoraAdapter, LoraBatch
from fastdecode.model.lora_files import load_adapter
from fastdecode.runtime.errors import FailedPrecondition, InvalidInput, NotFound

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}$")
OFF = "LoRA is off: start gpu_dense with --enable-lora (docs/lora.md)"


def parse_modules(text: str) -> list[tuple[str, str]]:
    """--lora-modules NAME=PATH,NAME=PATH as (name, path) pairs."""
    out: list[tuple[str, str]] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        name, sep, path = part.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise InvalidInput(f"--lora-modules: {part!r} is not NAME=PATH")
        out.append((name.strip(), path.strip()))
    return out


class LoraBank:
    def __init__(self, model: DenseModel, max_loras: int, max_rank: int) -> None:
        self.model = model
        self.max_loras = max_loras
        self.max_rank = max_rank
        self._loaded: dict[str, LoraAdapter] = {}

    def _check_room(self, name: str) -> None:
        if not NAME.match(name):
            raise InvalidInput(
                f"LoRA adapter name {name!r}: 1-128 letters, digits and ._:/@+-, a letter or digit first"
            )
        if name in self._loaded:
            raise InvalidInput(f"LoRA adapter {name!r} is already loaded; unload it first")
        if len(self._loaded) >= self.max_loras:
            raise InvalidInput(
                f"LoRA adapter {name!r}: {self.max_loras} adapters are loaded (--max-loras); unload one first"
            )

    def read(self, name: str, path: str | Path) -> LoraAdapter:
        """Read and check an adapter (blocking: a worker thread's); `add` makes it usable."""
        self._check_room(name)
        return load_adapter(name, path, self.model, self.max_rank)

    def add(self, adapter: LoraAdapter) -> None:
        self._check_room(adapter.name)  # again: another load may have come first
        self._loaded[adapter.name] = adapter

    def load(self, name: str, path: str | Path) -> LoraAdapter:
        adapter = self.read(name, path)
        self.add(adapter)
        return adapter

    def unload(self, name: str) -> None:
        if self._loaded.pop(name, None) is None:
            raise NotFound(f"LoRA adapter {name!r} is not loaded")

    def adapters(self) -> list[LoraAdapter]:
        return list(self._loaded.values())

    def infos(self) -> list[LoraInfo]:
        return [LoraInfo(a.name, a.path, a.rank) for a in self._loaded.values()]

    def get(self, name: str) -> LoraAdapter:
        adapter = self._loaded.get(name)
        if adapter is None:
            raise NotFound(f"LoRA adapter {name!r} is not loaded")
        return adapter


def resolve_row(bank: LoraBank | None, s: PlannedSeq) -> LoraAdapter | None:
    """The row's adapter: None for the base model; NOT_FOUND for a name not loaded."""
    name = s.sampling.lora
    if not name:
        return None
    if bank is None:
        raise FailedPrecondition(OFF)
    return bank.get(name)


def step_batch(
    seqs: Sequence[PlannedSeq], adapters: dict[str, LoraAdapter], device: torch.device
) -> LoraBatch | None:
    """A mini-batch's token rows grouped by the adapter of their sequence (None: no row has one)."""
    if not adapters:
        return None
    rows: list[LoraAdapter | None] = []
    for s in seqs:
        rows += [adapters.get(s.seq_id)] * len(s.token_ids)
    return LoraBatch.of(rows, device)
