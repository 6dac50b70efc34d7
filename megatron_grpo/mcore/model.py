"""Model builder: megatron-core GPTModel for Llama / Qwen2 / Qwen3-style decoders.

The local (pure PyTorch) layer spec is used when Transformer Engine is not
importable, the Transformer Engine spec when it is (``spec`` forces either; context
parallelism needs Transformer Engine). The model is wrapped in megatron-core
DistributedDataParallel over the layout's process groups.

Loss normalization is owned by ``megatron_grpo.algo.loss`` (``scaled_loss``):
the model config set here leaves megatron-core's own per-micro-batch and
per-DP-rank averaging switched off (``calculate_per_token_loss=True``) so that
the loss function alone decides the scale of the gradient.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_grpo.config import ModelConfig, OptimConfig, TrainConfig
from megatron_grpo.config.model import check_moe_layout
from megatron_grpo.mcore.compat import FinalizeGrads, force_param_sync
from megatron_grpo.mcore.layers import LayerSpec, block_spec, check_spec
from megatron_grpo.mcore.parallel import ParallelContext

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def transformer_config(cfg: ModelConfig, ctx: ParallelContext, train: TrainConfig | None = None):
    """megatron-core TransformerConfig for ``cfg`` at the layout of ``ctx``, with the
    activation recomputation of ``train`` (none without it)."""
    from megatron.core.transformer import TransformerConfig

    ctx.dims.validate_model(
        num_layers=cfg.num_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_query_groups or cfg.num_attention_heads,
        num_experts=cfg.num_experts,
    )
    dtype = DTYPES[cfg.params_dtype]
    return TransformerConfig(
        cuda_graph_scope=[],  # the whole layer; the default, "full", is deprecated
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        ffn_hidden_size=cfg.ffn_hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_query_groups,
        kv_channels=cfg.head_dim,
        tensor_model_parallel_size=ctx.dims.tp,
        pipeline_model_parallel_size=ctx.dims.pp,
        virtual_pipeline_model_parallel_size=ctx.dims.vpp,
        context_parallel_size=ctx.dims.cp,
        normalization="RMSNorm",
        layernorm_epsilon=cfg.norm_epsilon,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=cfg.add_qkv_bias,
        qk_layernorm=cfg.qk_layernorm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=cfg.init_method_std,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype is torch.bfloat16,
        fp16=dtype is torch.float16,
        use_cpu_initialization=not torch.cuda.is_available(),
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        attention_softmax_in_fp32=True,
        # The interleaved schedule (VPP) at PP=2 moves activations and gradients both ways
        # between the same two ranks: batched p2p (batch_isend_irecv) posts them in an order
        # that pairs a gradient with an activation buffer of the same shape, and the shape
        # handshake of variable_seq_lengths blocks a gloo rank on a send its peer has not yet
        # posted a receive for. Under VPP every micro-batch has one shape (train.step pads
        # them), so the handshake is not needed, and unbatched p2p keeps each direction apart.
        variable_seq_lengths=ctx.dims.vpp is None,
        batch_p2p_comm=ctx.dims.vpp is None,
        moe_token_dispatcher_type="alltoall",  # required by variable_seq_lengths
        **_moe(cfg, ctx, train),
        sequence_parallel=ctx.dims.uses_sequence_parallel,
        **_recompute(train),
        # The loss owns normalization: no division by micro-batch count or DP size.
        calculate_per_token_loss=True,
        finalize_model_grads_func=FinalizeGrads(ctx.pg),  # no token-count division
    )


def _moe(cfg: ModelConfig, ctx: ParallelContext, train: TrainConfig | None) -> dict:
    """TransformerConfig's MoE fields for ``cfg`` (none for a dense model)."""
    if not cfg.is_moe:
        return {}
    if cfg.moe_grouped_gemm and not torch.cuda.is_available():
        raise ValueError(
            "model.moe_grouped_gemm=true needs a GPU (Transformer Engine's grouped GEMM); "
            "on CPU the experts run one after the other (moe_grouped_gemm=false)"
        )
    check_moe_layout(
        cfg,
        ctx.dims,
        train.recompute_granularity if train else None,
        routing_replay=train.routing_replay if train else "off",
    )
    softmax = cfg.moe_router_score_function == "softmax"
    return {
        "num_moe_experts": cfg.num_experts,
        "moe_ffn_hidden_size": cfg.expert_ffn_hidden_size,
        "moe_router_topk": cfg.moe_router_topk,
        "moe_router_score_function": cfg.moe_router_score_function,
        # softmax then top-k (unnormalized), or top-k logits then softmax (normalized)
        "moe_router_pre_softmax": softmax and not cfg.moe_norm_topk_prob,
        "moe_expert_capacity_factor": cfg.moe_capacity_factor,
        "moe_token_drop_policy": cfg.moe_token_drop_policy,
        # megatron-core's aux loss is per micro-batch: mcore.router_balance owns the term
        "moe_router_load_balancing_type": "none",
        "moe_aux_loss_coeff": 0.0,
        "moe_grouped_gemm": cfg.moe_grouped_gemm,
        "expert_model_parallel_size": ctx.dims.ep,
        "expert_tensor_parallel_size": 1,
    }


