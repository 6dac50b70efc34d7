"""Parameters and peak memory per GPU of each pipeline stage, by arithmetic alone.

Parameter shapes follow from ``ModelConfig`` the way ``megatron_grpo.mcore.model`` builds
megatron-core's GPTModel (local or Transformer Engine spec: same parameters). A MoE layer
holds a router (replicated over TP) and ``num_experts / EP`` whole experts (expert TP 1).

The memory model, per GPU of pipeline stage ``r`` (bytes):

- weights: the stage's parameters (one TP shard) x the params dtype size.
- gradients: 4 per parameter; ``build_model`` sets ``grad_reduce_in_fp32``, so
  megatron-core DDP keeps an fp32 ``main_grad`` buffer.
- optimizer: Adam keeps ``exp_avg`` and ``exp_avg_sq`` in fp32 (8), plus an fp32
  master copy (4) when the params are bf16; plain SGD only the master copy. With
  ``optim.use_distributed_optimizer`` these are sharded over the DP ranks (ZeRO-1:
  divided by DP; an expert's over its expert-DP ranks, DP x TP / EP); the weights and
  the fp32 gradient buffer stay whole.
- reference model: a second copy of the weights when ``loss.kl_coef > 0``.
- activations: per token and layer, in the params dtype, the tensors autograd keeps:
  the residual stream into the two RMSNorms (2h) and their outputs feeding QKV and fc1
  (2h), replicated over TP unless ``parallel.sequence_parallel`` splits them (/ TP);
  q/k/v and the attention output ((2a + 2g)d / TP), the pre-norm q and k with
  qk_layernorm ((a + g)d / TP), fc1's output and SwiGLU's (3f / TP; in a MoE layer each
  token's k copies through an expert, 3 I k, and its dispatched input and output, 2 h k,
  over the TP ranks' slices of the sequence), and flash
  attention's fp32 softmax statistics. Unfused attention (an explicit mask: packed
  micro-batches, or no Transformer Engine) also keeps the fp32 softmax output and its
  copy in the params dtype, per head, token and key. Tokens per GPU are
  ``train.max_tokens_per_micro_batch / CP``. 1F1B keeps ``PP - r`` micro-batches in
  flight on stage ``r`` (``PP`` on the first stage: the whole model's layers for one
  micro-batch); interleaving adds ``(PP - 1) / (PP x VPP)`` of that.
  Recomputation (``train.recompute_granularity``): ``selective`` drops what its
  modules recompute (``core_attn``: the softmax statistics and probabilities; ``mlp``:
  the 3f; ``layernorm``: the norm outputs); ``full`` keeps only the input of each
  recomputed group of layers (h, / TP with sequence parallelism) and adds, once, the
  whole activations of the group being recomputed in the backward (``uniform``: groups
  of ``recompute_num_layers``; ``block``: the first ``recompute_num_layers`` layers of
  each chunk, one at a time, the rest kept whole).
- logits (last stage): the micro-batch's tokens x the vocabulary shard: the logits in
  the params dtype plus four fp32 working copies of the vocab-parallel log-softmax
  (``logprobs.vocab_parallel_logprobs``) and their gradients.
- reserved: ``RESERVED_GIB`` for the CUDA context, NCCL buffers, the weight-sync
  gather and allocator fragmentation.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_grpo.config import Config, ModelConfig, ParallelDims
from megatron_grpo.config.hf import head_dim, query_groups
from megatron_grpo.config.param_count import expert_params, layer_params
from megatron_grpo.convert.sharding import chunk_layer_range

GIB = 1 << 30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
GRAD_BYTES = 4
"""fp32 main_grad per parameter (grad_reduce_in_fp32=True in build_model)."""
ADAM_STATE_BYTES = 8
"""exp_avg and exp_avg_sq, fp32."""
MASTER_BYTES = 4
"""fp32 master weights, kept when the params are bf16 or fp16."""
LOGIT_FP32_BYTES = 16
"""Per logit entry on the last stage, besides the logits: four fp32 tensors."""
SOFTMAX_STATS_BYTES = 4
"""Flash attention's fp32 log-sum-exp, per head and token."""
SOFTMAX_FP32_BYTES = 4
"""Unfused attention's fp32 softmax output, per head, token and key (its copy in the params
dtype comes on top unless that is fp32)."""
RESERVED_GIB = 5.0
"""CUDA context, NCCL buffers, weight-push gather buffers, allocator fragmentation."""


