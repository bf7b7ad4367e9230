"""`n` > 1 prefills the prompt once: the n choices are n sequences of one prompt submitted together,
and prefix sharing makes the siblings wait for the first one's prefill and read its full KV blocks
(the block holding the last prompt token is each choice's own). Real model (SmolLM2, fp32 KV: with
bf16 KV a choice that computed the prompt and a request that read it cached can differ past bf16's
rounding, enough to flip a seeded draw), the
official `openai` client; each choice equals the single request with seed + its index; with
`--prefix-sharing off` n > 1 still works, every choice prefilling the prompt itself.

"Equals" up to fp32: N choices decode at batch N, the single request at batch 1, and the matmuls'
last bits differ with the batch. A seeded draw is an exponential race (fastdecode/dense/sampling.py),
so two runs can part where two candidates' p/E nearly tie or where two near-equal logits swap
ranks (and so their noise). A parting is accepted only where the test, rebuilding the sampler's
noise from the seed, sees one of those in the two runs' top logprobs; CI saw one such flip in ~20
runs ("Lady Mandarin" / "Lady Crocodile", choice 2). The draws are limited to the top 20 (top_k, the
vLLM extension), the tokens whose logprobs come back: unlimited, a draw won by a tail token can flip
on a swap of two near-equal tail logits the test cannot see (CI saw "hem" / " undefined")."""

from __future__ import annotations

import math
import uuid
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch

from fastdecode.dense.sampling import row_generator
from fastdecode.tools.fleet import UpProcess
from tests.support import FleetFactory, metric_total, scrape

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

BLOCK = 16  # the fleet's default KV block size
N = 4
HIT_TOKENS = "fastdecode_kv_prefix_hit_tokens_total"


def hit_tokens(fleet: UpProcess) -> float:
    return sum(metric_total(scrape(k["metrics"]), HIT_TOKENS) for k in fleet.state["kv_attention"])


def messages() -> list[dict[str, str]]:
    # A prompt of several blocks no earlier request of the fleet has cached (the nonce comes first).
    system = f"Session {uuid.uuid4().hex}. " + "You are a terse assistant who answers in one short line. " * 8
    return [{"role": "system", "content": system}, {"role": "user", "content": "Name a color."}]


VOCAB = 49152  # SmolLM2's vocabulary: the width of the sampler's noise
TOP = 20  # the top logprobs asked for: the race's contenders at a parting


def race(seed: int, t: int, top: list) -> list[float]:
    """p / E for the top tokens of draw t of a seeded row: the sampler's exponential race, its noise
    rebuilt from the seed (noise r goes to the token of rank r)."""
    gen = row_generator(seed, t, torch.device("cpu"))
    noise = torch.empty(VOCAB).exponential_(generator=gen)[: len(top)].tolist()
    return [math.exp(c.logprob) / e for c, e in zip(top, noise, strict=True)]


def same_draws(a: list, b: list, seed: int) -> None:
    """Two runs of one seeded choice (their logprobs.content) drew the same tokens, or parted only at
    a near tie of the sampler's race, and agreed on the model's distribution until then."""
    for run in (a, b):  # the rebuilt race is the sampler's: the chosen token won it
        for t, pos in enumerate(run):
            top, scores = pos.top_logprobs, race(seed, t, pos.top_logprobs)
            assert top[scores.index(max(scores))].token == pos.token, (t, pos.token, top)
    parted = next((t for t, (x, y) in enumerate(zip(a, b, strict=False)) if x.token != y.token), None)
    if parted is None:
        assert [x.token for x in a] == [y.token for y in b]
        return
    for x, y in zip(a[:parted], b[:parted], strict=True):
        assert abs(x.logprob - y.logprob) < 1e-3, (x, y)  # same distribution, up to fp32
    chosen = (a[parted].token, b[parted].token)
    ranks, ties = [], []
    for run in (a, b):
        top = run[parted].top_logprobs
        names = [c.token for c in top]
        assert all(tok in names for tok in chosen), (chosen, names)  # both contenders in the top
        scores = race(seed, parted, top)
        s0, s1 = (scores[names.index(tok)] for tok in chosen)
        ties.append(abs(s0 - s1) <= 1e-3 * max(s0, s1))
        ranks.append(names[: max(names.index(tok) for tok in chosen) + 1])
    assert any(ties) or ranks[0] != ranks[1], (parted, chosen, ties, ranks)


def run_n(fleet: UpProcess, sharing: bool) -> None:
    shards = len(fleet.state["kv_attention"])
    with openai.OpenAI(base_url=f"http://{fleet.http}/v1", api_key="x", timeout=120, max_retries=0) as oa:
        kw = {"model": fleet.model.name, "max_tokens": 8, "temperature": 1.0, "messages": messages()}
        kw["extra_body"] = {"top_k": TOP}  # the race's contenders are the top logprobs the test sees
        before = hit_tokens(fleet)
        r = oa.chat.completions.create(n=N, seed=500, logprobs=True, top_logprobs=TOP, **kw)
        reused = hit_tokens(fleet) - before
        prompt = r.usage.prompt_tokens
        assert prompt > 4 * BLOCK
        full = (prompt - 1) // BLOCK * BLOCK  # the last prompt token's block is each choice's own
        per_choice = r.usage.prompt_tokens_details.model_extra["choices_cached_tokens"]
        if sharing:
            # One choice computed the prompt; the siblings waited for it and read its full blocks on
            # its shard (however many shards there are).
            assert sorted(per_choice) == [0] + [full] * (N - 1), (shards, per_choice)
            assert reused == (N - 1) * full
        else:
            assert per_choice == [0] * N and reused == 0
        assert r.usage.prompt_tokens_details.cached_tokens == 0  # the prompt, counted once, was new
        assert [c.index for c in r.choices] == list(range(N))
        for c in r.choices:
            alone = oa.chat.completions.create(seed=500 + c.index, logprobs=True, top_logprobs=TOP, **kw)
            same_draws(c.logprobs.content, alone.choices[0].logprobs.content, 500 + c.index)
            assert alone.usage.prompt_tokens == prompt  # the prompt counted once
            assert alone.usage.prompt_tokens_details.cached_tokens == (full if sharing else 0)


@pytest.fixture(scope="module")
def one_shard(smollm2: Path, fleet_factory: FleetFactory) -> Iterator[UpProcess]:
    f = fleet_factory(smollm2, "--shards", "1", http=True, private=True)
    yield f
    f.stop()


def test_n_prefills_the_prompt_once(one_shard: UpProcess) -> None:
    run_n(one_shard, sharing=True)


def test_n_on_two_shards_prefills_the_prompt_once(real_fleet: UpProcess) -> None:
    run_n(real_fleet, sharing=True)  # the prompt is new to the fleet (its nonce), the counts deltas


def test_n_without_prefix_sharing_prefills_each_choice(smollm2: Path, fleet_factory: FleetFactory) -> None:
    f = fleet_factory(smollm2, "--prefix-sharing", "off", http=True, private=True)
    try:
        run_n(f, sharing=False)
    finally:
        f.stop()
