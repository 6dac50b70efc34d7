"""Dry run: check a config's layout and memory for a world size, by arithmetic alone.

No process group, no model, no GPU. Parameter shapes follow from ``ModelConfig``
the way ``megatron_grpo.mcore.model`` builds megatron-core's GPTModel (local or
Transformer Engine spec: same parameters), and memory per GPU is estimated
from them for each pipeline stage.

The memory model, per GPU of pipeline stage ``r`` (bytes):

- weights: the stage's parameters (one TP shard) x the params dtype size.
- gradients: 4 per parameter; ``build_model`` sets ``grad_reduce_in_fp32``, so
  megatron-core DDP keeps an fp32 ``main_grad`` buffer.
- optimizer: Adam keeps ``exp_avg`` and ``exp_avg_sq`` in fp32 (8), plus an fp32
  master copy (4) when the params are bf16/fp16; plain SGD only the master copy.
  Not divided by DP: ``build_optimizer`` sets ``use_distributed_optimizer=False``.
- reference model: a second copy of the weights when ``loss.kl_coef > 0``.
- activations, no recomputation, no sequence parallelism (``build_model`` sets
  neither): per token and layer, bf16, the tensors autograd keeps:
  the residual-stream and RMSNorm outputs feeding QKV and fc1 (4h, replicated
  over TP), q/k/v and the attention output ((2a + 2g)d / TP), the pre-norm q and k
  with qk_layernorm ((a + g)d / TP), fc1's output and SwiGLU's (3f / TP), and
  flash attention's fp32 softmax statistics. Packed micro-batches carry an
  explicit mask, which rules out fused attention: the fp32 and bf16 attention
  probabilities (6 bytes x a/TP x S per token) are added. Tokens per GPU are
  ``train.max_tokens_per_micro_batch / CP``. 1F1B keeps ``PP - r`` micro-batches
  in flight on stage ``r`` (``PP`` on the first stage: the whole model's layers
  for one micro-batch); interleaving adds ``(PP - 1) / (PP x VPP)`` of that.
- logits (last stage): the micro-batch's tokens x the vocabulary shard, at
  ``LOGIT_BYTES`` per entry: the bf16 logits plus the fp32 working copies of the
  vocab-parallel log-softmax (``logprobs.vocab_parallel_logprobs``) and their
  gradients.
- reserved: ``RESERVED_GIB`` for the CUDA context, NCCL buffers, the weight-sync
  gather and allocator fragmentation.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_grpo.config import Config, ModelConfig, ParallelDims
from megatron_grpo.config.hf import head_dim, query_groups
from megatron_grpo.convert.sharding import chunk_layer_range

GIB = 1 << 30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
GRAD_BYTES = 4
"""fp32 main_grad per parameter (grad_reduce_in_fp32=True in build_model)."""
ADAM_STATE_BYTES = 8
"""exp_avg and exp_avg_sq, fp32."""
MASTER_BYTES = 4
"""fp32 master weights, kept when the params are bf16 or fp16."""
LOGIT_BYTES = 18
"""Per logit entry on the last stage: bf16 logits (2) + four fp32 tensors (16)."""
SOFTMAX_STATS_BYTES = 4
"""Flash attention's fp32 log-sum-exp, per head and token."""
UNFUSED_PROBS_BYTES = 6
"""Unfused attention keeps the fp32 softmax output and its bf16 copy, per head, token and key."""
RESERVED_GIB = 5.0
"""CUDA context, NCCL buffers, weight-sync gather buffers, allocator fragmentation."""


# --------------------------------------------------------------------------- parameters


def layer_params(m: ModelConfig, tp: int) -> int:
    """Parameters of one decoder layer on one TP rank."""
    h, d, a, g = m.hidden_size, head_dim(m), m.num_attention_heads, query_groups(m)
    qkv = (a + 2 * g) * d
    n = (h * qkv + a * d * h + 3 * h * m.ffn_hidden_size) // tp  # qkv, proj, fc1 (x2), fc2
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


