"""Parameters of a model by arithmetic on its config: per decoder layer and TP (and EP) rank,
and in all (the Hugging Face count)."""

from __future__ import annotations

from megatron_grpo.config.hf import head_dim, query_groups
from megatron_grpo.config.model import ModelConfig


def expert_params(m: ModelConfig, ep: int) -> int:
    """Parameters of one decoder layer's experts on one EP rank (0 for a dense model)."""
    if m.num_experts is None:
        return 0
    return m.num_experts // ep * 3 * m.hidden_size * m.expert_ffn_hidden_size


def layer_params(m: ModelConfig, tp: int, ep: int = 1) -> int:
    """Parameters of one decoder layer on one TP (and EP) rank."""
    h, d, a, g = m.hidden_size, head_dim(m), m.num_attention_heads, query_groups(m)
    qkv = (a + 2 * g) * d
    n = (h * qkv + a * d * h) // tp  # qkv, proj
    if m.num_experts is None:
        n += 3 * h * m.ffn_hidden_size // tp  # fc1 (x2), fc2
    else:
        n += m.num_experts * h + expert_params(m, ep)  # router, this rank's experts
    if m.add_qkv_bias:
        n += qkv // tp
    if m.qk_layernorm:
        n += 2 * d  # q and k RMSNorm over one head, replicated over TP
    return n + 2 * h  # input and pre-MLP RMSNorm, replicated over TP


def total_params(m: ModelConfig) -> int:
    """Parameters of the whole model with the unpadded vocabulary: the Hugging Face count."""
    vocab = m.vocab_size * m.hidden_size
    output = 0 if m.tie_embeddings else vocab
    return m.num_layers * layer_params(m, 1) + vocab + output + m.hidden_size
