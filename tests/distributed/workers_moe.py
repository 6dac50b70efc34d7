"""Bodies run on several gloo processes by tests/distributed/test_moe.py."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_grpo.algo.logprobs import vocab_parallel_logprobs
from megatron_grpo.config import ModelConfig, ParallelDims
from megatron_grpo.mcore.full_state import gather_full_state, load_full_state
from megatron_grpo.mcore.model import build_model
from megatron_grpo.mcore.parallel import broadcast_object, init_parallel
from megatron_grpo.mcore.schedule import run_schedule, zero_grads

MODEL = ModelConfig(
    num_layers=2,
    hidden_size=64,
    ffn_hidden_size=128,
    num_attention_heads=4,
    num_query_groups=2,
    head_dim=32,
    qk_layernorm=True,
    vocab_size=200,
    make_vocab_size_divisible_by=8,
    hf_family="qwen3_moe",
    num_experts=4,
    moe_ffn_hidden_size=32,
    moe_router_topk=2,
    moe_aux_loss_coeff=0.01,
)


@dataclass
class Rows:
    """Rows of one sequence each, with what the routers' balance loss reads."""

    tokens: torch.Tensor
    position_ids: torch.Tensor
    seg: torch.Tensor
    num_samples: int
    attention_mask: None = None
    cu_seqlens: None = None
    max_seqlen: int = 0

    @classmethod
    def of(cls, tokens: torch.Tensor) -> Rows:
        positions = torch.arange(tokens.shape[1]).expand_as(tokens)
        seg = torch.arange(tokens.shape[0])[:, None].expand_as(tokens)
        return cls(tokens, positions, seg, tokens.shape[0])


def fixed_tokens(batch: int = 4, seq: int = 12) -> torch.Tensor:
    return torch.randint(
        0, MODEL.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(3)
    )


def gradients(tp: int = 1, pp: int = 1, ep: int = 1, init: dict | None = None) -> dict:
    """One forward/backward of a global token-mean cross-entropy plus the routers' balance
    loss, each DP rank on its rows; the full gradient and parameters on rank 0, and the
    step's balance metrics. Without ``init`` the weights are drawn here and returned; with
    it, loaded (experts by their global index)."""
    from megatron_grpo.mcore.router_balance import router_balance

    ctx = init_parallel(ParallelDims(tp=tp, pp=pp, ep=ep))
    model = build_model(MODEL, ctx)
    if init is None:
        init = broadcast_object(gather_full_state(model, ctx, vocab_size=MODEL.vocab_size), ctx)
    load_full_state(model, init, MODEL, ctx)
    tokens = fixed_tokens()
    rows = tokens.chunk(ctx.dp_size)[ctx.dp_rank]
    num_targets = tokens.shape[0] * (tokens.shape[1] - 1)

    def ce(batch, logits):
        logp, _ = vocab_parallel_logprobs(
            logits[:, :-1], batch.tokens[:, 1:], tp_group=ctx.tp_group, vocab_size=MODEL.vocab_size
        )
        return -logp.sum() / num_targets, torch.tensor(logp.numel()), {}

    zero_grads(model)
    balance = router_balance(model)
    assert balance is not None
    balance.start_step(num_sequences=tokens.shape[0])
    micro_batches = [Rows.of(r) for r in rows.chunk(2)]
    run_schedule(model, ctx, micro_batches, ce, on_forward=balance.set_batch)
    metrics = balance.step_metrics()
    spread: dict[str, float] = {}
    grads = gather_full_state(
        model, ctx, vocab_size=MODEL.vocab_size, grads=True, replica_spread=spread
    )
    params = gather_full_state(model, ctx, vocab_size=MODEL.vocab_size)
    return {
        "init": init,
        "grads": grads,
        "params": params,
        "spread": spread,
        "ep_rank": ctx.ep_rank,
        "metrics": metrics,
        "loads": balance.loads,
    }


def megatron_aux_loss_layout(**kwargs):
    """check-invariance's worker with megatron-core's own per-micro-batch aux loss in place
    of the per-sequence one (which is switched off): the check must see the difference."""
    import megatron_grpo.mcore.model as mcore_model
    import megatron_grpo.mcore.router_balance as router_balance
    from megatron_grpo.commands.invariance.worker import run_layout

    moe_fields = mcore_model._moe

    def with_megatron_aux_loss(cfg, ctx, train):
        fields = moe_fields(cfg, ctx, train)
        fields["moe_router_load_balancing_type"] = "aux_loss"
        fields["moe_aux_loss_coeff"] = cfg.moe_aux_loss_coeff
        return fields

    mcore_model._moe = with_megatron_aux_loss
    router_balance.aux_loss_weight = lambda coeff, num_sequences: 0.0
    return run_layout(**kwargs)


def unsliced_routes_layout(**kwargs):
    """run_layout with routing replay that ignores sequence parallelism: every TP rank
    replays the routes of the first positions, not of its own slice of the sequence."""
    import megatron_grpo.mcore.routing_replay as replay
    from megatron_grpo.commands.invariance.worker import run_layout

    original = replay.router_order

    def first_positions(values_BS, local_positions, ctx, fill=-1):
        return original(values_BS, local_positions, _TPRankZero(ctx), fill)

    replay.router_order = first_positions
    return run_layout(**kwargs)


class _TPRankZero:
    """A ParallelContext seen as TP rank 0."""

    def __init__(self, ctx) -> None:
        self._ctx = ctx

    def __getattr__(self, name):
        return 0 if name == "tp_rank" else getattr(self._ctx, name)