def _recompute(train: TrainConfig | None) -> dict:
    """TransformerConfig's recompute fields for ``train`` (megatron-core's names)."""
    if train is None or train.recompute_granularity is None:
        return {}
    if train.recompute_granularity == "selective":
        return {"recompute_granularity": "selective", "recompute_modules": train.recompute_modules}
    return {
        "recompute_granularity": "full",
        "recompute_method": train.recompute_method,
        "recompute_num_layers": train.recompute_num_layers,
    }


def build_gpt(
    cfg: ModelConfig,
    ctx: ParallelContext,
    *,
    train: TrainConfig | None = None,
    vp_stage: int | None = None,
    spec: LayerSpec = "auto",
):
    """One GPTModel chunk (this rank's pipeline stage), not wrapped."""
    from megatron.core.models.gpt import GPTModel

    check_spec(spec, ctx.dims.cp, cfg.params_dtype)
    tcfg = transformer_config(cfg, ctx, train)
    num_chunks = ctx.dims.vpp or 1
    chunk = vp_stage or 0
    return GPTModel(
        config=tcfg,
        transformer_layer_spec=block_spec(
            cfg, tcfg, vp_stage=vp_stage, pp_rank=ctx.pp_rank, spec=spec
        ),
        vocab_size=cfg.padded_vocab_size(ctx.dims.tp),
        max_sequence_length=cfg.max_position_embeddings,
        pre_process=ctx.is_first_stage and chunk == 0,
        post_process=ctx.is_last_stage and chunk == num_chunks - 1,
        parallel_output=True,
        share_embeddings_and_output_weights=cfg.tie_embeddings,
        position_embedding_type="rope",
        rotary_base=cfg.rotary_base,  # type: ignore[arg-type]  # used as base ** x
        rope_scaling=cfg.rope_scaling_factor is not None,
        rope_scaling_factor=cfg.rope_scaling_factor or 8.0,
        pg_collection=ctx.pg,
        vp_stage=vp_stage,
    )


def build_model(
    cfg: ModelConfig,
    ctx: ParallelContext,
    *,
    optim: OptimConfig | None = None,
    train: TrainConfig | None = None,
    wrap_ddp: bool = True,
    spec: LayerSpec = "auto",
) -> list:
    """This rank's model chunks (one per virtual stage), wrapped in megatron-core DDP.

    ``optim`` sets how gradients and parameters move (distributed optimizer, overlapped
    reduce and gather; plain all-reduce without it) and must be the config the optimizer is
    built from; ``train`` sets activation recomputation; ``spec`` the layer spec ("auto":
    Transformer Engine's when importable on a GPU).
    """
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    stages = [None] if ctx.dims.vpp is None else list(range(ctx.dims.vpp))
    chunks = [build_gpt(cfg, ctx, train=train, vp_stage=s, spec=spec) for s in stages]
    if cfg.is_moe:
        from megatron_grpo.mcore.router_balance import RouterBalance
        from megatron_grpo.mcore.routing_replay import RoutingReplay

        chunks[0].router_balance = RouterBalance(chunks, cfg, ctx)
        replay = train.routing_replay if train is not None else "off"
        chunks[0].routing_replay = RoutingReplay(
            chunks, replay, ctx, cfg.num_layers, cfg.num_experts or 0
        )
    if torch.cuda.is_available():
        chunks = [c.cuda() for c in chunks]
    if not wrap_ddp:
        return chunks
    distributed = optim is not None and optim.use_distributed_optimizer
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=optim is not None and optim.overlap_grad_reduce,
        overlap_param_gather=distributed and optim is not None and optim.overlap_param_gather,
        use_distributed_optimizer=distributed,
        average_in_collective=False,
    )
    wrapped = [
        DistributedDataParallel(
            config=c.config,
            ddp_config=ddp_config,
            module=c,
            disable_bucketing=i > 0,
            pg_collection=ctx.pg,
        )
        for i, c in enumerate(chunks)
    ]
    if ddp_config.overlap_grad_reduce:
        # The schedule must hold the reduction back until the last micro-batch's backward
        # (else every micro-batch would reduce the sum so far) and start it per chunk.
        no_sync = [c.no_sync for c in wrapped]
        grad_sync = [c.start_grad_sync for c in wrapped]
        for c in wrapped:
            c.config.no_sync_func = no_sync[0] if len(wrapped) == 1 else no_sync
            c.config.grad_sync_func = grad_sync[0] if len(wrapped) == 1 else grad_sync
    return wrapped


def sync_params(model: list) -> None:
    """Bring every parameter up to date after an optimizer step.

    With the distributed optimizer and an overlapped parameter gather, a step updates
    only each rank's shard; the full parameters arrive during the next forward pass.
    Anything that reads the weights before then (weight sync, checkpoints, a full-state
    gather) calls this first. Collective over DP; a no-op otherwise.
    """
    for chunk in model:
        ddp_config = getattr(chunk, "ddp_config", None)
        if ddp_config is not None and ddp_config.overlap_param_gather:
            force_param_sync(chunk)
