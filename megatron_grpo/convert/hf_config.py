"""``ModelConfig`` -> transformers config, and the family a ``ModelConfig`` implies: the
export direction.

The other direction (an HF ``config.json`` -> ``ModelConfig``), the supported
families and the checks between the two are ``megatron_grpo.config.hf``.
"""

from __future__ import annotations

from typing import Any

from megatron_grpo.config import ModelConfig
from megatron_grpo.config.hf import (
    FAMILIES,
    LLAMA3_ROPE,
    Family,
    check_family,
    get_family,
    head_dim,
)


def infer_family(cfg: ModelConfig) -> str:
    """The one supported family whose QKV bias, q/k norm and experts ``cfg`` has."""
    for name, fam in FAMILIES.items():
        if (fam.qkv_bias, fam.qk_norm, fam.moe) == (cfg.add_qkv_bias, cfg.qk_layernorm, cfg.is_moe):
            return name
    raise ValueError(
        f"no supported family has add_qkv_bias={cfg.add_qkv_bias}, "
        f"qk_layernorm={cfg.qk_layernorm} and num_experts={cfg.num_experts}"
    )


def hf_config_from_model_config(model_cfg: ModelConfig, family: str | Family) -> Any:
    """The transformers config of ``family`` for ``model_cfg``.

    ``family`` is a model type (``llama``, ``qwen2``, ``qwen3``, ``qwen3_moe``) or an
    architecture name.
    """
    import transformers

    fam = get_family(family) if isinstance(family, str) else family
    check_family(model_cfg, fam)
    config_cls = getattr(transformers, fam.config_class)
    return config_cls(
        architectures=[fam.architecture],
        vocab_size=model_cfg.vocab_size,
        hidden_size=model_cfg.hidden_size,
        intermediate_size=model_cfg.ffn_hidden_size,
        num_hidden_layers=model_cfg.num_layers,
        num_attention_heads=model_cfg.num_attention_heads,
        num_key_value_heads=model_cfg.num_query_groups,
        head_dim=head_dim(model_cfg),
        max_position_embeddings=model_cfg.max_position_embeddings,
        rms_norm_eps=model_cfg.norm_epsilon,
        tie_word_embeddings=model_cfg.tie_embeddings,
        hidden_act="silu",
        **_rope_kwargs(model_cfg.rotary_base, model_cfg.rope_scaling_factor),
        **_moe_kwargs(model_cfg),
    )


def _moe_kwargs(cfg: ModelConfig) -> dict[str, Any]:
    """Qwen3-MoE's expert fields: every layer a mixture of experts, no shared expert."""
    if not cfg.is_moe:
        return {}
    return {
        "num_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.moe_router_topk,
        "moe_intermediate_size": cfg.expert_ffn_hidden_size,
        "norm_topk_prob": cfg.moe_norm_topk_prob,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "router_aux_loss_coef": cfg.moe_aux_loss_coeff,
    }


def _rope_kwargs(theta: float, factor: float | None) -> dict[str, Any]:
    """RoPE as the installed transformers wants it (``rope_parameters`` from 5.0)."""
    import transformers

    scaling: dict[str, Any] = {"rope_type": "default"}
    if factor is not None:
        scaling = {"rope_type": "llama3", "factor": float(factor), **LLAMA3_ROPE}
    if int(transformers.__version__.split(".")[0]) >= 5:
        return {"rope_parameters": {**scaling, "rope_theta": float(theta)}}
    return {"rope_theta": float(theta), "rope_scaling": None if factor is None else scaling}
