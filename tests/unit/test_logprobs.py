import torch

from megatron_grpo.logprobs import vocab_parallel_logprobs


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
