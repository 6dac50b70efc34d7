"""Next-token sampling on hand-made logits: filters keep what they should, draws follow the law."""

import math

import pytest
import torch

from megatron_grpo.embedded.sampling import (
    counter_uniform,
    sample_next_tokens,
    sampling_probs,
    token_logprobs,
)

pytestmark = pytest.mark.timeout(60)

# probabilities 0.5, 0.25, 0.125, 0.125 at temperature 1
LOGITS_V = torch.log(torch.tensor([0.5, 0.25, 0.125, 0.125]))


def _probs(temperature=1.0, top_k=-1, top_p=1.0, logits=LOGITS_V):
    return sampling_probs(
        logits[None, :],
        torch.tensor([temperature]),
        torch.tensor([top_k]),
        torch.tensor([top_p]),
    )[0]


def test_no_filter_is_softmax():
    torch.testing.assert_close(_probs(), torch.tensor([0.5, 0.25, 0.125, 0.125]))


def test_temperature_scales_logits():
    expected = torch.softmax(LOGITS_V / 0.5, dim=-1)
    torch.testing.assert_close(_probs(temperature=0.5), expected)


def test_top_k_keeps_k_most_likely_renormalized():
    torch.testing.assert_close(_probs(top_k=2), torch.tensor([2 / 3, 1 / 3, 0.0, 0.0]))


def test_top_p_keeps_tokens_whose_preceding_mass_is_at_most_p():
    # mass before each sorted token: 0, 0.5, 0.75, 0.875 (kept at equality, as SGLang)
    torch.testing.assert_close(_probs(top_p=0.4), torch.tensor([1.0, 0.0, 0.0, 0.0]))
    torch.testing.assert_close(_probs(top_p=0.5), torch.tensor([2 / 3, 1 / 3, 0.0, 0.0]))
    torch.testing.assert_close(_probs(top_p=0.6), torch.tensor([2 / 3, 1 / 3, 0.0, 0.0]))
    torch.testing.assert_close(_probs(top_p=0.8), torch.tensor([4 / 7, 2 / 7, 1 / 7, 0.0]))


def test_greedy_rows_are_one_hot():
    for probs in (_probs(temperature=0.0), _probs(top_k=1)):
        torch.testing.assert_close(probs, torch.tensor([1.0, 0.0, 0.0, 0.0]))


def test_draws_follow_the_filtered_distribution():
    num_draws = 4000
    logits_BV = LOGITS_V.repeat(num_draws, 1)
    tokens = sample_next_tokens(
        logits_BV,
        torch.full((num_draws,), 0.5),
        torch.full((num_draws,), 3),
        torch.ones(num_draws),
        torch.arange(num_draws),
        torch.zeros(num_draws, dtype=torch.long),
    )
    freq = torch.bincount(tokens, minlength=4).float() / num_draws
    expected = torch.softmax(LOGITS_V[:3] / 0.5, dim=-1)
    assert freq[3] == 0
    # 4 standard errors of a binomial frequency
    tolerance = 4 * math.sqrt(0.25 / num_draws)
    assert torch.allclose(freq[:3], expected, atol=tolerance), (freq, expected)


def test_one_seed_draws_the_law_along_its_positions():
    num_draws = 4000
    positions = torch.arange(num_draws)
    tokens = sample_next_tokens(
        LOGITS_V.repeat(num_draws, 1),
        torch.ones(num_draws),
        torch.full((num_draws,), -1),
        torch.ones(num_draws),
        torch.full((num_draws,), 7),
        positions,
    )
    freq = torch.bincount(tokens, minlength=4).float() / num_draws
    tolerance = 4 * math.sqrt(0.25 / num_draws)
    assert torch.allclose(freq, torch.exp(LOGITS_V), atol=tolerance), freq


def test_counter_uniform_is_uniform_and_a_function_of_seed_and_counter():
    seeds = torch.tensor([0, 1, 2**62, -5]).repeat_interleave(2500)
    counters = torch.arange(10_000)
    u = counter_uniform(seeds, counters)
    assert u.dtype == torch.float64 and bool(((u >= 0) & (u < 1)).all())
    assert abs(float(u.mean()) - 0.5) < 4 * math.sqrt(1 / 12 / len(u))
    torch.testing.assert_close(counter_uniform(seeds[:7], counters[:7]), u[:7], rtol=0, atol=0)


def test_each_row_draws_with_its_own_seed():
    logits_BV = torch.zeros(2, 50)  # uniform: every draw depends on the seed only
    temps, top_k, top_p = torch.ones(2), torch.full((2,), -1), torch.ones(2)

    def draw(seeds):
        return [
            sample_next_tokens(
                logits_BV, temps, top_k, top_p, torch.tensor(seeds), torch.full((2,), t)
            ).tolist()
            for t in range(5)
        ]

    first = draw([1, 2])
    assert draw([1, 2]) == first
    assert len({step[0] for step in first}) > 1  # positions draw afresh
    # row 0 with seed 1 draws the same whatever row 1 does
    assert [step[0] for step in draw([1, 99])] == [step[0] for step in first]


def test_greedy_rows_take_the_argmax_whatever_the_seed():
    for seed in range(5):
        token = sample_next_tokens(
            LOGITS_V[None, :],
            torch.zeros(1),
            torch.tensor([-1]),
            torch.ones(1),
            torch.tensor([seed]),
            torch.tensor([seed]),
        )
        assert token.tolist() == [0]


def test_zero_probability_tokens_are_never_drawn():
    logits_BV = torch.tensor([[0.0, -math.inf, 0.0, -math.inf]]).repeat(2000, 1)
    tokens = sample_next_tokens(
        logits_BV,
        torch.ones(2000),
        torch.full((2000,), -1),
        torch.ones(2000),
        torch.arange(2000),
        torch.arange(2000),
    )
    assert set(tokens.tolist()) == {0, 2}


def test_token_logprobs_are_raw_log_softmax():
    logits_BV = torch.tensor([[2.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    got = token_logprobs(logits_BV, torch.tensor([0, 2]))
    expected = torch.stack([torch.log_softmax(logits_BV[0], -1)[0], torch.tensor(math.log(1 / 3))])
    torch.testing.assert_close(got, expected)