@dataclass(frozen=True)
class StageParams:
    """Parameters one GPU of a pipeline stage holds (its TP shard)."""

    stage: int
    layers: tuple[range, ...]
    """Global indices of the stage's layers, one range per model chunk."""
    layers_params: int
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
    per_layer = layer_params(m, dims.tp)
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
                embedding=vocab_shard if first else 0,
                output_layer=vocab_shard if last and separate_output else 0,
                final_norm=m.hidden_size if last else 0,
            )
        )
    return stages


# --------------------------------------------------------------------------- memory


def activation_bytes_per_token_layer(
    m: ModelConfig, dims: ParallelDims, seq_len: int, *, packed: bool
) -> float:
    """Bytes autograd keeps per token and layer on one GPU (see the module docstring)."""
    h, d, a, g = m.hidden_size, head_dim(m), m.num_attention_heads, query_groups(m)
    act = DTYPE_BYTES[m.params_dtype]
    sharded = (2 * a + 2 * g) * d + 3 * m.ffn_hidden_size
    if m.qk_layernorm:
        sharded += (a + g) * d
    per_token = act * (4 * h + sharded / dims.tp) + SOFTMAX_STATS_BYTES * a / dims.tp
    if packed:
        per_token += UNFUSED_PROBS_BYTES * a / dims.tp * seq_len
    return per_token


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
        )

    def parts(self) -> dict[str, float]:
        return {
            "weights": self.weights,
            "gradients": self.gradients,
            "optimizer states": self.optimizer,
            "reference model": self.reference,
            "activations": self.activations,
            "logits": self.logits,
            "reserved": self.reserved,
        }


def stage_memory(cfg: Config, params: StageParams) -> StageMemory:
    m, dims = cfg.model, cfg.parallel
    n = params.total
    weight_bytes = DTYPE_BYTES[m.params_dtype]
    master = MASTER_BYTES if m.params_dtype != "float32" else 0
    optimizer = master + (ADAM_STATE_BYTES if cfg.optim.optimizer == "adam" else 0)
    tokens = cfg.train.max_tokens_per_micro_batch / dims.cp
    packed = bool(cfg.train.pack_sequences)  # None: not packed on GPUs (Transformer Engine)
    per_layer = activation_bytes_per_token_layer(m, dims, int(tokens), packed=packed)
    in_flight = layers_in_flight(m.num_layers, dims, params.stage)
    last = params.stage == dims.pp - 1
    vocab_shard = m.padded_vocab_size(dims.tp) // dims.tp
    return StageMemory(
        stage=params.stage,
        weights=n * weight_bytes,
        gradients=n * GRAD_BYTES,
        optimizer=n * optimizer,
        reference=n * weight_bytes if cfg.loss.kl_coef > 0 else 0.0,
        activations=per_layer * tokens * in_flight,
        logits=tokens * vocab_shard * LOGIT_BYTES if last else 0.0,
        reserved=RESERVED_GIB * GIB,
        layers_in_flight=in_flight,
    )


# --------------------------------------------------------------------------- the report


def resolve_world_size(
    world_size: int | None, nnodes: int | None, gpus_per_node: int | None
) -> tuple[int, int | None]:
    """(world size, GPUs per node or None) from ``--world-size`` or ``--nnodes x --gpus-per-node``.

    With neither, one node of 8 GPUs.
    """
    if world_size is not None and world_size < 1:
        raise ValueError(f"--world-size must be >= 1, got {world_size}")
    if world_size is not None and nnodes is None and gpus_per_node is None:
        return world_size, None
    nodes, per_node = nnodes or 1, gpus_per_node or 8
    if nodes < 1 or per_node < 1:
        raise ValueError(f"--nnodes and --gpus-per-node must be >= 1, got {nodes}, {per_node}")
    if world_size is not None and world_size != nodes * per_node:
        raise ValueError(
            f"--world-size {world_size} is not --nnodes {nodes} x --gpus-per-node {per_node}"
        )
    return nodes * per_node, per_node


