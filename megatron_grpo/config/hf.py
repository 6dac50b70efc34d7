"""Hugging Face ``config.json`` -> ``ModelConfig``: the supported families and the checks.

Only what the megatron model built by ``megatron_grpo.mcore.model`` can reproduce
exactly is accepted: RMSNorm, SwiGLU, plain RoPE or Llama 3.1's ``llama3``
RoPE scaling, GQA, bias on Q/K/V only (Qwen2), q/k RMSNorm (Qwen3), and
Qwen3-MoE's every-layer mixture of experts (softmax router, top-k, no shared
expert). Anything
else (another architecture, another RoPE scaling, an output-projection bias,
sliding-window attention) is refused by name, because a model that loads
but computes something else is worse than one that does not load.

No transformers import: a config is a ``config.json`` dict or, where the
caller has one, a transformers config object. The export direction
(``ModelConfig`` -> transformers config) is ``megatron_grpo.convert.hf_config``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_grpo.config.model import HFFamily, ModelConfig


@dataclass(frozen=True)
class Family:
    """One supported HF decoder family and the megatron switches it implies."""

    architecture: str
    """HF ``architectures`` entry, e.g. ``LlamaForCausalLM``."""
    model_type: HFFamily
    """HF ``model_type``, e.g. ``llama``; also ``ModelConfig.hf_family``."""
    config_class: str
    """Name of the transformers config class."""
    qkv_bias: bool
    """Bias on the Q/K/V projections (and nowhere else)."""
    qk_norm: bool
    """RMSNorm over each query and key head."""
    moe: bool = False
    """Every layer's MLP is a mixture of experts (``num_experts``)."""


FAMILIES: dict[HFFamily, Family] = {
    f.model_type: f
    for f in (
        Family("LlamaForCausalLM", "llama", "LlamaConfig", qkv_bias=False, qk_norm=False),
        Family("Qwen2ForCausalLM", "qwen2", "Qwen2Config", qkv_bias=True, qk_norm=False),
        Family("Qwen3ForCausalLM", "qwen3", "Qwen3Config", qkv_bias=False, qk_norm=True),
        Family(
            "Qwen3MoeForCausalLM",
            "qwen3_moe",
            "Qwen3MoeConfig",
            qkv_bias=False,
            qk_norm=True,
            moe=True,
        ),
    )
}

HF_NAMES: dict[str, str] = {
    "num_layers": "num_hidden_layers",
    "hidden_size": "hidden_size",
    "ffn_hidden_size": "intermediate_size",
    "num_attention_heads": "num_attention_heads",
    "num_query_groups": "num_key_value_heads",
    "head_dim": "head_dim",
    "vocab_size": "vocab_size",
    "max_position_embeddings": "max_position_embeddings",
    "rotary_base": "rope_theta",
    "rope_scaling_factor": "rope_scaling.factor (llama3)",
    "norm_epsilon": "rms_norm_eps",
    "tie_embeddings": "tie_word_embeddings",
    "add_qkv_bias": "qkv bias (attention_bias / Qwen2)",
    "qk_layernorm": "qk norm (q_norm/k_norm, Qwen3)",
    "hf_family": "model_type",
    "num_experts": "num_experts",
    "moe_ffn_hidden_size": "moe_intermediate_size",
    "moe_router_topk": "num_experts_per_tok",
    "moe_norm_topk_prob": "norm_topk_prob",
}
"""The ``ModelConfig`` fields an HF config determines, and what the HF config calls them."""

_REQUIRED = (
    "num_hidden_layers",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "vocab_size",
    "max_position_embeddings",
    "rms_norm_eps",
)
"""HF fields without a default that fits every supported family."""


def read_hf_config(hf_dir: str | Path) -> dict[str, Any]:
    """The ``config.json`` of ``hf_dir`` as a dict (no transformers import, no remote code)."""
    path = Path(hf_dir, "config.json")
    if not path.is_file():
        raise FileNotFoundError(f"{hf_dir} has no config.json")
    return json.loads(path.read_text())


def _supported() -> str:
    return ", ".join(f.architecture for f in FAMILIES.values())


def get_family(name: str) -> Family:
    """The family named by its ``model_type`` (``qwen2``) or architecture (``Qwen2ForCausalLM``)."""
    for family in FAMILIES.values():
        if name in (family.model_type, family.architecture):
            return family
    raise ValueError(f"unsupported architecture {name!r} (supported: {_supported()})")


