"""The `fastdecode` commands a user points at a running fleet, and the ones that make and run a model
locally, each once at a tiny size, their output checked field by field (the session fleet of
tests/e2e/conftest.py). Elsewhere: `up` (test_up_lifecycle.py, test_up_progress.py), `shards`
(test_shard_drain.py), `serve` (every fleet), `import-gguf` (tests/integration/test_gguf_import.py),
`simulate` and `plan` (tests/unit/test_planner.py), `bench` (tests/integration/test_bench_*.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from fastdecode.tools.fleet import UpProcess
from tests.support import TOKEN


def cli(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "fastdecode.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def test_health_names_the_servers_status(fleet: UpProcess) -> None:
    done = cli("health", "--target", fleet.target)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"{fleet.target}: SERVING"


def test_generate_json_fields(fleet: UpProcess) -> None:
    args = ["generate", "the cache", "--target", fleet.target, "--max-tokens", "4", "--ignore-eos", "--json"]
    done = cli(*args, "--token", TOKEN)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(out) == {"text", "token_ids", "finish_reason", "usage"}
    assert len(out["token_ids"]) == 4 and out["finish_reason"] == "length" and isinstance(out["text"], str)
    assert out["usage"]["completion_tokens"] == 4 and out["usage"]["prompt_tokens"] > 0


def test_make_model_run_and_demo(tmp_path: Path) -> None:
    """make-model writes a checkpoint (with a chat template), run generates from it in process, and
    demo starts a fleet on it, streams the answer to one chat question and stops the fleet."""
    made = cli(
        "make-model", "--arch", "qwen2", "--out", str(tmp_path / "m"), "--seed", "3", "--chat-template"
    )
    assert made.returncode == 0, made.stderr
    path = Path(made.stdout.strip().splitlines()[-1])
    assert (path / "config.json").is_file() and (path / "tokenizer.json").is_file()
    done = cli("run", "--model", str(path), "--prompt-ids", "1,7,42", "--max-tokens", "3", "--json")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(out) == {"token_ids", "text", "finish_reason"} and len(out["token_ids"]) == 3, out
    assert out["finish_reason"] in ("length", "stop")
    demo = cli("demo", "--model", str(path), "--max-tokens", "4", timeout=300)
    assert demo.returncode == 0, demo.stderr[-2000:]
    assert "fleet stopped; demo took" in demo.stderr
