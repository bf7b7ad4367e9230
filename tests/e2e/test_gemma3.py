"""Gemma 3 270M end to end (the Q4_K_M GGUF from the package index, imported with `import-gguf`):
greedy fp32 tokens from `fastdecode run` and from a 2-shard fleet equal transformers' on the same
GGUF on three prompts, and `run --model <the gguf>` continues "The capital of France is" in
English about France. Gemma's terms apply to the weights: fetched at test time, never vendored."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from fastdecode.client import Client
from fastdecode.runtime.tokenizer import Tokenizer
from fastdecode.tools.fleet import UpProcess
from fastdecode.tools.gguf_import import cached_import_dir, is_complete
from tests.support import start_up
from tests.support.gguf import gemma3_gguf

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800), pytest.mark.filterwarnings("ignore")]

PROMPTS = ("The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,")
NEW_TOKENS = 12


def cli(*args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fastdecode.cli", *args], capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(scope="module")
def gguf_file() -> Path:
    return gemma3_gguf()


@pytest.fixture(scope="module")
def imported(gguf_file: Path) -> Path:
    # `import-gguf` writes where `run --model <the gguf>` looks for its import: the file is
    # dequantized once (30 s of CPU), not again by test_run_on_the_gguf_continues_sensibly
    out = cached_import_dir(gguf_file)
    if not is_complete(out):
        proc = cli("import-gguf", str(gguf_file), "--out", str(out))
        assert proc.returncode == 0, proc.stderr[-2000:]
    return out


@pytest.fixture(scope="module")
def expected(gguf_file: Path, imported: Path) -> dict[str, tuple[list[int], list[int]]]:
    """transformers' own GGUF loader on the same file: the oracle (prompt ids from our tokenizer;
    test_tokenizer_equals_transformers pins it to transformers' GemmaTokenizer)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32
    )
    tok = Tokenizer.from_pretrained(imported)
    out = {}
    for p in PROMPTS:
        ids = tok.encode(p)
        with torch.no_grad():
            g = model.eval().generate(
                torch.tensor([ids]),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            )
        out[p] = (ids, g[0, len(ids) :].tolist())
    return out


def test_imported_config_is_gemma3(imported: Path) -> None:
    cfg = json.loads((imported / "config.json").read_text())
    assert cfg["model_type"] == "gemma3_text" and cfg["sliding_window"] == 512
    assert cfg["layer_types"].count("full_attention") == 3 and cfg["head_dim"] == 256


# What transformers' GGUF loader (GemmaTokenizer, merges rebuilt from the vocabulary) gives for
# these strings on this file; rebuilding it takes minutes on a small machine, so it is pinned here.
TRANSFORMERS_IDS = {
    "The capital of France is": [2, 818, 5279, 529, 7001, 563],
    "Hello world": [2, 9259, 1902],
    "  two spaces": [2, 138, 13498, 9952],
}


def test_tokenizer_equals_transformers(imported: Path) -> None:
    tok = Tokenizer.from_pretrained(imported)
    for text, ids in TRANSFORMERS_IDS.items():
        assert tok.encode(text) == ids, text
        assert tok.decode(ids[1:]) == text


def test_run_equals_transformers(imported: Path, expected: dict) -> None:
    for prompt, (ids, want) in expected.items():
        proc = cli(
            "run",
            "--model",
            str(imported),
            "--json",
            "--max-tokens",
            str(NEW_TOKENS),
            "--prompt-ids",
            ",".join(map(str, ids)),
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert json.loads(proc.stdout.strip().splitlines()[-1])["token_ids"] == want, prompt


@pytest.fixture(scope="module")
def fleet(imported: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpProcess]:
    f = start_up(imported, tmp_path_factory.mktemp("gemma3-fleet"), timeout=600)
    yield f
    f.stop()


def test_fleet_equals_transformers(fleet: UpProcess, expected: dict) -> None:
    with Client(fleet.target) as client:
        for prompt, (ids, want) in expected.items():
            got = client.generate(token_ids=ids, max_tokens=NEW_TOKENS, timeout=300)
            assert got.token_ids == want, prompt


def test_run_on_the_gguf_continues_sensibly(gguf_file: Path) -> None:
    """The base model (no chat template) says " the capital of the country of France. It is the
    largest city in France and", as transformers does: English words about France."""
    proc = cli("run", "--model", str(gguf_file), "--prompt", "The capital of France is", "--max-tokens", "12")
    assert proc.returncode == 0, proc.stderr[-2000:]
    text = proc.stdout.removeprefix("The capital of France is")
    words = re.findall(r"[A-Za-z]+", text)
    assert len(words) >= 6 and re.fullmatch(r"[A-Za-z .,']+\s*", text), text
    assert "France" in words or "Paris" in words, text