def _get(hf_config: Any, key: str, default: Any = None) -> Any:
    """Read a field from a transformers config or from a plain ``config.json`` dict."""
    if isinstance(hf_config, Mapping):
        return hf_config.get(key, default)
    return getattr(hf_config, key, default)


def family_of(hf_config: Any) -> Family:
    """The family of an HF config, from ``architectures`` or, when unset, ``model_type``.

    A config made in code (``LlamaConfig(...)``) has no ``architectures``;
    one read from a checkpoint always has.
    """
    architectures = _get(hf_config, "architectures") or []
    if len(architectures) > 1:
        raise ValueError(f"expected one HF architecture, got {architectures}")
    return get_family(architectures[0] if architectures else _get(hf_config, "model_type", ""))


# The llama3 RoPE-scaling parameters megatron-core's RotaryEmbedding hard-codes.
LLAMA3_ROPE = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def _rope(hf_config: Any) -> tuple[float, str, dict[str, Any]]:
    """(theta, rope_type, scaling parameters).

    transformers 5 keeps them all in ``rope_parameters``; 4.x has ``rope_theta``
    at top level and the rest in ``rope_scaling``.
    """
    params = _get(hf_config, "rope_parameters") or {}
    scaling = params if params.get("rope_type") else (_get(hf_config, "rope_scaling") or {})
    theta = params.get("rope_theta", _get(hf_config, "rope_theta", 10000.0))
    rope_type = scaling.get("rope_type") or scaling.get("type")
    return float(theta), rope_type or "default", scaling


def _rope_scaling_factor(hf_config: Any) -> float | None:
    """``ModelConfig.rope_scaling_factor`` of an HF config; refuses what megatron cannot do."""
    _, rope_type, scaling = _rope(hf_config)
    if rope_type == "default":
        return None
    if rope_type != "llama3":
        raise ValueError(
            f"HF config rope_scaling with rope_type={rope_type!r} is not supported "
            "(only 'default' and 'llama3')"
        )
    for key, fixed in LLAMA3_ROPE.items():
        if scaling.get(key) != fixed:
            raise ValueError(
                f"HF config rope_scaling {key}={scaling.get(key)!r} is not supported "
                f"(megatron-core's llama3 RoPE scaling fixes {key}={fixed!r})"
            )
    return float(scaling["factor"])


def _refuse_unsupported(hf_config: Any, family: Family) -> None:
    """Refuse HF options the megatron model would silently compute differently."""
    _rope_scaling_factor(hf_config)
    if _get(hf_config, "hidden_act", "silu") != "silu":
        raise ValueError(f"HF config hidden_act={_get(hf_config, 'hidden_act')!r}; only 'silu'")
    if _get(hf_config, "mlp_bias", False):
        raise ValueError("HF config mlp_bias=True is not supported (megatron has no MLP bias)")
    if family.model_type != "qwen2" and _get(hf_config, "attention_bias", False):
        raise ValueError(
            f"HF config attention_bias=True is not supported for {family.architecture} "
            "(it adds an output-projection bias that megatron does not have)"
        )
    if _get(hf_config, "use_sliding_window", False):
        raise ValueError("HF config use_sliding_window=True is not supported")
    if family.moe:
        if _get(hf_config, "decoder_sparse_step", 1) != 1 or _get(hf_config, "mlp_only_layers"):
            raise ValueError(
                "HF config decoder_sparse_step != 1 or mlp_only_layers is not supported "
                "(every layer must be a mixture of experts)"
            )
        if _num_experts(hf_config) is None:
            raise ValueError("HF config has no num_experts")
        for key in ("num_experts_per_tok", "moe_intermediate_size"):
            if _get(hf_config, key) is None:
                raise ValueError(f"HF config has no {key}")


def _num_experts(hf_config: Any) -> int | None:
    """``num_experts``; transformers 5 writes it as ``num_local_experts``."""
    return _get(hf_config, "num_experts") or _get(hf_config, "num_local_experts")


def _moe_fields(hf_config: Any, family: Family) -> dict[str, Any]:
    """``ModelConfig``'s expert fields of an HF MoE config (none for a dense family). The
    router's aux-loss coefficient is a training choice: set ``model.moe_aux_loss_coeff``."""
    if not family.moe:
        return {}
    return {
        "num_experts": _num_experts(hf_config),
        "moe_ffn_hidden_size": _get(hf_config, "moe_intermediate_size"),
        "moe_router_topk": _get(hf_config, "num_experts_per_tok"),
        "moe_norm_topk_prob": bool(_get(hf_config, "norm_topk_prob", False)),
    }


