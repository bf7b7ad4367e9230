"""`fastdecode run` (a process) on every family's tiny transformers-saved checkpoint: greedy fp32
tokens equal transformers' `generate` on a prompt longer than the window."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable

import pytest

from tests.support import PROMPTS
from tests.support.families import FAMILIES, WINDOW

pytestmark = pytest.mark.filterwarnings("ignore")


@pytest.mark.parametrize("family", FAMILIES)
def test_run_equals_transformers(family: str, family_factory: Callable, hf_greedy: Callable) -> None:
    path = family_factory(family)
    prompt = max(PROMPTS, key=len)
    assert len(prompt) > WINDOW
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "fastdecode.cli",
            "run",
            "--model",
            str(path),
            "--json",
            "--max-tokens",
            "20",
            "--prompt-ids",
            ",".join(map(str, prompt)),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["token_ids"] == hf_greedy(path, tuple(prompt), 20), family