# --------------------------------------------------------------------------- parameters


def weight_push_bytes(m: ModelConfig, bucket_bytes: int) -> int:
    """Peak extra memory of a stage's sender during a weight push (``weight_sync.sender``):
    two units' full tensors (a decoder layer, or the embedding or head: the one being
    gathered and the one whose bucket is in flight) and two buckets, a bucket being at least
    the largest tensor. Every other rank: nothing beyond its own shard."""
    vocab = m.vocab_size * m.hidden_size
    largest_unit = max(layer_params(m, 1), vocab)
    largest_tensor = max(vocab, 2 * m.ffn_hidden_size * m.hidden_size)
    dtype = DTYPE_BYTES[m.params_dtype]
    return 2 * largest_unit * dtype + 2 * max(bucket_bytes, largest_tensor * dtype)


def delta_copy_bytes(m: ModelConfig, dims: ParallelDims) -> int:
    """``rollout.sync.delta``: the host copy of the bytes last sent that a stage's sender keeps
    between pushes (``weight_sync.delta``), its stage's full (unsharded) weights; the
    largest stage's."""
    vocab = m.vocab_size * m.hidden_size
    return DTYPE_BYTES[m.params_dtype] * max(
        p.num_layers * layer_params(m, 1)
        + (vocab if p.embedding else 0)
        + (vocab if p.output_layer else 0)
        + (m.hidden_size if p.final_norm else 0)
        for p in stage_params(m, dims)
    )


@dataclass(frozen=True)
class StageParams:
    """Parameters one GPU of a pipeline stage holds (its TP shard)."""

    stage: int
    layers: tuple[range, ...]
    """Global indices of the stage's layers, one range per model chunk."""
    layers_params: int
    expert_params: int
    """Of ``layers_params``, the experts': their optimizer state shards over expert-DP."""
    embedding: int
    output_layer: int
    """The output layer; with tied embeddings and PP > 1, the last stage's embedding copy."""
    final_norm: int

    @property
    def num_layers(self) -> int:
        return sum(len(r) for r in self.layers)

    @property
    def total(self) -> int:
        return self.layers_params + self.embedding + self.output_layer + self.final_norm


def stage_params(m: ModelConfig, dims: ParallelDims) -> list[StageParams]:
    """Per pipeline stage, the parameters of one of its GPUs (the model chunks of that rank)."""
    vocab_shard = m.padded_vocab_size(dims.tp) // dims.tp * m.hidden_size
    per_layer = layer_params(m, dims.tp, dims.ep)
    chunks = dims.vpp or 1
    stages = []
    for r in range(dims.pp):
        layers = tuple(
            chunk_layer_range(m.num_layers, r, dims.pp, s, dims.vpp) for s in range(chunks)
        )
        first, last = r == 0, r == dims.pp - 1
        separate_output = not m.tie_embeddings or dims.pp > 1
        stages.append(
            StageParams(
                stage=r,
                layers=layers,
                layers_params=per_layer * sum(len(x) for x in layers),
                expert_params=expert_params(m, dims.ep) * sum(len(x) for x in layers),
                embedding=vocab_shard if first else 0,
                output_layer=vocab_shard if last and separate_output else 0,
                final_norm=m.hidden_size if last else 0,
            )
        )
    return stages


# --------------------------------------------------------------------------- memory


@dataclass(frozen=True)
class LayerActivations:
    """Bytes per token that one decoder layer keeps for the backward on one GPU, by what
    recomputation can drop."""

    residual: float
    """The residual stream into the two RMSNorms (2h; / TP with sequence parallelism)."""
    norm_outputs: float
    """The two RMSNorm outputs feeding QKV and fc1 (2h; / TP with sequence parallelism)."""
    attention: float
    """q, k, v, the attention output and the pre-norm q/k ((2a + 2g)d (+ (a + g)d) / TP)."""
    core_attn: float
    """The softmax statistics, and with unfused attention the probabilities."""
    mlp: float
    """fc1's output and SwiGLU's (3f / TP)."""

    @property
    def total(self) -> float:
        return self.residual + self.norm_outputs + self.attention + self.core_attn + self.mlp

    @property
    def layer_input(self) -> float:
        """What full recomputation keeps of a group of layers: its input hidden state."""
        return self.residual / 2

    def selective(self, modules: list[str]) -> float:
        """What is kept when ``modules`` (megatron-core's recompute_modules) are recomputed."""
        dropped = {"core_attn": self.core_attn, "mlp": self.mlp, "layernorm": self.norm_outputs}
        return self.total - sum(dropped.get(name, 0.0) for name in set(modules))


