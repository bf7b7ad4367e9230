"""`up --decode-steps 4`: each plan runs a sequence for up to 4 decode steps at gpu_dense. Through the
real fleet: greedy tokens equal transformers' (max_tokens not a multiple of 4, requests joining
mid-run), a stop token mid-run ends the sequence there, streams carry several tokens a message,
every token has its logprob and alternatives, and seeded sampling, penalties, stop strings and
structured outputs give what one step a plan gives. `up --decode-steps auto` (the cap while no
request waits, one step while one does) gives the tokens of one step a plan."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from fastdecode.client import Client
from fastdecode.tools.fleet import Fleet, UpProcess
from tests.e2e.test_fleet import PROMPTS_8, scheduler_steps
from tests.e2e.test_reliability import sched_stats
from tests.support import TOKEN

pytestmark = pytest.mark.timeout(400)


def test_several_decode_steps_a_plan_keep_tokens_equal_to_transformers(
    model_factory: Callable, fleet_factory: Callable, hf_greedy: Callable, fleet: UpProcess
) -> None:
    model = model_factory("llama")
    up = fleet_factory(model, "--decode-steps", "4", private=True, timeout=180)
    try:
        with Client(up.target) as client, concurrent.futures.ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(client.generate, token_ids=p, max_tokens=23) for p in PROMPTS_8]
            for prompt, f in zip(PROMPTS_8, futures, strict=True):
                out = f.result(timeout=120)
                assert out.token_ids == hf_greedy(model, tuple(prompt), 23)
                assert out.usage.completion_tokens == len(out.token_ids)

            prompt = PROMPTS_8[1]
            want = hf_greedy(model, tuple(prompt), 23)
            before = scheduler_steps(up)
            assert client.generate(token_ids=prompt, max_tokens=23).token_ids == want
            assert scheduler_steps(up) - before <= 8  # 23 tokens in 6 plans of up to 4 steps, not 23
            stop = next(t for t in want[4:] if want.index(t) >= 4)  # first seen past the 4th token
            out = client.generate(token_ids=prompt, max_tokens=23, stop_token_ids=[stop])
            assert out.token_ids == want[: want.index(stop) + 1] and out.finish_reason == "stop"

            chunks = list(client.stream(token_ids=prompt, max_tokens=23, logprobs=2))
            tokens = [t for c in chunks for t in c.token_ids]
            assert tokens == want
            assert sum(len(c.token_ids) > 1 for c in chunks) >= 3  # a plan's tokens come together
            logprobs = [lp for c in chunks for lp in c.logprobs]
            assert [lp.token_id for lp in logprobs] == want
            # greedy: each token is its position's best alternative
            assert all(len(lp.top) == 2 and lp.top[0][0] == lp.token_id for lp in logprobs)

            # seeded sampling, penalties, min_tokens and a stop string: the same as one step a plan
            # (the shared fleet), since each step's seed, history and stop rules move with its token
            text = client.generate(prompt="Batching many sequences", max_tokens=24, ignore_eos=True).text
            stop = text[len(text) // 2 : len(text) // 2 + 3]
            cases: list[dict[str, Any]] = [
                {"temperature": 1.0, "top_p": 0.9, "seed": 7},
                {"frequency_penalty": 1.5, "presence_penalty": 0.5, "min_tokens": 10},
                {"stop": stop, "ignore_eos": True},
                # a grammar that is done after a few tokens: gpu_dense stops its row at EOS mid-plan
                {"structured": {"choice": ["yes", "no"]}},
                {"structured": {"regex": "[0-9]{6}"}, "temperature": 1.0, "seed": 3},
            ]
            with Client(fleet.target, token=TOKEN) as one:
                for kw in cases:
                    got = client.generate(prompt="Batching many sequences", max_tokens=24, **kw)
                    ref = one.generate(prompt="Batching many sequences", max_tokens=24, **kw)
                    assert (got.token_ids, got.text, got.finish_reason) == (
                        ref.token_ids,
                        ref.text,
                        ref.finish_reason,
                    ), kw
            cut = client.generate(prompt="Batching many sequences", max_tokens=24, stop=stop, ignore_eos=True)
            assert stop.strip() and cut.text == text[: text.index(stop)] and cut.finish_reason == "stop"
    finally:
        up.stop()


def test_decode_steps_auto_gives_the_tokens_of_one_step_a_plan(
    model_factory: Callable, fleet_factory: Callable, hf_greedy: Callable, fleet: UpProcess
) -> None:
    model = model_factory("llama")
    up = fleet_factory(model, "--decode-steps", "auto", private=True, timeout=180)
    try:
        with (
            Client(up.target) as client,
            Client(fleet.target, token=TOKEN) as one,  # the shared fleet: one step a plan
            concurrent.futures.ThreadPoolExecutor(8) as pool,
        ):
            prompt = PROMPTS_8[1]
            before = scheduler_steps(up)
            assert client.generate(token_ids=prompt, max_tokens=23).token_ids == hf_greedy(
                model, tuple(prompt), 23
            )
            # alone, nobody waits after its first token: 1 + 8 + 8 + 6 steps in 4 plans, not 23
            assert scheduler_steps(up) - before <= 8

            # requests joining while others decode: plans go from the cap to one step and back
            futures = []
            for i, p in enumerate(PROMPTS_8):
                futures.append(pool.submit(client.generate, token_ids=p, max_tokens=17 + 3 * i))
                time.sleep(0.05)
            for i, (p, f) in enumerate(zip(PROMPTS_8, futures, strict=True)):
                out = f.result(timeout=120)
                assert out.token_ids == hf_greedy(model, tuple(p), 17 + 3 * i), i
                assert out.token_ids == one.generate(token_ids=p, max_tokens=17 + 3 * i).token_ids, i
                assert out.usage.completion_tokens == len(out.token_ids)
            for kw in (
                {"temperature": 1.0, "top_p": 0.9, "seed": 7},
                {"frequency_penalty": 1.5, "min_tokens": 10},
            ):
                got = client.generate(prompt="Batching many sequences", max_tokens=24, **kw)
                ref = one.generate(prompt="Batching many sequences", max_tokens=24, **kw)
                assert (got.token_ids, got.finish_reason) == (ref.token_ids, ref.finish_reason), kw
    finally:
        up.stop()


def test_kill_9_of_a_shard_or_gpu_dense_mid_plan_costs_time_not_requests(
    model_factory: Callable, tmp_path: Path, hf_greedy: Callable
) -> None:
    """`--decode-steps 4` under kill -9: a shard lost mid-decode (its sequences re-prefilled on the
    other, their tokens of the lost plan dropped), then gpu_dense lost and restarted (the plans out
    aborted and planned again): every request ends with transformers' greedy tokens."""
    model = model_factory("llama")
    f = Fleet(
        model=model,
        shards=2,
        device="cpu",
        kv_capacity=128 << 20,
        workdir=tmp_path,
        scheduler_args=["--health-interval", "0.3", "--decode-steps", "4"],
    )
    f.start()
    try:
        assert f.gateway is not None
        prompts = PROMPTS_8[:6]
        for victim in ("shard", "dense"):
            with (
                Client(f.gateway.address, timeout=120) as client,
                concurrent.futures.ThreadPoolExecutor(6) as pool,
            ):
                streams = [client.stream(token_ids=p, max_tokens=40) for p in prompts]
                firsts = [list(next(s).token_ids) for s in streams]  # every request is decoding
                proc = f.kv[1] if victim == "shard" else f.dense
                assert proc is not None
                os.kill(proc.pid, signal.SIGKILL)
                if victim == "dense":
                    f.restart(proc)
                rest = list(pool.map(lambda s: [t for c in s for t in c.token_ids], streams))
            for p, first, more in zip(prompts, firsts, rest, strict=True):
                assert first + more == hf_greedy(model, tuple(p), 40), victim
            if victim == "shard":
                assert sched_stats(f).recoveries > 0  # the lost shard's sequences were re-prefilled
    finally:
        f.stop()
