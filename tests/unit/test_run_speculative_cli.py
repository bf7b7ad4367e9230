"""`fastdecode run --speculative` through click (in-process, LocalEngine): the tokens equal the run
without drafts, the JSON reports tau and the drafts kept, and a setting that does not fit is one
usage error, never a traceback."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner

from fastdecode.cli.tools import run

PROMPT_IDS = ",".join(map(str, [5, 17, 42, 99, 7, 13, 21, 8] * 4))


def _run(*args: str) -> dict:
    res = CliRunner().invoke(run, ["--prompt-ids", PROMPT_IDS, "--json", *args])
    assert res.exit_code == 0, res.output
    return json.loads(res.output.strip().splitlines()[-1])


def test_run_speculative_equals_run_without(family_factory: Callable[[str], Path]) -> None:
    model = str(family_factory("gemma2"))  # its greedy output repeats itself: drafts are kept
    plain = _run("--model", model, "--max-tokens", "24")
    spec = _run(
        "--model", model, "--max-tokens", "24", "--speculative", "ngram", "--num-speculative-tokens", "4"
    )
    assert spec["token_ids"] == plain["token_ids"] and len(spec["token_ids"]) == 24
    assert spec["finish_reason"] == plain["finish_reason"]
    assert "speculative" not in plain
    s = spec["speculative"]
    assert s["method"] == "ngram" and 0 < s["drafts_kept"] <= s["drafts"]
    assert s["tau"] > 1 and s["verified_rows"] > 0


def test_run_speculative_text_reports_tau(
    model_factory: Callable[[str], Path], family_factory: Callable[[str], Path]
) -> None:
    base = ["--prompt-ids", PROMPT_IDS, "--max-tokens", "12"]
    res = CliRunner().invoke(
        run, ["--model", str(family_factory("gemma2")), *base, "--speculative", "suffix"]
    )
    assert res.exit_code == 0, res.output
    assert re.search(
        r"\[12 tokens, finish_reason=length, tau [0-9.]+, drafts kept [0-9]+/[0-9]+\]", res.output
    )
    # the random llama's output never repeats its prompt: no row carries drafts, and it says so
    res = CliRunner().invoke(run, ["--model", str(model_factory("llama")), *base, "--speculative", "ngram"])
    assert res.exit_code == 0, res.output
    assert "no drafts found" in res.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--speculative", "eagle"], "'eagle' is not one of"),
        (["--num-speculative-tokens", "2"], "need --speculative"),
        (["--speculative", "ngram", "--num-speculative-tokens", "0"], "--num-speculative-tokens"),
        (["--speculative", "suffix", "--prompt-lookup-min", "2"], "ngram only"),
        (
            ["--speculative", "ngram", "--prompt-lookup-min", "3", "--prompt-lookup-max", "2"],
            "must not exceed",
        ),
        (["--speculative", "ngram", "--temperature", "0.7", "--seed", "3"], "seeded"),
    ],
)
def test_run_speculative_bad_settings(args: list[str], message: str) -> None:
    # refused before any model is read (--model names nothing)
    res = CliRunner().invoke(run, ["--model", "/nonexistent", "--prompt-ids", "1,2", *args])
    assert res.exit_code == 2, res.output
    assert message in res.output
    assert isinstance(res.exception, SystemExit) and "Traceback" not in res.output
