import pytest
import torch

from megatron_grpo.algo import logprobs
from megatron_grpo.algo.logprobs import vocab_parallel_logprobs


def test_single_rank_matches_log_softmax_and_entropy():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 11, generator=g, requires_grad=True)
    targets = torch.randint(0, 11, (2, 5), generator=g)
    logp, ent = vocab_parallel_logprobs(
        logits, targets, tp_group=None, vocab_size=11, with_entropy=True
    )
    ref = torch.log_softmax(logits, -1)
    torch.testing.assert_close(logp, ref.gather(-1, targets[..., None]).squeeze(-1))
    torch.testing.assert_close(ent, -(ref.exp() * ref).sum(-1))
    logp.sum().backward()
    expected = torch.autograd.grad(ref.gather(-1, targets[..., None]).sum(), logits)[0]
    torch.testing.assert_close(logits.grad, expected)


def test_padding_rows_are_excluded():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 16, generator=g)
    targets = torch.tensor([0, 5, 9])
    logp, ent = vocab_parallel_logprobs(
        logits, targets, tp_group=None, vocab_size=10, with_entropy=True
    )
    ref = torch.log_softmax(logits[:, :10], -1)
    torch.testing.assert_close(logp, ref.gather(-1, targets[:, None]).squeeze(-1))
    torch.testing.assert_close(ent, -(ref.exp() * ref).sum(-1))


def _reference(logits, targets, vocab_size):
    ref = torch.log_softmax(logits[..., :vocab_size].float(), -1)
    return ref.gather(-1, targets[..., None]).squeeze(-1), -(ref.exp() * ref).sum(-1)


@pytest.mark.parametrize("block_bytes", [2 << 20, 3 * 4 * 13])  # one block; 3 rows a block
def test_closed_form_backward_matches_autograd_for_any_upstream_gradients(block_bytes, monkeypatch):
    """The fused backward, for log-prob and entropy gradients together and one at a time,
    with the vocabulary passes over all rows at once and a few rows at a time."""
    monkeypatch.setattr(logprobs, "CPU_CHUNK_BYTES", block_bytes)
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 6, 13, generator=g, dtype=torch.float64) * 3
    targets = torch.randint(0, 10, (2, 6), generator=g)
    g_logp, g_ent = torch.randn(2, 6, generator=g), torch.randn(2, 6, generator=g)
    for use_logp, use_ent in ((True, True), (True, False), (False, True)):
        ours_in = logits.clone().requires_grad_(True)
        ref_in = logits.clone().requires_grad_(True)
        logp, ent = vocab_parallel_logprobs(
            ours_in, targets, tp_group=None, vocab_size=10, with_entropy=True
        )
        ref_logp, ref_ent = _reference(ref_in, targets, 10)
        (use_logp * (logp * g_logp).sum() + use_ent * (ent * g_ent).sum()).backward()
        (use_logp * (ref_logp * g_logp).sum() + use_ent * (ref_ent * g_ent).sum()).backward()
        torch.testing.assert_close(ours_in.grad, ref_in.grad.to(ours_in.grad), rtol=1e-5, atol=1e-6)
        assert ours_in.grad[..., 10:].abs().max() == 0  # padding columns get no gradient


def test_half_precision_logits_get_a_gradient_of_their_own_dtype():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 32, generator=g).to(torch.bfloat16).requires_grad_(True)
    targets = torch.randint(0, 32, (4,), generator=g)
    logp, ent = vocab_parallel_logprobs(logits, targets, tp_group=None, vocab_size=32)
    assert ent is None and logp.dtype == torch.float32
    logp.sum().backward()
    assert logits.grad is not None and logits.grad.dtype == torch.bfloat16
    ref_in = logits.detach().float().requires_grad_(True)
    _reference(ref_in, targets, 32)[0].sum().backward()
    torch.testing.assert_close(logits.grad.float(), ref_in.grad, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("block_bytes", [2 << 20, 2 * 4 * 9])
def test_entropy_as_a_metric_only_carries_no_gradient(block_bytes, monkeypatch):
    monkeypatch.setattr(logprobs, "CPU_CHUNK_BYTES", block_bytes)
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(3, 7, 12, generator=g, requires_grad=True)
    targets = torch.randint(0, 9, (3, 7), generator=g)
    logp, ent = vocab_parallel_logprobs(
        logits, targets, tp_group=None, vocab_size=9, with_entropy=True, entropy_grad=False
    )
    ref_in = logits.detach().clone().requires_grad_(True)
    ref_logp, ref_ent = _reference(ref_in, targets, 9)
    torch.testing.assert_close(ent, ref_ent)
    assert ent is not None and not ent.requires_grad
    logp.sum().backward()
    ref_logp.sum().backward()
    torch.testing.assert_close(logits.grad, ref_in.grad)
