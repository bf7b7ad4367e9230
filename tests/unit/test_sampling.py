from __future__ import annotations

import pytest
import torch

from fastdecode.contract import SamplingParams
from fastdecode.dense.sampling import penalize, sample, top_logprobs
from fastdecode.runtime.errors import InvalidInput


def logits(n: int = 4, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax_and_logprob_is_model_logprob() -> None:
    x = logits()
    toks, lps = sample(x, [SamplingParams()] * 4, [0] * 4)
    assert torch.equal(toks, x.argmax(-1))
    torch.testing.assert_close(lps, torch.log_softmax(x, -1).gather(1, toks[:, None]).squeeze(1))


def test_top_k_one_equals_greedy() -> None:
    x = logits(8)
    toks, _ = sample(x, [SamplingParams(temperature=1.5, top_k=1)] * 8, list(range(8)))
    assert torch.equal(toks, x.argmax(-1))


def test_tiny_top_p_equals_greedy() -> None:
    x = logits(8)
    toks, _ = sample(x, [SamplingParams(temperature=1.0, top_p=1e-6)] * 8, [0] * 8)
    assert torch.equal(toks, x.argmax(-1))


def test_seeded_sampling_is_reproducible_and_batch_independent() -> None:
    x = logits(6, seed=3)
    p = [SamplingParams(temperature=1.0, seed=s) for s in (11, 12, 13, 14, 15, 16)]
    a, _ = sample(x, p, [5] * 6)
    b, _ = sample(x, p, [5] * 6)
    assert torch.equal(a, b)
    solo, _ = sample(x[2:3], p[2:3], [5])  # same row alone in the batch: same token
    assert solo.item() == a[2].item()
    draws = {sample(x[:1], [SamplingParams(temperature=1.0, seed=11)], [i])[0].item() for i in range(40)}
    assert len(draws) > 1  # the sample index moves the stream on


def test_top_k_restricts_support_and_distribution_follows_probs() -> None:
    x = torch.tensor([[2.0, 1.0, 0.0, -1.0, -5.0]])
    seen = [sample(x, [SamplingParams(temperature=1.0, top_k=2, seed=7)], [i])[0].item() for i in range(400)]
    assert set(seen) <= {0, 1}
    share = seen.count(0) / len(seen)
    expected = torch.softmax(torch.tensor([2.0, 1.0]), 0)[0].item()  # 0.73
    assert abs(share - expected) < 0.08


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=-1),
        SamplingParams(top_p=0),
        SamplingParams(top_p=1.5),
        SamplingParams(top_k=-2),
        SamplingParams(temperature=float("nan")),
    ],
)
def test_invalid_params(params: SamplingParams) -> None:
    with pytest.raises(InvalidInput):
        params.validate()


def test_penalties_follow_the_openai_and_vllm_definitions() -> None:
    x = torch.tensor([[2.0, -1.0, 0.5, 3.0, 1.0]])
    history = [1, 3, 2, 2, 2]  # prompt [1, 3], then generated 2, 2, 2 (sample_index 3)
    # OpenAI: logit - frequency * count - presence * (count > 0), over the generated tokens only
    got = penalize(x, [SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)], [3], [history])
    assert got.tolist() == [[2.0, -1.0, 0.5 - 1.5 - 0.25, 3.0, 1.0]]
    # vLLM's repetition penalty: prompt and generated tokens, positive logits divided, negative multiplied
    got = penalize(x, [SamplingParams(repetition_penalty=2.0)], [3], [history])
    assert got.tolist() == [[2.0, -2.0, 0.25, 1.5, 1.0]]
    # min_tokens: EOS and the stop ids are out until that many tokens were sampled, then back
    p = SamplingParams(min_tokens=2, suppress_ids=(4,))
    got = penalize(x, [p], [1], [None], eos_ids=[3])
    assert got[0, 3] == float("-inf") and got[0, 4] == float("-inf") and got[0, 0] == 2.0
    assert penalize(x, [p], [2], [None], eos_ids=[3]) is x  # nothing to do: the same tensor
    # the draw uses the penalized logits, the reported logprob stays the model's
    toks, lps = sample(x, [SamplingParams()], [0], processed=got)
    assert toks.item() == 0
    assert lps.item() == pytest.approx(torch.log_softmax(x, -1)[0, 0].item())