@dataclass(frozen=True)
class DryRunReport:
    cfg: Config
    world_size: int
    gpus_per_node: int | None
    dp: int
    gpu_memory_gb: float
    params: list[StageParams]
    memory: list[StageMemory]

    @property
    def worst(self) -> StageMemory:
        return max(self.memory, key=lambda s: s.total)

    @property
    def fits(self) -> bool:
        return self.worst.total <= self.gpu_memory_gb * GIB

    def refusal(self) -> str:
        """Why the layout does not fit, and what to change."""
        w, dims, train = self.worst, self.cfg.parallel, self.cfg.train
        parts = sorted(w.parts().items(), key=lambda kv: -kv[1])[:3]
        model_states = w.weights + w.gradients + w.optimizer
        spread = (
            f"raise parallel.tp (now {dims.tp}) or parallel.pp (now {dims.pp}) to spread "
            f"weights, gradients and optimizer states ({_gib(model_states)} GiB; the optimizer is "
            "not sharded across DP: use_distributed_optimizer=False)"
        )
        shrink = (
            f"lower train.max_tokens_per_micro_batch (now {train.max_tokens_per_micro_batch}) "
            f"to shrink activations and logits ({_gib(w.activations + w.logits)} GiB)"
        )
        fixes = [spread, shrink] if model_states >= w.activations + w.logits else [shrink, spread]
        if w.reference:
            fixes.append(
                f"set loss.kl_coef=0 to drop the reference model ({_gib(w.reference)} GiB)"
            )
        fixes.append("or pass --gpu-memory-gb if the GPUs have more memory")
        return (
            f"the layout does not fit: pipeline stage {w.stage} needs {_gib(w.total)} GiB per GPU, "
            f"above the {self.gpu_memory_gb:g} GiB of --gpu-memory-gb (largest parts: "
            + ", ".join(f"{k} {_gib(v)} GiB" for k, v in parts)
            + "). To fit: "
            + "; ".join(fixes)
            + "."
        )

    def format(self) -> str:
        return "\n".join(_format(self))


def dry_run(
    cfg: Config,
    *,
    world_size: int,
    gpus_per_node: int | None = None,
    gpu_memory_gb: float = 80.0,
) -> DryRunReport:
    """Validate ``cfg``'s layout for ``world_size`` GPUs and estimate memory per GPU.

    Raises a ValueError naming the reason when the layout is invalid; a layout
    that is valid but too big comes back with ``fits`` False.
    """
    m, dims = cfg.model, cfg.parallel
    dp = dims.data_parallel_size(world_size)
    dims.validate_model(
        num_layers=m.num_layers,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=query_groups(m),
    )
    if m.ffn_hidden_size % dims.tp:
        raise ValueError(
            f"model.ffn_hidden_size={m.ffn_hidden_size} is not divisible by TP={dims.tp}"
        )
    gbs = (
        cfg.train.global_batch_size or cfg.rollout.prompts_per_step * cfg.rollout.samples_per_prompt
    )
    if gbs < dp:
        raise ValueError(
            f"train.global_batch_size={gbs} is below DP={dp}: every DP rank needs a sample"
        )
    if gpu_memory_gb <= 0:
        raise ValueError(f"--gpu-memory-gb must be positive, got {gpu_memory_gb}")
    params = stage_params(m, dims)
    return DryRunReport(
        cfg=cfg,
        world_size=world_size,
        gpus_per_node=gpus_per_node,
        dp=dp,
        gpu_memory_gb=gpu_memory_gb,
        params=params,
        memory=[stage_memory(cfg, p) for p in params],
    )


def _gib(num_bytes: float) -> str:
    return f"{num_bytes / GIB:.1f}"


def _billions(n: float) -> str:
    return f"{n / 1e9:.3f}B" if n >= 1e8 else f"{n / 1e6:.3f}M" if n >= 1e5 else f"{n:,.0f}"


def _layer_ranges(layers: tuple[range, ...]) -> str:
    return ", ".join(str(r.start) if len(r) == 1 else f"{r.start}-{r.stop - 1}" for r in layers)


