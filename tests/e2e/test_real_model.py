"""The fleet on a real model (SmolLM2-135M-Instruct, imported from its GGUF): greedy fp32 tokens
through the SDK and through /v1/chat/completions (whole and streamed) equal transformers' on the
same GGUF, and the capital-of-France answer names Paris. Generations stay short for CI."""

from __future__ import annotations

import concurrent.futures
import json
import subprocess
import sys
import urllib.request

import pytest

from fastdecode.client import Client
from fastdecode.runtime.rpc import sync_channel
from fastdecode.tools.fleet import state_credentials
from fastdecode.v1 import kv_attention_pb2 as kv_pb
from fastdecode.v1 import kv_attention_pb2_grpc as kv_grpc
from tests.support.gguf import CHAT_QUESTIONS, hf_chat_greedy

# Start-up loads two copies of the model (fleet, transformers oracle): slow on a 2-core CI machine.
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

NEW_TOKENS = 10


@pytest.fixture(scope="module")
def expected(smollm2_hf) -> dict[str, tuple[list[int], list[int]]]:
    return {q: hf_chat_greedy(smollm2_hf, q, NEW_TOKENS) for q in CHAT_QUESTIONS}


def _post(base: str, body: dict) -> bytes:
    req = urllib.request.Request(
        base + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        return resp.read()


def test_sdk_greedy_equals_transformers(real_fleet, expected):
    with Client(real_fleet.target) as client:
        for question, (prompt, want) in expected.items():
            got = client.generate(token_ids=prompt, max_tokens=NEW_TOKENS, timeout=120)
            assert got.token_ids == want, question


def test_chat_completions_equal_transformers(real_fleet, expected, smollm2_hf):
    tok = smollm2_hf[1]
    base = f"http://{real_fleet.http}"
    for question, (_, want) in expected.items():
        # /v1/chat/completions stops at <|im_end|> (EOS) and leaves it out of the text.
        want_text = tok.decode(want, skip_special_tokens=True)
        body = {
            "messages": [{"role": "user", "content": question}],
            "max_tokens": NEW_TOKENS,
            "temperature": 0,
        }
        whole = json.loads(_post(base, body))
        assert whole["choices"][0]["message"]["content"] == want_text, question
        assert whole["usage"]["completion_tokens"] == len(want), question
        chunks = [
            json.loads(line[len(b"data: ") :])
            for line in _post(base, {**body, "stream": True}).splitlines()
            if line.startswith(b"data: ") and line != b"data: [DONE]"
        ]
        streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
        assert streamed == want_text, question


def test_capital_of_france_is_paris(real_fleet):
    base = f"http://{real_fleet.http}"
    body = {
        "messages": [{"role": "user", "content": CHAT_QUESTIONS[0]}],
        "max_tokens": 16,
        "temperature": 0,
    }
    answer = json.loads(_post(base, body))["choices"][0]["message"]["content"]
    assert "Paris" in answer, answer


@pytest.mark.parametrize("command", ["generate", "run"])
def test_chat_flag_of_the_cli(command, real_fleet, expected, smollm2):
    """`generate --chat` (through the fleet) and `run --chat` (in-process) send the question through
    the chat template: the same greedy tokens as transformers."""
    question = CHAT_QUESTIONS[1]
    args = {
        "generate": ["generate", question, "--target", real_fleet.target],
        "run": ["run", "--prompt", question],
    }[command]
    proc = subprocess.run(
        [sys.executable, "-m", "fastdecode.cli", *args, "--chat", "--model", str(smollm2)]
        + ["--max-tokens", str(NEW_TOKENS), "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["token_ids"] == expected[question][1]


def test_greedy_equals_transformers_with_a_shard_hosted_in_gpu_dense(smollm2, expected, fleet_factory):
    """`up --host-shard`: one shard process and one shard in gpu_dense's own process, whose items
    never touch the wire. The questions run at once, so the scheduler places on both; every one's
    tokens equal transformers', and the hosted shard attended its share."""
    up = fleet_factory(smollm2, "--shards", "1", "--host-shard", private=True)
    try:
        with Client(up.target) as client, concurrent.futures.ThreadPoolExecutor(len(expected)) as pool:
            runs = {
                q: pool.submit(client.generate, token_ids=prompt, max_tokens=NEW_TOKENS, timeout=120)
                for q, (prompt, _) in expected.items()
            }
            for question, (_, want) in expected.items():
                assert runs[question].result().token_ids == want, question
        with sync_channel(up.state["host_shard"], state_credentials(up.state)) as ch:
            stats = kv_grpc.KVAttentionStub(ch).Stats(kv_pb.StatsRequest(), timeout=30)
        assert stats.configured and stats.attended_token_pairs > 0
    finally:
        up.stop()
