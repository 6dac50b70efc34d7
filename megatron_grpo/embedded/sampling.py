"""Next-token sampling for the embedded server: pure functions on a batch of logits.

Per row: temperature (0 = greedy), then top-k and top-p on the
temperature-scaled distribution, both taken on the same sorted order (a token
is kept when it is among the ``top_k`` most likely and the mass strictly
before it is at most ``top_p``), as SGLang's torch-native sampler does. Rows
that filter nothing skip the sort.

The draw is one inverse-CDF lookup per row, with a uniform number that is a
hash of the row's seed and the token's position (``counter_uniform``): the
whole batch samples in a few tensor operations, and a seeded sample does not
depend on what else is in the batch.
"""

from __future__ import annotations

import torch

# splitmix64's constants as signed 64-bit integers (torch has no uint64 arithmetic).
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)
_MIX1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MIX2 = 0x94D049BB133111EB - (1 << 64)


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 values (torch's ``>>`` keeps the sign)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def counter_uniform(seed_B: torch.Tensor, counter_B: torch.Tensor) -> torch.Tensor:
    """A float64 in [0, 1) per row: splitmix64 of (seed, counter), a function of them only.

    Multiplications wrap around in 64 bits, as splitmix64 needs.
    """
    z = seed_B.long() * _GOLDEN + (counter_B.long() + 1) * _GOLDEN
    z = (z ^ _shift_right(z, 30)) * _MIX1
    z = (z ^ _shift_right(z, 27)) * _MIX2
    z = z ^ _shift_right(z, 31)
    return _shift_right(z, 11).double() / float(1 << 53)


def _filters(top_k_B: torch.Tensor, top_p_B: torch.Tensor, vocab: int) -> bool:
    return bool(((top_k_B > 1) & (top_k_B < vocab)).any() or (top_p_B < 1).any())


def sampling_probs(
    logits_BV: torch.Tensor,
    temperature_B: torch.Tensor,
    top_k_B: torch.Tensor,
    top_p_B: torch.Tensor,
) -> torch.Tensor:
    """The distribution each row samples from, in vocabulary order (rows sum to 1).

    ``top_k`` of -1 keeps every token. Greedy rows (temperature 0, or top_k
    1) are one-hot on the argmax.
    """
    num_rows, vocab = logits_BV.shape
    greedy_B = (temperature_B == 0) | (top_k_B == 1)
    # Greedy rows are replaced below; give them a harmless temperature here.
    temperature_B = torch.where(greedy_B, torch.ones_like(temperature_B), temperature_B)
    probs_BV = torch.softmax(logits_BV.float() / temperature_B[:, None], dim=-1)
    if _filters(top_k_B, top_p_B, vocab):
        probs_BV = _top_k_top_p(probs_BV, top_k_B, top_p_B)
    if not greedy_B.any():
        return probs_BV
    one_hot_BV = torch.nn.functional.one_hot(logits_BV.argmax(dim=-1), vocab).to(probs_BV)
    return torch.where(greedy_B[:, None], one_hot_BV, probs_BV)


def _top_k_top_p(
    probs_BV: torch.Tensor, top_k_B: torch.Tensor, top_p_B: torch.Tensor
) -> torch.Tensor:
    vocab = probs_BV.shape[1]
    sorted_BV, order_BV = probs_BV.sort(dim=-1, descending=True)
    rank_V = torch.arange(vocab, device=probs_BV.device)
    k_B = torch.where(top_k_B < 0, torch.full_like(top_k_B, vocab), top_k_B)
    mass_before_BV = sorted_BV.cumsum(dim=-1) - sorted_BV
    keep_BV = (rank_V[None, :] < k_B[:, None]) & (mass_before_BV <= top_p_B[:, None])
    kept_BV = sorted_BV * keep_BV
    kept_BV = kept_BV / kept_BV.sum(dim=-1, keepdim=True)
    return torch.zeros_like(probs_BV).scatter_(1, order_BV, kept_BV)


def sample_next_tokens(
    logits_BV: torch.Tensor,
    temperature_B: torch.Tensor,
    top_k_B: torch.Tensor,
    top_p_B: torch.Tensor,
    seed_B: torch.Tensor,
    position_B: torch.Tensor,
) -> torch.Tensor:
    """One token id per row: greedy rows take the argmax, the others draw with the uniform
    number of (their seed, the token's position)."""
    tokens_B = logits_BV.argmax(dim=-1)
    greedy_B = (temperature_B == 0) | (top_k_B == 1)
    if bool(greedy_B.all()):
        return tokens_B
    probs_BV = sampling_probs(logits_BV, temperature_B, top_k_B, top_p_B)
    cdf_BV = probs_BV.cumsum(dim=-1)
    total_B = cdf_BV[:, -1]
    # strictly below the total mass, whatever the rounding
    below_B = torch.nextafter(total_B, torch.zeros_like(total_B))
    u_B = torch.minimum(counter_uniform(seed_B, position_B).to(cdf_BV) * total_B, below_B)
    # the first token whose cumulative mass exceeds u: never one of zero probability
    drawn_B = torch.searchsorted(cdf_BV, u_B[:, None], right=True)[:, 0]
    return torch.where(greedy_B, tokens_B, drawn_B)


def token_logprobs(logits_BV: torch.Tensor, tokens_B: torch.Tensor) -> torch.Tensor:
    """log p(token) under the unmodified policy: log_softmax of the raw logits (temperature 1)."""
    logprobs_BV = torch.log_softmax(logits_BV.float(), dim=-1)
    return logprobs_BV.gather(1, tokens_B[:, None]).squeeze(1)
