"""Layer specs: Transformer Engine's modules on a CUDA machine, megatron-core's local ones
(pure PyTorch) elsewhere.

``LayerSpec`` says which: "auto" (the trainer's choice: Transformer Engine when it is
importable on a CUDA machine), or "local" / "transformer_engine" forced, as the GPU tier's
comparison of the two specs needs. Context parallelism needs Transformer Engine's attention
(megatron-core's local attention refuses it), so ``check_spec`` refuses CP > 1 without it.

The local spec's norm (megatron-core's ``WrappedTorchNorm``) refuses sequence
parallelism. ``RMSNorm`` here is torch's RMSNorm with what sequence parallelism
needs: under it each TP rank normalizes its own slice of the sequence, so the
weight's gradient is a partial sum, and the weight is marked ``sequence_parallel``
for megatron-core's ``finalize_model_grads`` to all-reduce it over TP (Transformer
Engine's norm is marked the same way).
"""

from __future__ import annotations

from typing import Literal

import torch

from megatron_grpo.config import ModelConfig

LayerSpec = Literal["auto", "local", "transformer_engine"]


def have_transformer_engine() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


def uses_transformer_engine(spec: LayerSpec = "auto") -> bool:
    """Whether ``spec`` builds Transformer Engine's layers here; a forced
    "transformer_engine" without it raises a ValueError naming what is missing."""
    if spec == "local":
        return False
    if spec == "auto":
        return have_transformer_engine()
    if spec != "transformer_engine":
        raise ValueError(f"unknown layer spec {spec!r}; expected auto, local or transformer_engine")
    if not have_transformer_engine():
        raise ValueError(
            "the Transformer Engine layer spec needs a CUDA GPU and transformer-engine installed "
            f"(torch.cuda.is_available() is {torch.cuda.is_available()})"
        )
    return True


THD_DTYPES = ("bfloat16", "float16")
"""What Transformer Engine's attention takes packed (THD) sequences and context parallelism
in: only its fused and flash backends do either, and they take 16-bit inputs; its unfused
backend, the float32 fallback, takes neither."""


def check_spec(spec: LayerSpec, context_parallel_size: int, params_dtype: str = "bfloat16") -> None:
    """Raise a ValueError for a layout the layer spec cannot build: context parallelism runs
    only in Transformer Engine's attention (TEDotProductAttention), in 16-bit."""
    if context_parallel_size > 1 and params_dtype not in THD_DTYPES:
        raise ValueError(
            f"parallel.cp={context_parallel_size} needs model.params_dtype=bfloat16: Transformer "
            "Engine splits attention over CP ranks only in its fused and flash backends, which "
            f"take 16-bit inputs (got {params_dtype})"
        )
    if context_parallel_size > 1 and not uses_transformer_engine(spec):
        raise ValueError(
            f"parallel.cp={context_parallel_size} needs Transformer Engine's attention "
            "(TEDotProductAttention): a CUDA GPU with transformer-engine installed; "
            "megatron-core's local attention refuses context parallelism "
            f"(torch.cuda.is_available() is "
            f"{torch.cuda.is_available()})"
        )


class RMSNorm(torch.nn.RMSNorm):
    """torch's RMSNorm as a megatron-core spec module, usable under sequence parallelism."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_unused) -> None:
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = config.sequence_parallel  # type: ignore[attr-defined]


def local_layer_spec(cfg: ModelConfig):
    """megatron-core's local layer spec with every norm an ``RMSNorm``; with experts, its
    MoE layer (router, alltoall dispatcher, experts run one by one: SequentialMLP)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(
        num_experts=cfg.num_experts,
        moe_grouped_gemm=False,
        qk_layernorm=cfg.qk_layernorm,
        normalization="RMSNorm",
    )
    layer = spec.submodules
    layer.input_layernorm = RMSNorm
    layer.pre_mlp_layernorm = RMSNorm
    if cfg.qk_layernorm:
        attention = layer.self_attention.submodules
        attention.q_layernorm = RMSNorm
        attention.k_layernorm = RMSNorm
    return spec


def block_spec(
    cfg: ModelConfig, tcfg, *, vp_stage: int | None, pp_rank: int, spec: LayerSpec = "auto"
):
    """The decoder of one pipeline chunk: its layers and its final norm."""
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import (
        TransformerBlock,
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )

    if uses_transformer_engine(spec):
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_with_transformer_engine_spec,
        )

        return get_gpt_layer_with_transformer_engine_spec(
            num_experts=cfg.num_experts,
            moe_grouped_gemm=cfg.moe_grouped_gemm,
            qk_layernorm=cfg.qk_layernorm,
        )
    num_layers = get_num_layers_to_build(tcfg, vp_stage=vp_stage, pp_rank=pp_rank)
    submodules = TransformerBlockSubmodules(
        layer_specs=[local_layer_spec(cfg)] * num_layers, layer_norm=RMSNorm
    )
    return ModuleSpec(module=TransformerBlock, submodules=submodules)