def model_config_from_hf(hf_config: Any) -> ModelConfig:
    """The ``ModelConfig`` that reproduces an HF Llama / Qwen2 / Qwen3 config.

    ``hf_config`` is a transformers config or the dict of a ``config.json``.
    Training-only fields (init std, dtype, vocab padding multiple) keep their
    defaults; set them with ``dataclasses.replace``.
    """
    family = family_of(hf_config)
    missing = [key for key in _REQUIRED if _get(hf_config, key) is None]
    if missing:
        raise ValueError(f"HF config has no {', '.join(missing)}")
    _refuse_unsupported(hf_config, family)
    hidden_size = _get(hf_config, "hidden_size")
    num_heads = _get(hf_config, "num_attention_heads")
    theta, _, _ = _rope(hf_config)
    return ModelConfig(
        num_layers=_get(hf_config, "num_hidden_layers"),
        hidden_size=hidden_size,
        ffn_hidden_size=_get(hf_config, "intermediate_size"),
        num_attention_heads=num_heads,
        num_query_groups=_get(hf_config, "num_key_value_heads") or num_heads,
        head_dim=_get(hf_config, "head_dim") or hidden_size // num_heads,
        vocab_size=_get(hf_config, "vocab_size"),
        max_position_embeddings=_get(hf_config, "max_position_embeddings"),
        rotary_base=theta,
        rope_scaling_factor=_rope_scaling_factor(hf_config),
        norm_epsilon=float(_get(hf_config, "rms_norm_eps")),
        add_qkv_bias=family.qkv_bias,
        qk_layernorm=family.qk_norm,
        tie_embeddings=bool(_get(hf_config, "tie_word_embeddings", False)),
        hf_family=family.model_type,
        **_moe_fields(hf_config, family),
    )


def head_dim(cfg: ModelConfig) -> int:
    """Channels per attention head, resolving ``None`` as megatron does."""
    return cfg.head_dim or cfg.hidden_size // cfg.num_attention_heads


def query_groups(cfg: ModelConfig) -> int:
    """Key/value heads, resolving ``None`` (one per query head) as ``ModelConfig`` does."""
    return cfg.num_query_groups or cfg.num_attention_heads


_CHECKED_FIELDS = (
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "head_dim",
    "rotary_base",
    "rope_scaling_factor",
    "vocab_size",
    "norm_epsilon",
    "tie_embeddings",
    "add_qkv_bias",
    "qk_layernorm",
    "num_experts",
    "moe_ffn_hidden_size",
    "moe_router_topk",
    "moe_norm_topk_prob",
)
"""The fields ``check_hf_config`` compares: those the weights' shapes and values depend on."""


def check_hf_config(hf_config: Any, model_cfg: ModelConfig) -> None:
    """Raise a ValueError naming every field where ``model_cfg`` differs from ``hf_config``.

    Run before loading or exporting weights: a shape mismatch surfaces late
    and unnamed, a rope-theta or epsilon mismatch not at all.
    """
    expected = model_config_from_hf(hf_config)
    wrong = []
    for field in _CHECKED_FIELDS:
        want, got = getattr(expected, field), getattr(model_cfg, field)
        if field == "head_dim":
            want, got = head_dim(expected), head_dim(model_cfg)
        if want != got:
            wrong.append(f"{HF_NAMES[field]}={want!r} but model.{field}={got!r}")
    if wrong:
        raise ValueError("HF config does not match the model: " + "; ".join(wrong))


def check_family(model_cfg: ModelConfig, family: Family) -> None:
    """Raise if ``model_cfg`` has a QKV bias or q/k norm that ``family`` does not (or lacks one)."""
    for field, wanted in (("add_qkv_bias", family.qkv_bias), ("qk_layernorm", family.qk_norm)):
        if getattr(model_cfg, field) != wanted:
            raise ValueError(
                f"model.{field}={getattr(model_cfg, field)} does not fit {family.architecture}, "
                f"which has {field}={wanted}"
            )
    if model_cfg.is_moe != family.moe:
        kind = "a mixture of experts" if family.moe else "dense"
        raise ValueError(
            f"model.num_experts={model_cfg.num_experts} does not fit {family.architecture}, "
            f"which is {kind}"
        )
