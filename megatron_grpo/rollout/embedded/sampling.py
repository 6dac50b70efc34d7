"""Next-token sampling for the embedded server: pure functions on a batch of logits.

Per row: temperature (0 = greedy), then top-k and top-p on the
temperature-scaled distribution, both taken on the same sorted order (a token
is kept when it is among the ``top_k`` most likely and the mass strictly
before it is at most ``top_p``), as SGLang's torch-native sampler does. Each
row draws from its own ``torch.Generator``, so a seeded sample does not
depend on what else is in the batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


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
    sorted_BV, order_BV = probs_BV.sort(dim=-1, descending=True)
    rank_V = torch.arange(vocab, device=logits_BV.device)
    k_B = torch.where(top_k_B < 0, torch.full_like(top_k_B, vocab), top_k_B)
    mass_before_BV = sorted_BV.cumsum(dim=-1) - sorted_BV
    keep_BV = (rank_V[None, :] < k_B[:, None]) & (mass_before_BV <= top_p_B[:, None])
    kept_BV = sorted_BV * keep_BV
    kept_BV = kept_BV / kept_BV.sum(dim=-1, keepdim=True)
    filtered_BV = torch.zeros_like(probs_BV).scatter_(1, order_BV, kept_BV)
    one_hot_BV = torch.nn.functional.one_hot(logits_BV.argmax(dim=-1), vocab).to(probs_BV)
    return torch.where(greedy_B[:, None], one_hot_BV, filtered_BV)


def sample_next_tokens(
    logits_BV: torch.Tensor,
    temperature_B: torch.Tensor,
    top_k_B: torch.Tensor,
    top_p_B: torch.Tensor,
    generators: Sequence[torch.Generator],
) -> torch.Tensor:
    """One token id per row; greedy rows take the argmax and draw no random numbers."""
    if len(generators) != logits_BV.shape[0]:
        raise ValueError(f"{len(generators)} generators for {logits_BV.shape[0]} rows")
    probs_BV = sampling_probs(logits_BV, temperature_B, top_k_B, top_p_B)
    tokens_B = logits_BV.argmax(dim=-1)
    greedy_B = (temperature_B == 0) | (top_k_B == 1)
    for row in torch.nonzero(~greedy_B).flatten().tolist():
        tokens_B[row] = torch.multinomial(probs_BV[row], 1, generator=generators[row])[0]
    return tokens_B


def token_logprobs(logits_BV: torch.Tensor, tokens_B: torch.Tensor) -> torch.Tensor:
    """log p(token) under the unmodified policy: log_softmax of the raw logits (temperature 1)."""
    logprobs_BV = torch.log_softmax(logits_BV.float(), dim=-1)
    return logprobs_BV.gather(1, tokens_B[:, None]).squeeze(1)