def layer_activations(
    m: ModelConfig, dims: ParallelDims, seq_len: int, *, unfused_attention: bool
) -> LayerActivations:
    """Bytes per token kept by one layer on one GPU (see the module docstring)."""
    h, d, a, g = m.hidden_size, head_dim(m), m.num_attention_heads, query_groups(m)
    act = DTYPE_BYTES[m.params_dtype]
    sp = dims.tp if dims.uses_sequence_parallel else 1
    attention = (2 * a + 2 * g) * d + ((a + g) * d if m.qk_layernorm else 0)
    core_attn = SOFTMAX_STATS_BYTES * a / dims.tp
    if unfused_attention:
        probs = SOFTMAX_FP32_BYTES + (act if act != SOFTMAX_FP32_BYTES else 0)
        core_attn += probs * a / dims.tp * seq_len
    return LayerActivations(
        residual=act * 2 * h / sp,
        norm_outputs=act * 2 * h / sp,
        attention=act * attention / dims.tp,
        core_attn=core_attn,
        mlp=_mlp_activations(m, dims) * act,
    )


def _mlp_activations(m: ModelConfig, dims: ParallelDims) -> float:
    """Elements per token kept by the MLP: SwiGLU's 3f over TP, or in a MoE layer k copies
    of 3I through whole experts plus the dispatched input and output, over SP."""
    if m.num_experts is None:
        return 3 * m.ffn_hidden_size / dims.tp
    sp = dims.tp if dims.uses_sequence_parallel else 1
    return m.moe_router_topk * (3 * m.expert_ffn_hidden_size + 2 * m.hidden_size) / sp


def activation_bytes_per_token_layer(
    m: ModelConfig, dims: ParallelDims, seq_len: int, *, unfused_attention: bool
) -> float:
    """Bytes autograd keeps per token and layer on one GPU, without recomputation."""
    return layer_activations(m, dims, seq_len, unfused_attention=unfused_attention).total


def kept_per_layer(cfg: Config, per: LayerActivations) -> tuple[float, float]:
    """(bytes per token kept by each layer of a micro-batch in flight, bytes per token of the
    layers being recomputed in the backward, held once) under ``cfg.train``'s recomputation."""
    train, dims = cfg.train, cfg.parallel
    if train.recompute_granularity is None:
        return per.total, 0.0
    if train.recompute_granularity == "selective":
        return per.selective(train.recompute_modules), 0.0
    chunk_layers = cfg.model.num_layers // (dims.pp * (dims.vpp or 1))
    n = min(train.recompute_num_layers, chunk_layers)
    if train.recompute_method == "uniform":
        return per.layer_input / n, n * per.total
    recomputed = n / chunk_layers
    return recomputed * per.layer_input + (1 - recomputed) * per.total, per.total


def layers_in_flight(num_layers: int, dims: ParallelDims, stage: int) -> float:
    """Layers' worth of one micro-batch's activations held by ``stage`` at the 1F1B peak.

    Assumes at least PP micro-batches per optimizer step (fewer only lowers it).
    """
    if dims.vpp is None:
        return (dims.pp - stage) * num_layers / dims.pp
    chunks_in_flight = (dims.pp - stage - 1) * 2 + (dims.vpp - 1) * dims.pp + 1
    return chunks_in_flight * num_layers / (dims.pp * dims.vpp)


