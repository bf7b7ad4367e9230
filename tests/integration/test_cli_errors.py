"""Every command, fed bad arguments or a broken checkpoint, ends in one clear line and a non-zero
exit, never a traceback; and `run` on a model whose vocab exceeds its tokenizer's returns JSON."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.support.gguf import write_gguf

REPO = Path(__file__).resolve().parents[2]


def cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fastdecode.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
    )


def assert_one_line_error(proc: subprocess.CompletedProcess[str], *needles: str) -> None:
    err = proc.stderr.strip()
    assert proc.returncode != 0, (proc.stdout, err)
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.strip()]
    errors = [line for line in lines if line.lower().startswith("error")]
    assert len(errors) == 1, err  # usage errors also print click's usage lines, then one error line
    for needle in needles:
        assert needle in errors[0], err


@pytest.fixture(scope="module")
def broken(model_factory, tmp_path_factory) -> dict[str, Path]:
    """Checkpoints broken in the ways users meet them."""
    src = model_factory("llama")
    root = tmp_path_factory.mktemp("broken")

    def copy(name: str) -> Path:
        return Path(shutil.copytree(src, root / name))

    out = {"missing": root / "nope"}
    d = copy("truncated")
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])
    out["truncated"] = d
    d = copy("no-weights")
    (d / "model.safetensors").unlink()
    out["no-weights"] = d
    d = copy("no-config")
    (d / "config.json").unlink()
    out["no-config"] = d
    d = copy("wrong-shape")
    cfg = json.loads((d / "config.json").read_text())
    cfg["intermediate_size"] += 16
    (d / "config.json").write_text(json.dumps(cfg))
    out["wrong-shape"] = d
    d = copy("wrong-type")
    cfg["intermediate_size"] = "large"
    (d / "config.json").write_text(json.dumps(cfg))
    out["wrong-type"] = d
    d = copy("bad-json")
    (d / "config.json").write_text("{not json")
    out["bad-json"] = d
    d = copy("bad-tokenizer")
    (d / "tokenizer.json").write_text("[]")
    out["bad-tokenizer"] = d
    out["unsupported-gguf"] = write_gguf(src, root / "gpt2.gguf", arch="gpt2")
    garbage = root / "garbage.gguf"
    garbage.write_bytes(b"GGUF" + b"\xff" * 64)
    out["garbage-gguf"] = garbage
    return out


CHECKPOINT_CASES = {
    "missing": "no such model directory",
    "truncated": "truncated",
    "no-weights": "no model.safetensors",
    "no-config": "no config.json",
    "wrong-shape": "config.json implies",
    "wrong-type": "wrong type",
    "bad-json": "cannot read",
    "bad-tokenizer": "does not load",
    "unsupported-gguf": "unsupported GGUF architecture 'gpt2'",
    "garbage-gguf": "not a readable GGUF",
}


@pytest.mark.parametrize("case", sorted(CHECKPOINT_CASES))
def test_run_on_broken_checkpoints(broken, case):
    assert_one_line_error(
        cli("run", "--model", str(broken[case]), "--prompt", "hi", "--json"), CHECKPOINT_CASES[case]
    )


@pytest.mark.parametrize(
    "command, case",
    [("up", "truncated"), ("up", "unsupported-gguf"), ("demo", "wrong-shape"), ("generate", "garbage-gguf")],
)
def test_fleet_commands_on_broken_checkpoints(broken, case, command, tmp_path):
    """The fleet commands check the model before any service starts."""
    args = {
        "up": ["up", "--port", "0", "--model"],
        "demo": ["demo", "--model"],
        "generate": ["generate", "hi", "--chat", "--target", "127.0.0.1:9", "--model"],
    }[command]
    assert_one_line_error(cli(*args, str(broken[case])), CHECKPOINT_CASES[case])


@pytest.mark.parametrize(
    "args, needle",
    [
        (["run", "--prompt", "a", "--prompt-ids", "1"], "exactly one of"),
        (["run", "--prompt-ids", "1,x", "--model", "."], "comma-separated"),
        (["run", "--chat", "--prompt-ids", "1"], "--chat needs --prompt"),
        (["run", "--max-tokens", "many"], "many"),
        (["import-gguf"], "Missing argument"),
        (["import-gguf", "x.gguf"], "--out"),
        (["import-gguf", "x.gguf", "--out", "o", "--dtype", "int3"], "int3"),
        (["make-model", "--arch", "gpt2", "--out", "o"], "gpt2"),
        (["generate", "hi"], "--target"),
        (["up", "--shards", "0"], "0"),
        (["bench", "fleet", "--kv-dtype", "int8"], "int8"),
        (["health"], "--target"),
        (["no-such-command"], "no-such-command"),
    ],
)
def test_bad_arguments(args, needle):
    assert_one_line_error(cli(*args), needle)


@pytest.mark.parametrize(
    "extra, needle",
    [
        (["--kv-capacity", "1"], "a shard needs at least 262144 bytes"),  # tiny llama: 8 KiB a token
        # the emulated geometry's tokens count, not the checkpoint's: 256 KiB each
        (["--device", "emulated:l4", "--geometry", "llama-3-8b", "--kv-capacity", "4000000"], "8388608"),
        (["--kv-capacity", str(1 << 50)], "available memory"),
    ],
)
def test_up_refuses_a_kv_capacity_at_its_flag(model_factory, extra, needle):
    """Not in the scheduler or a shard during start, with a traceback after the reason."""
    proc = cli("up", "--port", "0", "--model", str(model_factory("llama")), *extra)
    assert proc.returncode == 2, proc.stderr
    assert_one_line_error(proc, "--kv-capacity", needle)


def test_import_gguf_bad_files(broken, tmp_path):
    for case in ("missing", "unsupported-gguf", "garbage-gguf"):
        file = broken[case] if case != "missing" else tmp_path / "none.gguf"
        needle = CHECKPOINT_CASES[case] if case != "missing" else "no such GGUF file"
        assert_one_line_error(cli("import-gguf", str(file), "--out", str(tmp_path / case)), needle)


def test_bench_on_a_broken_checkpoint(broken):
    assert_one_line_error(
        cli("bench", "fleet", "--model", str(broken["no-config"]), "--skip-hf"), "no config.json"
    )


def test_run_when_config_vocab_exceeds_the_tokenizer(model_factory, tmp_path):
    """A config vocab larger than the tokenizer's (as Qwen2 checkpoints pad theirs): ids the
    tokenizer does not know decode to nothing, as in transformers, and run prints JSON."""
    d = Path(shutil.copytree(model_factory("llama"), tmp_path / "padded"))
    tensors = load_file(str(d / "model.safetensors"))
    extra = 128
    # The padded rows are scaled copies of real ones, so the model emits the padded ids.
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        t = tensors[name]
        tensors[name] = torch.cat([t, 10 * t[:extra]])
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((d / "config.json").read_text())
    vocab = cfg["vocab_size"]
    cfg["vocab_size"] = vocab + extra
    (d / "config.json").write_text(json.dumps(cfg))
    proc = cli("run", "--model", str(d), "--prompt", "The KV cache", "--max-tokens", "6", "--json")
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    out = json.loads(proc.stdout)
    assert any(t >= vocab for t in out["token_ids"]), out  # the case this test is about happened
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_file=str(d / "tokenizer.json"))
    assert out["text"] == hf.decode(out["token_ids"], skip_special_tokens=True)
    # and streaming (no --json) prints the same text
    streamed = cli("run", "--model", str(d), "--prompt", "The KV cache", "--max-tokens", "6")
    assert streamed.returncode == 0, streamed.stderr
    assert streamed.stdout.rstrip("\n") == "The KV cache" + out["text"]


def test_run_refuses_bad_arguments_and_checkpoints_before_loading_torch(broken):
    """A bad `run` fails in a fraction of a second: torch (a second of CPU) loads only after the
    arguments and the checkpoint pass."""
    probe = (
        "import sys\nfrom fastdecode.cli import main\n"
        "try:\n    main(sys.argv[1:], standalone_mode=False)\n"
        "except Exception as e:\n    print(type(e).__name__)\n"
        "print('torch' in sys.modules)"
    )
    for args in (
        ["--prompt", "a", "--prompt-ids", "1"],
        ["--model", str(broken["bad-json"]), "--prompt", "a"],
    ):
        out = subprocess.run(
            [sys.executable, "-c", probe, "run", *args], capture_output=True, text=True, timeout=120
        )
        assert out.stdout.split()[-2:] in (["UsageError", "False"], ["ClickException", "False"]), out
