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
    micro_batches = [Rows.of(r) for r in rows.chunk(2)]
    with balance.training_step(num_sequences=tokens.shape[0]):
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


def engine_mismatch(*, mode: str, perturbed: bool, seed: int = 5) -> dict | None:
    """One on-policy optimizer step (lr 0) of a tiny Qwen3-MoE on samples its own weights
    generated through the embedded engine's decode, with their routes; the step's metrics.

    ``perturbed``: the engine's routers select their experts from logits with a relative
    error (``_noisy_selection``), as an engine's forward in other kernels and precision
    does; near-ties then go the other way, nothing else changes (the gates are exact, so
    replayed routes bring the log-probs back to the learner's). ``mode``:
    ``train.routing_replay``."""
    import dataclasses
    from types import SimpleNamespace

    from megatron_grpo.algo.batch import make_samples
    from megatron_grpo.commands.invariance.cases import default_moe_model
    from megatron_grpo.commands.invariance.reference import hf_model
    from megatron_grpo.config import LossConfig, OptimConfig, TrainConfig
    from megatron_grpo.embedded.decode import SequenceSpec, generate_batch
    from megatron_grpo.mcore.optim import build_optimizer
    from megatron_grpo.rollout.stage import sample_routes
    from megatron_grpo.sglang_api.types import SamplingParams
    from megatron_grpo.train.step import StepSettings, train_on_rollout

    cfg = dataclasses.replace(default_moe_model(), num_experts=8, moe_aux_loss_coeff=0.0)
    ctx = init_parallel(ParallelDims())
    optim = OptimConfig(optimizer="sgd", lr=0.0, clip_grad=0.0, use_distributed_optimizer=False)
    model = build_model(cfg, ctx, optim=optim, train=TrainConfig(routing_replay=mode))
    torch.manual_seed(seed)
    state = gather_full_state(model, ctx, vocab_size=cfg.vocab_size, grads=False)
    engine = hf_model(state, cfg).eval()
    if perturbed:
        for layer in engine.model.layers:
            layer.mlp.gate.register_forward_hook(_noisy_selection)
    g = torch.Generator().manual_seed(seed)
    prompts = [
        tuple(torch.randint(1, cfg.vocab_size, (6,), generator=g).tolist()) for _ in range(8)
    ]
    sampling = SamplingParams(max_new_tokens=24, temperature=1.0)
    specs = [
        SequenceSpec(
            prompt_ids=tuple(p), sampling=sampling, seed=seed + i, return_routed_experts=True
        )
        for i, p in enumerate(prompts)
    ]
    done = generate_batch(engine, specs, eos_token_ids=frozenset())
    tokens = [list(s.prompt_ids) + d.output_ids for s, d in zip(specs, done)]
    masks = [[0.0] * len(s.prompt_ids) + [1.0] * len(d.output_ids) for s, d in zip(specs, done)]
    rollout = [[0.0] * len(s.prompt_ids) + d.logprobs for s, d in zip(specs, done)]
    gens = [SimpleNamespace(routed_experts=d.routed_experts) for d in done]
    samples = make_samples(
        tokens,
        masks,
        advantages=[1.0, -1.0] * 4,
        groups=[i // 2 for i in range(8)],
        rollout_logprobs=rollout,
        routes=sample_routes(gens, [len(t) for t in tokens]),
    )
    optimizer, scheduler = build_optimizer(optim, cfg, model, ctx)
    settings = StepSettings(
        global_batch_size=len(samples),
        num_iterations=1,
        max_tokens_per_micro_batch=256,
        pack=True,
        vocab_size=cfg.vocab_size,
        max_len=24,
    )
    (metrics,) = train_on_rollout(model, optimizer, scheduler, ctx, samples, LossConfig(), settings)
    keys = ("logprob_mismatch", "logprob_mismatch_max", "router_agreement", "router_agreement_own")
    return {k: metrics[k] for k in keys} if ctx.is_main else None


SELECTION_ERROR = 0.05
"""Relative error of the engine's router logits in the selection of ``perturbed``: a few
percent of the top-2 sets of 8 experts change, as Megatron-LM #4168 measured between
inference and training forwards of Qwen3-30B-A3B (about 10%); the tiny model's own
bfloat16 rounding flips none of its 480 token-layers."""


def _noisy_selection(gate, args, output):
    """A transformers Qwen3-MoE router's output with its experts selected from its logits
    times (1 + SELECTION_ERROR x N(0, 1)) and its gates computed as before (softmax in fp32,
    renormalized over the selected experts)."""
    logits, _, _ = output
    g = torch.Generator().manual_seed(logits.shape[0])
    noise = torch.randn(logits.shape, generator=g, dtype=torch.float32)
    chosen = torch.topk(logits * (1 + SELECTION_ERROR * noise), gate.top_k, dim=-1).indices
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    top = probs.gather(1, chosen)
    if gate.norm_topk_prob:
        top = top / top.sum(dim=-1, keepdim=True)
    return logits, top.to(logits.dtype), chosen