def _format(r: DryRunReport) -> list[str]:
    dims = r.cfg.parallel
    lines = _format_params(r) + _format_memory(r)
    if dims.cp > 1:
        lines.append(
            "note: CP > 1 is estimated with each micro-batch's tokens split over the CP ranks; "
            "the trainer does not split them yet"
        )
    if r.gpus_per_node and dims.tp > r.gpus_per_node:
        lines.append(f"note: TP={dims.tp} spans nodes ({r.gpus_per_node} GPUs per node)")
    verdict = "fits" if r.fits else "DOES NOT FIT"
    lines.append(f"verdict: {verdict} ({_gib(r.worst.total)} of {r.gpu_memory_gb:g} GiB per GPU)")
    return lines


def _format_params(r: DryRunReport) -> list[str]:
    dims, m = r.cfg.parallel, r.cfg.model
    nodes = ""
    if r.gpus_per_node:
        num_nodes = r.world_size // r.gpus_per_node
        nodes = f" = {num_nodes} node{'s' * (num_nodes > 1)} x {r.gpus_per_node} GPUs"
    vpp = f" VPP={dims.vpp}" if dims.vpp else ""
    lines = [
        f"dry run: {r.world_size} GPUs{nodes}; no process started, nothing allocated",
        f"layout: DP={r.dp} TP={dims.tp} PP={dims.pp} CP={dims.cp}{vpp}",
        f"model: {_billions(total_params(m))} parameters, {m.num_layers} layers, vocabulary "
        f"{m.vocab_size} (padded to {m.padded_vocab_size(dims.tp)} at TP={dims.tp}), "
        f"{m.params_dtype}",
        "parameters per GPU (one TP shard of each stage):",
    ]
    for p in r.params:
        parts = [("embedding", p.embedding), ("output layer", p.output_layer)]
        extra = [name for name, n in parts + [("final norm", p.final_norm)] if n]
        lines.append(
            f"  stage {p.stage}: layer{'s' * (p.num_layers > 1)} {_layer_ranges(p.layers)} "
            f"({p.num_layers} x {_billions(p.layers_params / max(p.num_layers, 1))})"
            + (f" + {' + '.join(extra)}" if extra else "")
            + f" = {_billions(p.total)}"
        )
    biggest = max(r.params, key=lambda p: p.total)
    lines.append(f"  largest stage: {biggest.stage} ({_billions(biggest.total)} per GPU)")
    return lines


def _format_memory(r: DryRunReport) -> list[str]:
    cfg, dims, m, w = r.cfg, r.cfg.parallel, r.cfg.model, r.worst
    tokens = cfg.train.max_tokens_per_micro_batch // dims.cp
    states = ["fp32 master"] if m.params_dtype != "float32" else []
    if cfg.optim.optimizer == "adam":
        states += ["exp_avg", "exp_avg_sq"]
    optim = f"{cfg.optim.optimizer}: {' + '.join(states) or 'no state'}"
    vocab_shard = m.padded_vocab_size(dims.tp) // dims.tp
    rows = [
        ("weights", w.weights, m.params_dtype),
        ("gradients", w.gradients, "fp32 main_grad (grad_reduce_in_fp32)"),
        (
            "optimizer states",
            w.optimizer,
            f"{optim}; not sharded across DP (use_distributed_optimizer=False)",
        ),
        ("reference model", w.reference, f"loss.kl_coef={cfg.loss.kl_coef:g}"),
        (
            "activations",
            w.activations,
            f"{tokens} tokens/micro-batch/GPU x {w.layers_in_flight:g} layers in flight "
            "(1F1B), no recomputation",
        ),
        ("logits", w.logits, f"last stage: {tokens} tokens x {vocab_shard} x {LOGIT_BYTES} B"),
        ("reserved", w.reserved, "CUDA context, NCCL, fragmentation"),
        ("total", w.total, f"of {r.gpu_memory_gb:g} GiB"),
    ]
    return [
        f"memory per GPU, GiB: stage {w.stage} is the peak (per stage: "
        + ", ".join(f"{s.stage}: {_gib(s.total)}" for s in r.memory)
        + ")",
        *(f"  {name:<18}{_gib(v):>7}  {note}" for name, v, note in rows),
        "host memory of global rank 0 for weight sync (the full model, gathered to CPU): "
        f"{_gib(total_params(m) * DTYPE_BYTES[m.params_dtype])} GiB",
    ]
