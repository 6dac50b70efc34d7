"""Worker: the learner's log-probs of token sequences, from a run's checkpoint at the run's
layout, by the trainer's own forward (``train.step.forward_logprobs``). Loaded by path in
each process, so it imports nothing from the tests."""

from __future__ import annotations


def learner_logprobs(config: str, checkpoint: str, sequences: list[list[int]]):
    """log p(token t | tokens < t) for t >= 1 of each sequence, on the last pipeline stage
    (None on the other ranks)."""
    from megatron_grpo.algo.batch import collate, make_samples
    from megatron_grpo.config import Config, from_dict
    from megatron_grpo.config.loader import read_yaml
    from megatron_grpo.mcore import checkpoint as checkpoint_io
    from megatron_grpo.mcore.device import compute_device
    from megatron_grpo.mcore.model import build_model
    from megatron_grpo.mcore.parallel import init_parallel
    from megatron_grpo.train.step import forward_logprobs

    cfg = from_dict(Config, read_yaml(config))
    ctx = init_parallel(cfg.parallel, seed=cfg.seed)
    model = build_model(cfg.model, ctx)
    checkpoint_io.load_model(model, checkpoint)
    n = len(sequences)
    samples = make_samples(
        sequences, [[0] + [1] * (len(s) - 1) for s in sequences], [0.0] * n, list(range(n))
    )
    micro_batches = [collate([[s]], num_groups=n).to(compute_device()) for s in samples]
    logprobs = forward_logprobs(model, ctx, micro_batches, vocab_size=cfg.model.vocab_size)
    if not ctx.is_last_stage:
        return None
    return [logp[0, : len(s) - 1].cpu().tolist() for logp, s in zip(logprobs, sequences)]