@dataclass(frozen=True)
class StageMemory:
    """Estimated peak memory of one GPU of a pipeline stage, in bytes."""

    stage: int
    weights: float
    gradients: float
    optimizer: float
    reference: float
    activations: float
    logits: float
    reserved: float
    layers_in_flight: float
    routes: float = 0.0
    """Routing replay's routes of this rank's micro-batches of one rollout step
    (``routes_bytes``)."""

    @property
    def total(self) -> float:
        return (
            self.weights
            + self.gradients
            + self.optimizer
            + self.reference
            + self.activations
            + self.logits
            + self.reserved
            + self.routes
        )

    def parts(self) -> dict[str, float]:
        return {
            "weights": self.weights,
            "gradients": self.gradients,
            "optimizer states": self.optimizer,
            "reference model": self.reference,
            "activations": self.activations,
            "logits": self.logits,
            "routes": self.routes,
            "reserved": self.reserved,
        }


ROUTE_BYTES = 2
"""One expert id of one token and layer (int16)."""


def routes_bytes(cfg: Config, dp: int) -> tuple[float, float]:
    """(per micro-batch, per rollout step) bytes of routing replay's routes on each GPU: the
    engine's routes (``rollout.return_routed_experts``) and the behaviour pass's (R2), int16
    for every token, layer and top-k slot of the micro-batch (every stage holds all layers').
    A step's micro-batches stay on the GPU from planning to their last optimizer step: at
    most its samples on this DP rank, each at most data.max_prompt_length +
    rollout.max_new_tokens long (the micro-batch budget when the prompt length is not set)."""
    m = cfg.model
    kinds = int(bool(cfg.rollout.return_routed_experts)) + int(cfg.train.routing_replay == "r2")
    if not kinds or not m.is_moe:
        return 0.0, 0.0
    per_token = m.num_layers * m.moe_router_topk * ROUTE_BYTES * kinds
    budget = cfg.train.max_tokens_per_micro_batch
    longest = budget
    if cfg.data.max_prompt_length is not None:
        longest = min(budget, cfg.data.max_prompt_length + cfg.rollout.max_new_tokens)
    samples = -(-cfg.rollout.prompts_per_step * cfg.rollout.samples_per_prompt // dp)
    return budget * per_token, samples * longest * per_token


def optimizer_bytes_per_param(cfg: Config) -> int:
    """Optimizer state per parameter before any DP sharding: an fp32 master copy when the
    params are not fp32, Adam's two moments."""
    master = MASTER_BYTES if cfg.model.params_dtype != "float32" else 0
    return master + (ADAM_STATE_BYTES if cfg.optim.optimizer == "adam" else 0)


def uses_unfused_attention(cfg: Config, unfused_attention: bool | None) -> bool:
    """Unfused attention: as asked, else where packed micro-batches carry an explicit mask
    (``train.pack_sequences``; None is unpacked on GPUs, with Transformer Engine)."""
    return bool(cfg.train.pack_sequences) if unfused_attention is None else unfused_attention


def stage_memory(
    cfg: Config, params: StageParams, dp: int, *, unfused_attention: bool | None = None
) -> StageMemory:
    """Peak memory of one GPU of ``params``' stage at data-parallel size ``dp``."""
    m, dims = cfg.model, cfg.parallel
    n = params.total
    weight_bytes = DTYPE_BYTES[m.params_dtype]
    shards = dp * dims.cp if cfg.optim.use_distributed_optimizer else 1
    expert_shards = dp * dims.tp // dims.ep if cfg.optim.use_distributed_optimizer else 1
    experts = params.expert_params
    tokens = cfg.train.max_tokens_per_micro_batch / dims.cp
    unfused = uses_unfused_attention(cfg, unfused_attention)
    per = layer_activations(m, dims, int(tokens), unfused_attention=unfused)
    kept, recomputing = kept_per_layer(cfg, per)
    in_flight = layers_in_flight(m.num_layers, dims, params.stage)
    last = params.stage == dims.pp - 1
    vocab_shard = m.padded_vocab_size(dims.tp) // dims.tp
    return StageMemory(
        stage=params.stage,
        weights=n * weight_bytes,
        gradients=n * GRAD_BYTES,
        optimizer=optimizer_bytes_per_param(cfg)
        * ((n - experts) / shards + experts / expert_shards),
        reference=n * weight_bytes if cfg.loss.kl_coef > 0 else 0.0,
        activations=tokens * (kept * in_flight + recomputing),
        logits=tokens * vocab_shard * (weight_bytes + LOGIT_FP32_BYTES) if last else 0.0,
        reserved=RESERVED_GIB * GIB,
        layers_in_flight=in_flight,
        routes=routes_bytes(cfg, dp)[1],
    )
