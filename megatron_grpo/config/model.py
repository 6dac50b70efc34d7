"""The learner's model (a Llama / Qwen-style decoder, dense or mixture-of-experts) and its
parallel layout."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

HFFamily = Literal["llama", "qwen2", "qwen3", "qwen3_moe"]
"""The Hugging Face families the model can be built as (``model_type`` of their config)."""


@dataclass(kw_only=True)
class ModelConfig:
    """A Llama / Qwen2 / Qwen3-style decoder (RMSNorm, SwiGLU, RoPE, GQA); with
    ``num_experts`` set, every layer's MLP is a mixture of experts (Qwen3-MoE)."""

    num_layers: int = 2
    """Number of transformer layers."""
    hidden_size: int = 64
    """Model width."""
    ffn_hidden_size: int = 128
    """Width of the SwiGLU MLP (per branch)."""
    num_attention_heads: int = 4
    """Query heads."""
    num_query_groups: int | None = None
    """Key/value heads (GQA); None means one per query head."""
    head_dim: int | None = None
    """Channels per head; None means hidden_size / num_attention_heads."""
    vocab_size: int = 256
    """Tokenizer vocabulary size (before padding for TP)."""
    make_vocab_size_divisible_by: int = 128
    """The embedding is padded to a multiple of this times TP."""
    max_position_embeddings: int = 512
    """Longest sequence the model is built for."""
    rotary_base: float = 10000.0
    """RoPE base (theta)."""
    rope_scaling_factor: float | None = None
    """Llama 3.1-style RoPE scaling factor (HF ``rope_type: llama3``); None disables it.
    megatron-core fixes the other llama3 parameters: low/high frequency factors 1 and 4,
    original context 8192."""
    norm_epsilon: float = 1e-6
    """RMSNorm epsilon."""
    add_qkv_bias: bool = False
    """QKV projection bias (Qwen2)."""
    qk_layernorm: bool = False
    """RMSNorm on queries and keys (Qwen3)."""
    tie_embeddings: bool = False
    """Share the input embedding and the output layer."""
    init_method_std: float = 0.02
    """Standard deviation of the weight initialization."""
    params_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Parameter and activation dtype (bfloat16 keeps fp32 master weights and gradients;
    float16 is refused: it needs a loss scaler)."""
    hf_family: HFFamily = "qwen2"
    """Hugging Face architecture the weights map to (weight sync, export)."""
    num_experts: int | None = None
    """Routed experts per layer (megatron-core's ``num_moe_experts``); None is a dense MLP."""
    moe_ffn_hidden_size: int | None = None
    """Width of one expert's SwiGLU MLP (HF ``moe_intermediate_size``); None means
    ``ffn_hidden_size``."""
    moe_router_topk: int = 2
    """Experts each token is routed to (HF ``num_experts_per_tok``)."""
    moe_router_score_function: Literal["softmax", "sigmoid"] = "softmax"
    """Router score: softmax over the experts, or an independent sigmoid per expert."""
    moe_norm_topk_prob: bool = True
    """Renormalize the top-k scores to sum to 1 (HF ``norm_topk_prob``). With softmax: the
    softmax of the top-k logits (False: the top-k of the full softmax). Sigmoid scores are
    always renormalized by megatron-core when top-k > 1."""
    moe_capacity_factor: float | None = None
    """Tokens an expert takes, as a multiple of its even share; the rest are dropped. None
    drops nothing (the dropless MoE of Qwen3 and of the rollout engines)."""
    moe_token_drop_policy: Literal["probs", "position"] = "probs"
    """With a capacity: drop the tokens of lowest router probability, or the latest ones."""
    moe_aux_loss_coeff: float = 0.0
    """Coefficient of the router's load-balancing loss (HF ``router_aux_loss_coef``); 0
    switches it off."""
    moe_grouped_gemm: bool = False
    """Run each rank's experts as one grouped GEMM (GPU, Transformer Engine); off runs them
    one after the other (megatron-core's SequentialMLP), as on CPU."""

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads"):
            if getattr(self, name) < 1:
                raise ValueError(f"model.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"model.num_attention_heads={self.num_attention_heads} is not divisible by "
                f"model.num_query_groups={self.num_query_groups}"
            )
        if self.rope_scaling_factor is not None and self.rope_scaling_factor <= 0:
            raise ValueError(
                f"model.rope_scaling_factor must be > 0, got {self.rope_scaling_factor}"
            )
        if self.params_dtype == "float16":
            raise ValueError(
                "model.params_dtype=float16 is not supported: fp16 training needs a dynamic loss "
                "scaler, which the trainer does not run; use bfloat16"
            )
        self._check_moe()
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"model.hidden_size={self.hidden_size} is not divisible by "
                f"model.num_attention_heads={self.num_attention_heads}; set model.head_dim"
            )

    def _check_moe(self) -> None:
        if self.num_experts is None:
            if self.hf_family == "qwen3_moe":
                raise ValueError("model.hf_family=qwen3_moe needs model.num_experts")
            return
        if self.num_experts < 2:
            raise ValueError(f"model.num_experts must be >= 2 (or unset), got {self.num_experts}")
        if not 1 <= self.moe_router_topk <= self.num_experts:
            raise ValueError(
                f"model.moe_router_topk={self.moe_router_topk} must lie in "
                f"[1, model.num_experts={self.num_experts}]"
            )
        if self.moe_ffn_hidden_size is not None and self.moe_ffn_hidden_size < 1:
            raise ValueError(
                f"model.moe_ffn_hidden_size must be >= 1, got {self.moe_ffn_hidden_size}"
            )
        if self.moe_capacity_factor is not None and self.moe_capacity_factor <= 0:
            raise ValueError(
                f"model.moe_capacity_factor must be > 0 (or unset), got {self.moe_capacity_factor}"
            )
        if self.moe_aux_loss_coeff < 0:
            raise ValueError(
                f"model.moe_aux_loss_coeff must be >= 0, got {self.moe_aux_loss_coeff}"
            )
        sigmoid = self.moe_router_score_function == "sigmoid"
        if sigmoid and not self.moe_norm_topk_prob and self.moe_router_topk > 1:
            raise ValueError(
                "model.moe_norm_topk_prob=false with moe_router_score_function=sigmoid and "
                "moe_router_topk > 1: megatron-core always renormalizes sigmoid top-k scores"
            )

    @property
    def is_moe(self) -> bool:
        return self.num_experts is not None

    @property
    def expert_ffn_hidden_size(self) -> int:
        """Width of one expert's MLP (``moe_ffn_hidden_size`` or ``ffn_hidden_size``)."""
        return self.moe_ffn_hidden_size or self.ffn_hidden_size

    def padded_vocab_size(self, tp: int) -> int:
        multiple = self.make_vocab_size_divisible_by * tp
        return -(-self.vocab_size // multiple) * multiple


def check_moe_layout(
    model: ModelConfig,
    dims: ParallelDims,
    recompute_granularity: str | None,
    *,
    routing_replay: str = "off",
) -> None:
    """Raise a ValueError for what a MoE model cannot train with: context parallelism and TP
    without sequence parallelism (megatron-core's MoE layer refuses it); routing replay of
    a dense model."""
    if routing_replay != "off" and not model.is_moe:
        raise ValueError(
            f"train.routing_replay={routing_replay} needs a mixture-of-experts model "
            "(model.num_experts); a dense model has no routers to replay"
        )
    if not model.is_moe:
        return

    if dims.cp > 1:
        raise ValueError(
            f"a mixture-of-experts model at parallel.cp={dims.cp} is not supported: the routers' "
            "balance loss counts each sequence's tokens on one rank (mcore.router_balance)"
        )
    if dims.tp > 1 and not dims.uses_sequence_parallel:
        raise ValueError(
            f"a mixture-of-experts model at TP={dims.tp} needs parallel.sequence_parallel=true "
            "(megatron-core's MoE layer trains only with it)"
        )


@dataclass(frozen=True, kw_only=True)
class ParallelDims:
    """Model-parallel sizes; the data-parallel size follows from the world size.

    Expert parallelism (``ep``) splits a MoE layer's experts over ranks that the dense
    layers use for DP and TP: megatron-core lays the experts out on a second grid of
    expert-TP x EP x expert-DP x PP ranks. Expert TP is 1 here (each rank holds whole
    experts), so EP must divide DP x TP, and the experts are replicated over the
    remaining (DP x TP) / EP ranks, which all-reduce their gradients.
    """

    tp: int = 1
    """Tensor-parallel size."""
    pp: int = 1
    """Pipeline-parallel size."""
    cp: int = 1
    """Context-parallel size: each sequence is split over ``cp`` ranks (2 cp chunks, rank r
    holding chunks r and 2 cp - 1 - r, in Transformer Engine's packed THD format). Needs
    Transformer Engine's attention, so a GPU; not with ``vpp`` or a mixture of experts."""
    vpp: int | None = None
    """Virtual pipeline stages per rank (interleaved 1F1B), or None. The planner then makes
    each rank's micro-batch count a multiple of ``pp``, as the interleaved schedule needs."""
    ep: int = 1
    """Expert-parallel size: each rank holds ``num_experts / ep`` of every MoE layer's
    experts, and tokens travel to their experts by all-to-all."""
    sequence_parallel: bool = True
    """Split the activations outside attention and the MLP along the sequence over the TP
    ranks (megatron-core's ``sequence_parallel``; only when tp > 1). Saves activation
    memory by about TP; rows are padded to a multiple of TP."""

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "cp", "ep"):
            if getattr(self, name) < 1:
                raise ValueError(f"parallel.{name} must be >= 1, got {getattr(self, name)}")
        if self.cp > 1 and self.vpp is not None:
            raise ValueError(
                f"parallel.cp={self.cp} with parallel.vpp={self.vpp} is not supported: the "
                "interleaved schedule needs every micro-batch in one shape, and context-parallel "
                "micro-batches are packed sequences of varying length"
            )
        if self.vpp is not None and (self.vpp < 2 or self.pp < 2):
            raise ValueError(
                f"parallel.vpp={self.vpp} needs vpp >= 2 and pp >= 2 (pp is {self.pp})"
            )

    @property
    def uses_sequence_parallel(self) -> bool:
        return self.sequence_parallel and self.tp > 1

    @property
    def model_parallel_size(self) -> int:
        return self.tp * self.pp * self.cp

    def data_parallel_size(self, world_size: int) -> int:
        """DP size for ``world_size`` ranks; raises if the layout does not divide it."""
        if world_size % self.model_parallel_size:
            raise ValueError(
                f"world size {world_size} is not divisible by "
                f"TP({self.tp}) x PP({self.pp}) x CP({self.cp}) = {self.model_parallel_size}"
            )
        dp = world_size // self.model_parallel_size
        if (dp * self.tp) % self.ep:
            raise ValueError(
                f"parallel.ep={self.ep} does not divide DP({dp}) x TP({self.tp}) = "
                f"{dp * self.tp}: the expert-parallel ranks are taken from the data- and "
                "tensor-parallel ranks of each pipeline stage"
            )
        return dp

    def validate_model(
        self,
        *,
        num_layers: int,
        num_attention_heads: int,
        num_query_groups: int,
        num_experts: int | None = None,
    ) -> None:
        """Raise a ValueError naming the first model dimension the layout does not divide."""
        if self.ep > 1 and num_experts is None:
            raise ValueError(
                f"parallel.ep={self.ep} needs a mixture-of-experts model (model.num_experts)"
            )
        if num_experts is not None and num_experts % self.ep:
            raise ValueError(
                f"model.num_experts={num_experts} is not divisible by parallel.ep={self.ep}"
            )
        stages = self.pp * (self.vpp or 1)
        if num_layers % stages:
            raise ValueError(
                f"model.num_layers={num_layers} is not divisible by the number of pipeline "
                f"stages PP({self.pp}) x VPP({self.vpp or 1}) = {stages}"
            )
        if num_attention_heads % self.tp:
            raise ValueError(
                f"model.num_attention_heads={num_attention_heads} is not divisible by TP={self.tp}"
            )
        if num_query_groups % self.tp:
            raise ValueError(
                f"model.num_query_groups={num_query_groups} is not divisible by TP={self.tp}"
            )
