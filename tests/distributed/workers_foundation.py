"""Bodies run on several gloo processes by tests/distributed/test_foundation.py."""

from __future__ import annotations

import torch

from megatron_grpo.algo.logprobs import vocab_parallel_logprobs
from megatron_grpo.config import ModelConfig, OptimConfig, ParallelDims
from megatron_grpo.mcore import checkpoint
from megatron_grpo.mcore.model import build_model
from megatron_grpo.mcore.optim import build_optimizer
from megatron_grpo.mcore.parallel import ParallelContext, init_parallel
from megatron_grpo.mcore.schedule import TokenBatch, run_schedule, zero_grads

MODEL = ModelConfig(
    num_layers=4,
    hidden_size=64,
    ffn_hidden_size=128,
    num_attention_heads=4,
    num_query_groups=2,
    vocab_size=200,
    make_vocab_size_divisible_by=8,
)


def fixed_tokens(batch: int = 4, seq: int = 13) -> torch.Tensor:
    """Odd-length rows: sequence parallelism at TP2 pads them (run_schedule)."""
    return torch.randint(
        0, MODEL.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(7)
    )


def full_logits(model: list, ctx: ParallelContext, tokens: torch.Tensor) -> torch.Tensor | None:
    """Logits gathered over TP on the last stage (tests only); None elsewhere."""
    out: list[torch.Tensor] = []

    def keep(batch, logits):
        parts = [torch.empty_like(logits) for _ in range(ctx.dims.tp)]
        torch.distributed.all_gather(parts, logits.contiguous(), group=ctx.tp_group)
        out.append(torch.cat(parts, dim=-1)[..., : MODEL.vocab_size].detach())
        return logits.sum() * 0, torch.tensor(1), {}

    with torch.no_grad():
        run_schedule(model, ctx, [TokenBatch.of(tokens)], keep, forward_only=True)
    return out[0] if out else None


def save_reference(ckpt: str) -> dict:
    ctx = init_parallel(ParallelDims())
    model = build_model(MODEL, ctx)
    checkpoint.save_model(model, ckpt, ctx)
    return {"logits": full_logits(model, ctx, fixed_tokens())}


def load_and_forward(tp: int, pp: int, ckpt: str) -> dict:
    ctx = init_parallel(ParallelDims(tp=tp, pp=pp), seed=999)  # other init: the load must win
    model = build_model(MODEL, ctx)
    checkpoint.load_model(model, ckpt)
    return {"logits": full_logits(model, ctx, fixed_tokens())}


def train_steps(tp: int, pp: int, steps: int, ckpt: str) -> dict:
    """A few Adam steps of next-token cross-entropy on one fixed batch."""
    ctx = init_parallel(ParallelDims(tp=tp, pp=pp))
    model = build_model(MODEL, ctx)
    optimizer, scheduler = build_optimizer(OptimConfig(lr=3e-3, clip_grad=1.0), MODEL, model, ctx)
    tokens = fixed_tokens(batch=8)
    shard = tokens.chunk(ctx.dp_size)[ctx.dp_rank]
    micro_batches = [TokenBatch.of(t) for t in shard.chunk(2)]
    num_targets = tokens.shape[0] * (tokens.shape[1] - 1)

    def ce(batch, logits):
        logp, _ = vocab_parallel_logprobs(
            logits[:, :-1],
            batch.tokens[:, 1:],
            tp_group=ctx.tp_group,
            vocab_size=MODEL.vocab_size,
        )
        loss = -logp.sum() / num_targets  # global token mean
        return loss, torch.tensor(logp.numel()), {"loss": loss.detach()}

    losses = []
    for _ in range(steps):
        zero_grads(model)
        optimizer.zero_grad()
        metrics = run_schedule(model, ctx, micro_batches, ce)
        optimizer.step()
        scheduler.step(1)
        local = torch.tensor(sum(float(m["loss"]) for m in metrics))
        torch.distributed.all_reduce(local, group=ctx.dp_group)
        losses.append(float(local))
    checkpoint.save_model(model, ckpt, ctx)
    return {
        "losses": losses,
        "logits": full_logits(model, ctx, tokens[:4]),
        "last": ctx.is_last_stage,
    }