def test_top_logprobs_are_the_best_first() -> None:
    lp = torch.log_softmax(torch.tensor([[0.0, 3.0, 1.0, 2.0]]), -1)
    (top,) = top_logprobs(lp, 2)
    assert [t for t, _ in top] == [1, 3]
    assert [v for _, v in top] == pytest.approx([lp[0, 1].item(), lp[0, 3].item()])
    assert top_logprobs(lp, 0) == [()]
    with pytest.raises(InvalidInput):
        SamplingParams(top_logprobs=21).validate()
    with pytest.raises(InvalidInput):
        SamplingParams(presence_penalty=float("nan")).validate()
    with pytest.raises(InvalidInput):
        SamplingParams(repetition_penalty=0).validate()


def test_logit_bias_adds_to_the_logits() -> None:
    x = logits(2)
    top = int(x[0].argmax())
    p = SamplingParams(logit_bias=((top, -100.0), (7, 3.5)))
    out = penalize(x, [p, SamplingParams()], [0, 0], [None, None])
    assert out[0, top] == pytest.approx(x[0, top].item() - 100)
    assert out[0, 7] == pytest.approx(x[0, 7].item() + 3.5)
    assert torch.equal(out[1], x[1])  # a row that asks for nothing is untouched
    toks, lps = sample(x, [p, SamplingParams()], [0, 0], out)
    assert toks[0] != top
    # the logprobs stay the model's (OpenAI: before any processor)
    assert lps[0] == pytest.approx(torch.log_softmax(x[0], -1)[toks[0]].item())
    forced = SamplingParams(temperature=1.0, logit_bias=((11, 100.0),))
    draws = [int(sample(x[:1], [forced], [i], penalize(x[:1], [forced], [i], [None]))[0]) for i in range(20)]
    assert set(draws) == {11}


def test_allowed_token_ids_limit_what_is_sampled() -> None:
    x = logits(1, vocab=50)
    p = SamplingParams(temperature=2.0, seed=5, allowed_token_ids=(3, 9, 40))
    draws = {int(sample(x, [p], [i], penalize(x, [p], [i], [None]))[0]) for i in range(60)}
    assert draws <= {3, 9, 40} and len(draws) > 1


def test_bad_words_ban_a_last_token_after_the_rest() -> None:
    x = torch.zeros(1, 10)
    x[0, 4] = 5.0
    one = SamplingParams(bad_words=((4,),))
    assert int(sample(x, [one], [0], penalize(x, [one], [0], [None]))[0]) != 4
    two = SamplingParams(bad_words=((2, 4),))
    # history: prompt [1] + generated [2]: the word's prefix was just generated, so 4 is banned
    assert penalize(x, [two], [1], [[1, 2]])[0, 4] == float("-inf")
    assert penalize(x, [two], [1], [[1, 3]])[0, 4] == 5.0  # another prefix: allowed
    assert penalize(x, [two], [0], [[2]])[0, 4] == 5.0  # the prompt's 2 is not a generated token
    assert two.needs_history and not one.needs_history


def test_min_p_drops_the_unlikely_tail() -> None:
    x = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    p = SamplingParams(temperature=1.0, min_p=0.5)  # keeps p >= 0.25: tokens 0 and 1
    draws = {int(sample(x, [p], [i])[0][0]) for i in range(200)}
    assert draws == {0, 1}
    assert {int(sample(x, [SamplingParams(temperature=1.0)], [i])[0][0]) for i in range(200)} == {0, 1, 2, 3}


@pytest.mark.parametrize(
    "params",
    [SamplingParams(min_p=1.5), SamplingParams(logit_bias=((1, 101.0),)), SamplingParams(bad_words=((),))],
)
def test_invalid_processor_params(params: SamplingParams) -> None:
    with pytest.raises(InvalidInput):
        params.validate()


def test_chosen_logprobs_equal_log_softmax_with_masked_and_tiny_logits() -> None:
    from fastdecode.dense.sampling import chosen_logprobs

    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 5000, generator=g) * 3
    x[:, 100:300] = -1e4  # an emulated device's out-of-vocabulary ids
    x[3, 7:50] = float("-inf")  # a mask
    for tokens in (x.argmax(-1), torch.randint(0, 100, (40,), generator=g)):
        ref = torch.log_softmax(x.double(), -1).gather(1, tokens[:, None]).squeeze(1)
        got = chosen_logprobs(x, tokens)
        assert torch.allclose(got.double(), ref, atol=1e-5, rtol=0), (got.double() - ref).abs().max()
