"""Checkpoint facts that need a second process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from fastdecode.tools import checkpoint as ck

REPO = Path(__file__).resolve().parents[2]


def test_tokenizer_training_deterministic_across_processes():
    # In-process: retrain, bypassing the cache.
    first = ck.train_tokenizer.__wrapped__(2048, "bytelevel")
    assert first == ck.train_tokenizer.__wrapped__(2048, "bytelevel")
    # Another process (other hash seeds) with one worker thread gives the same bytes.
    code = (
        "import sys; from fastdecode.tools import checkpoint as ck; "
        "assert 'transformers' not in sys.modules; "
        "sys.stdout.write(ck.train_tokenizer(2048, 'bytelevel'))"
    )
    env = {**os.environ, "RAYON_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True, check=True
    )
    assert out.stdout == first
