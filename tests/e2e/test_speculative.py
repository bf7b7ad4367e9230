"""`up --speculative ngram|suffix`: decode rows carry drafts, gpu_dense verifies them in one step and
the shards attend the k + 1 positions in one read. Through the real fleet: greedy tokens equal
transformers' with drafts kept and rejected, fewer steps than tokens, stop tokens and max_tokens cut a
row's tokens, logprobs per token, grammar rows drafted with a mask at every draft position, and
requests whose processors need their history (penalties) or a seed run undrafted, all with the tokens
they get without speculation."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from typing import Any

import pytest

from fastdecode.client import Client
from fastdecode.runtime.rpc import sync_channel
from fastdecode.tools.fleet import UpProcess
from fastdecode.v1 import scheduler_pb2, scheduler_pb2_grpc
from tests.e2e.test_fleet import PROMPTS_8
from tests.support import TOKEN

pytestmark = pytest.mark.timeout(400)


def _stats(up: UpProcess) -> scheduler_pb2.SchedulerStats:
    stub = scheduler_pb2_grpc.SchedulerStub(
        sync_channel(up.state["scheduler"]["address"], up.peer_credentials)
    )
    return stub.GetStats(scheduler_pb2.SchedulerStatsRequest(), timeout=5)


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_speculative_greedy_tokens_equal_transformers(
    model_factory: Callable, fleet_factory: Callable, hf_greedy: Callable, fleet: UpProcess, method: str
) -> None:
    model = model_factory("llama")
    up = fleet_factory(
        model,
        "--speculative",
        method,
        "--num-speculative-tokens",
        "3",
        "--speculative-k",
        "fixed",  # every row offered 3 drafts: verification, not the choice of k, is tested here
        private=True,
        timeout=180,
    )
    try:
        with Client(up.target) as client, concurrent.futures.ThreadPoolExecutor(8) as pool:
            # a tiny random model repeats itself soon: its own output is what the drafts look up
            futures = [pool.submit(client.generate, token_ids=p, max_tokens=40) for p in PROMPTS_8]
            for prompt, f in zip(PROMPTS_8, futures, strict=True):
                out = f.result(timeout=120)
                assert out.token_ids == hf_greedy(model, tuple(prompt), 40)
                assert out.usage.completion_tokens == len(out.token_ids)
            st = _stats(up)
            assert st.spec_rows > 0 and st.spec_drafts >= st.spec_rows
            assert 0 < st.spec_accepted < st.spec_drafts  # drafts kept and drafts rolled back
            assert st.spec_emitted == st.spec_rows + st.spec_accepted

            prompt = PROMPTS_8[1]
            want = hf_greedy(model, tuple(prompt), 40)
            before = _stats(up)
            chunks = list(client.stream(token_ids=prompt, max_tokens=40, logprobs=2))
            after = _stats(up)
            assert [t for c in chunks for t in c.token_ids] == want
            logprobs = [lp for c in chunks for lp in c.logprobs]
            assert [lp.token_id for lp in logprobs] == want
            assert all(len(lp.top) == 2 and lp.top[0][0] == lp.token_id for lp in logprobs)
            if after.spec_accepted > before.spec_accepted:  # drafts kept: fewer steps than tokens
                assert after.steps - before.steps < len(want)
                assert any(len(c.token_ids) > 1 for c in chunks)
            # a stop token and max_tokens inside a row's tokens cut it there
            stop = next(t for t in want[4:] if want.index(t) >= 4)
            out = client.generate(token_ids=prompt, max_tokens=40, stop_token_ids=[stop])
            assert out.token_ids == want[: want.index(stop) + 1] and out.finish_reason == "stop"
            for n in (1, 2, 7, 13):
                assert client.generate(token_ids=prompt, max_tokens=n).token_ids == want[:n]

            # undrafted rows (penalties, a seed) and grammar rows, drafted with every draft position
            # masked, give what the fleet without drafts gives
            cases: list[dict[str, Any]] = [
                {"frequency_penalty": 1.5, "presence_penalty": 0.5, "min_tokens": 10},
                {"structured": {"regex": "[0-9]{6}"}},
                {"structured": {"regex": "(abc ){6}[0-9]{4}"}},  # repeats: drafts the grammar keeps
                {"temperature": 0.8, "top_p": 0.95, "seed": 11},
            ]
            with Client(fleet.target, token=TOKEN) as plain:
                for kw in cases:
                    before = _stats(up)
                    got = client.generate(prompt="Batching many sequences", max_tokens=24, **kw)
                    ref = plain.generate(prompt="Batching many sequences", max_tokens=24, **kw)
                    assert (got.token_ids, got.finish_reason) == (ref.token_ids, ref.finish_reason), kw
                    after = _stats(up)
                    if "structured" not in kw:
                        assert after.spec_rows == before.spec_rows, kw
                    elif "abc" in str(kw):
                        assert after.spec_accepted > before.spec_accepted, kw
            # unseeded sampling is drafted for: tokens drawn exactly from the target (verify.py)
            out = client.generate(
                token_ids=prompt, temperature=0.8, max_tokens=32, ignore_eos=True, logprobs=0
            )
            assert len(out.token_ids) == len(out.logprobs) == 32
            assert all(lp.logprob <= 0 for lp in out.logprobs)
    finally:
        up.stop()


def test_speculative_with_several_decode_steps_is_refused_in_one_line(model_factory: Callable) -> None:
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "fastdecode.cli", "up", "--model", str(model_factory("llama"))]
    cmd += ["--speculative", "ngram", "--decode-steps", "4"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "--decode-steps 1" in r.stderr and "Traceback" not in r.stderr


def test_speculation_with_int8_kv_keeps_the_tokens_of_int8_kv_without_it(
    model_factory: Callable, fleet_factory: Callable
) -> None:
    """int8 KV scales each token's entry on its own, so rows of drafts, and their rollback, store
    what one token at a time stores: the greedy tokens equal the same fleet's without drafts."""
    model = model_factory("llama")
    outs = []
    for spec in ("off", "ngram"):
        args = (
            "--kv-dtype",
            "int8",
            "--speculative",
            spec,
            "--speculative-k",
            "fixed",
            "--plan-ahead",
            "off",
        )
        up = fleet_factory(model, *args, private=True, timeout=180)
        try:
            with Client(up.target) as client, concurrent.futures.ThreadPoolExecutor(8) as pool:
                futures = [pool.submit(client.generate, token_ids=p, max_tokens=40) for p in PROMPTS_8]
                outs.append([f.result(timeout=120).token_ids for f in futures])
            if spec != "off":
                assert _stats(up).spec_accepted > 0
        finally:
            up.stop()
    assert outs[0] == outs[1]
