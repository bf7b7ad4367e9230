"""Shared fixtures: checkpoints made once per session, and transformers as the oracle."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from fastdecode.tools.checkpoint import make_model

# Keep tests polite on small CI machines: servers started by tests inherit this too.
os.environ.setdefault("OMP_NUM_THREADS", "2")
torch.set_num_threads(2)


@pytest.fixture(scope="session")
def model_factory(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    root = tmp_path_factory.mktemp("models")

    @functools.cache
    def make(arch: str, preset: str = "tiny") -> Path:
        return make_model(arch, preset, root / f"{preset}-{arch}", seed=1234)

    return make


@pytest.fixture(scope="session")
def family_factory(
    tmp_path_factory: pytest.TempPathFactory, model_factory: Callable[[str], Path]
) -> Callable[[str], Path]:
    """Tiny random checkpoints saved by transformers itself, one per family (tests.support.families)."""
    from tests.support.families import save_family

    root = tmp_path_factory.mktemp("families")

    @functools.cache
    def make(name: str) -> Path:
        return save_family(name, root / name, tokenizer_from=model_factory("llama"))

    return make


@pytest.fixture(scope="session")
def llama_dir(model_factory: Callable[[str], Path]) -> Path:
    return model_factory("llama")


@pytest.fixture(scope="session")
def hf_greedy() -> Callable[[Path, tuple[int, ...], int], list[int]]:
    """transformers' greedy `generate` (fp32), cached: the oracle every layer is compared to."""
    from transformers import AutoModelForCausalLM

    @functools.cache
    def load(path: Path) -> torch.nn.Module:
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    @functools.cache
    def generate(path: Path, prompt: tuple[int, ...], max_new_tokens: int) -> list[int]:
        model = load(path)
        with torch.no_grad():
            out = model.generate(
                torch.tensor([prompt]),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            )
        return out[0, len(prompt) :].tolist()

    generate.load = load  # type: ignore[attr-defined]
    return generate


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """The real model (SmolLM2-135M-Instruct) imported into ./.models: fetched once per CI run."""
    from tests.support.gguf import smollm2_dir

    return smollm2_dir()


@pytest.fixture(scope="session")
def smollm2_hf(tmp_path_factory: pytest.TempPathFactory) -> tuple:
    """(model, tokenizer) from transformers' own GGUF loader on the same file: the oracle."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.support.gguf import smollm2_gguf

    file = smollm2_gguf(tmp_path_factory.mktemp("smollm2-gguf"))
    tok = AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name)
    model = AutoModelForCausalLM.from_pretrained(file.parent, gguf_file=file.name, dtype=torch.float32)
    return model.eval(), tok


# Files that run on one worker together (a file's name -> its group). Files that make host network
# devices: dockerd's clean-up removes the links that appeared while it ran, so these never run beside
# each other on parallel workers. Files that compare the SmolLM2 fleet with transformers: they share
# the session's `real_fleet` and `smollm2_hf` (a 17 s GGUF load in transformers), made once per worker.
FILE_GROUPS = {
    **dict.fromkeys(
        ("test_containers.py", "test_bench_split.py", "test_bench_speculative_emulated.py"), "host-network"
    ),
    **dict.fromkeys(
        (
            "test_openai_features.py",
            "test_openai_n_prefix.py",
            "test_openai_tools.py",
            "test_real_model.py",
            "test_gguf_import.py",
        ),
        "smollm2",
    ),
}


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    """Under pytest-xdist with `--dist loadfile` (make test): each file runs whole on one worker, so
    its module fixtures (fleets, models) start once, and the files of a group in FILE_GROUPS share
    one worker. (xdist's loadgroup marks cannot do the second with pytest 9: it renames nodes by an
    attribute pytest no longer reads.)"""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class FilesScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return FILE_GROUPS.get(Path(path).name, path)

    return FilesScheduling(config, log)
