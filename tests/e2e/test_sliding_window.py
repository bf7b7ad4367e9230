"""A Mistral checkpoint with a sliding window (8 keys) through a 2-shard fleet, both attention
backends: greedy fp32 tokens equal transformers' `generate` on prompts longer than the window,
prefilled in chunks smaller than the prompts, and the shards hold windows, not whole contexts."""

from __future__ import annotations

import concurrent.futures
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from fastdecode.client import Client
from fastdecode.model import ModelConfig
from fastdecode.tools.fleet import UpProcess
from tests.support import TOKEN, start_up

WINDOW = 8
PROMPTS = [
    [0] + list(range(100, 140)),  # 41 tokens: five windows
    [0, 7, 7, 7, 250, 1800, 42, 3, 999, 1500, 64, 128, 256, 512, 1024, 2000, 11, 12, 13, 14, 15, 16],
    [0, 33, 44, 55, 66, 77, 88, 99, 111, 222, 333],
    [0, 600],  # shorter than the window: it passes it while decoding
]
MAX_NEW = 24


@pytest.fixture(scope="module")
def mistral_window(model_factory: Callable, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random Mistral, saved again by transformers itself with sliding_window = 8."""
    from transformers import AutoModelForCausalLM

    src = model_factory("mistral")
    model = AutoModelForCausalLM.from_pretrained(src)
    model.config.sliding_window = WINDOW
    out = tmp_path_factory.mktemp("mistral-window")
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(src / name, out / name)
    assert ModelConfig.from_pretrained(out).layer_windows == (WINDOW,) * model.config.num_hidden_layers
    return out


@pytest.fixture(scope="module", params=["native", "torch"])
def fleet(request: pytest.FixtureRequest, mistral_window: Path, tmp_path_factory) -> Iterator[UpProcess]:
    f = start_up(
        mistral_window,
        tmp_path_factory.mktemp(f"window-{request.param}"),
        "--kv-dtype",
        "float32",
        env={
            "FASTDECODE_AUTH_TOKEN": TOKEN,
            "FASTDECODE_ATTENTION_BACKEND": request.param,
            "FASTDECODE_PREFILL_TOKEN_BUDGET": "16",  # chunks shorter than the long prompts
        },
    )
    yield f
    f.stop()


def test_windowed_greedy_equals_transformers(
    fleet: UpProcess, hf_greedy: Callable, mistral_window: Path
) -> None:
    with Client(fleet.target, token=TOKEN) as client, concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(client.generate, token_ids=p, max_tokens=MAX_NEW) for p in PROMPTS]
        outs = [f.result(timeout=180) for f in futures]
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert out.token_ids == hf_greedy(mistral_window, tuple(prompt), MAX_NEW)
