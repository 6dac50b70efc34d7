"""Dry run: check a config's layout and memory for a world size, by arithmetic alone.

No process group, no model, no GPU. Parameter shapes follow from ``ModelConfig``
the way ``megatron_grpo.mcore.model`` builds megatron-core's GPTModel (local or
Transformer Engine spec: same parameters), and memory per GPU is estimated
from them for each pipeline stage.

The parameter counts and the memory model are in ``memory_model``; each weight-sync
method's predicted push time (a ``weight push`` line per method) in ``push_time``.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_grpo.commands.colocated_memory import ColocatedMemory, colocated_memory
from megatron_grpo.commands.memory_model import (
    DTYPE_BYTES,
    GIB,
    LOGIT_FP32_BYTES,
    StageMemory,
    StageParams,
    delta_copy_bytes,
    routes_bytes,
    stage_memory,
    stage_params,
    weight_push_bytes,
)
from megatron_grpo.commands.push_time import PushPrediction, predict_push
from megatron_grpo.config import Config, RolloutConfig
from megatron_grpo.config.param_count import total_params
from megatron_grpo.train.preflight import check_layout

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
    colocated: ColocatedMemory | None = None
    """Both phases and the offload's host memory, for ``rollout.placement: colocated``."""

    @property
    def worst(self) -> StageMemory:
        return max(self.memory, key=lambda s: s.total)

    @property
    def fits(self) -> bool:
        learner_fits = self.worst.total <= self.gpu_memory_gb * GIB
        return learner_fits and (self.colocated is None or self.colocated.fits)

    def refusal(self) -> str:
        """Why the layout does not fit, and what to change."""
        if self.colocated is not None and self.worst.total <= self.gpu_memory_gb * GIB:
            return "; ".join(self.colocated.shortfalls()) + "."
        w, dims, train = self.worst, self.cfg.parallel, self.cfg.train
        parts = sorted(w.parts().items(), key=lambda kv: -kv[1])[:3]
        model_states = w.weights + w.gradients + w.optimizer
        spread = (
            f"raise parallel.tp (now {dims.tp}) or parallel.pp (now {dims.pp}) to spread "
            f"weights, gradients and optimizer states ({_gib(model_states)} GiB)"
        )
        shrink = (
            f"lower train.max_tokens_per_micro_batch (now {train.max_tokens_per_micro_batch}) "
            f"to shrink activations and logits ({_gib(w.activations + w.logits)} GiB)"
        )
        fixes = [spread, shrink] if model_states >= w.activations + w.logits else [shrink, spread]
        if not self.cfg.optim.use_distributed_optimizer and self.dp > 1:
            fixes.insert(
                0,
                "set optim.use_distributed_optimizer=true to shard the optimizer states "
                f"({_gib(w.optimizer)} GiB) over DP={self.dp}",
            )
        if train.recompute_granularity is None and w.activations > w.logits:
            fixes.insert(
                0,
                "set train.recompute_granularity=full to recompute activations "
                f"({_gib(w.activations)} GiB) in the backward",
            )
        if dims.tp > 1 and not dims.uses_sequence_parallel:
            fixes.insert(0, "set parallel.sequence_parallel=true to split activations over TP")
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
    host_memory_gib: float = 2048.0,
    unfused_attention: bool | None = None,
) -> DryRunReport:
    """Validate ``cfg``'s layout for ``world_size`` GPUs and estimate memory per GPU.

    ``host_memory_gib`` is each node's host memory, read for ``rollout.placement: colocated``
    (the learner's offload). ``unfused_attention`` says whether attention keeps its S x S
    probabilities (True on CPU, with the local layer spec); None decides as on GPUs (see
    ``uses_unfused_attention``).

    Raises a ValueError naming the reason when the layout is invalid; a layout
    that is valid but too big comes back with ``fits`` False.
    """
    m, dims = cfg.model, cfg.parallel
    dp = check_layout(cfg, world_size)
    if gpu_memory_gb <= 0:
        raise ValueError(f"--gpu-memory-gb must be positive, got {gpu_memory_gb}")
    params = stage_params(m, dims)
    memory = [stage_memory(cfg, p, dp, unfused_attention=unfused_attention) for p in params]
    return DryRunReport(
        cfg=cfg,
        world_size=world_size,
        gpus_per_node=gpus_per_node,
        dp=dp,
        gpu_memory_gb=gpu_memory_gb,
        params=params,
        memory=memory,
        colocated=_colocated(
            cfg, memory, gpus_per_node or world_size, gpu_memory_gb, host_memory_gib
        ),
    )


def _colocated(
    cfg: Config,
    memory: list[StageMemory],
    gpus_per_node: int,
    gpu_memory_gb: float,
    host_memory_gib: float,
) -> ColocatedMemory | None:
    """The colocated placement's phases (None when the engines have GPUs of their own); without
    --nnodes or --gpus-per-node, the world is one node."""
    if cfg.rollout.placement != "colocated":
        return None
    if host_memory_gib <= 0:
        raise ValueError(f"--host-memory-gib must be positive, got {host_memory_gib}")
    co = cfg.rollout.colocate
    return colocated_memory(
        offload=co.offload,
        mem_fraction_static=co.mem_fraction_static,
        engine_tp=co.engine_tp,
        host_headroom_gib=co.host_memory_headroom_gib,
        num_params=total_params(cfg.model),
        stages=memory,
        gpus_per_node=gpus_per_node,
        gpu_memory_gib=gpu_memory_gb,
        host_memory_gib=host_memory_gib,
    )


def _gib(num_bytes: float) -> str:
    return f"{num_bytes / GIB:.1f}"


def _size(num_bytes: float) -> str:
    for unit, scale in (("GiB", GIB), ("MiB", 1 << 20)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.1f} {unit}"
    return f"{num_bytes / 1024:.1f} KiB"


def _billions(n: float) -> str:
    return f"{n / 1e9:.3f}B" if n >= 1e8 else f"{n / 1e6:.3f}M" if n >= 1e5 else f"{n:,.0f}"


def _layer_ranges(layers: tuple[range, ...]) -> str:
    return ", ".join(str(r.start) if len(r) == 1 else f"{r.start}-{r.stop - 1}" for r in layers)


def _format(r: DryRunReport) -> list[str]:
    dims = r.cfg.parallel
    lines = _format_params(r) + _format_memory(r) + _format_push(r)
    if r.gpus_per_node and dims.tp > r.gpus_per_node:
        lines.append(f"note: TP={dims.tp} spans nodes ({r.gpus_per_node} GPUs per node)")
    detail = f"{_gib(r.worst.total)} of {r.gpu_memory_gb:g} GiB per GPU"
    if r.colocated is not None:
        lines += r.colocated.format()
        detail = r.colocated.verdict_detail()
    verdict = "fits" if r.fits else "DOES NOT FIT"
    lines.append(f"verdict: {verdict} ({detail})")
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
        f"layout: DP={r.dp} TP={dims.tp} PP={dims.pp} CP={dims.cp}{vpp}"
        + (f" EP={dims.ep}" if m.is_moe else ""),
        f"model: {_billions(total_params(m))} parameters, {m.num_layers} layers, vocabulary "
        f"{m.vocab_size} (padded to {m.padded_vocab_size(dims.tp)} at TP={dims.tp}), "
        f"{m.params_dtype}",
        "parameters per GPU (one TP shard of each stage):",
    ]
    if m.num_experts is not None:
        lines.insert(
            -1,
            f"experts: {m.num_experts} per layer, top-{m.moe_router_topk}, "
            f"{m.num_experts // dims.ep} per EP rank (EP={dims.ep}), "
            f"{_billions(3 * m.hidden_size * m.expert_ffn_hidden_size)} each",
        )
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
    if cfg.optim.use_distributed_optimizer:
        optim += f"; sharded over DP={r.dp} (distributed optimizer)"
        if m.is_moe:
            optim += f", experts' over expert-DP={r.dp * dims.tp // dims.ep}"
    else:
        optim += "; not sharded (optim.use_distributed_optimizer=false)"
    vocab_shard = m.padded_vocab_size(dims.tp) // dims.tp
    logit_bytes = DTYPE_BYTES[m.params_dtype] + LOGIT_FP32_BYTES
    rows = [
        ("weights", w.weights, m.params_dtype),
        ("gradients", w.gradients, "fp32 main_grad (grad_reduce_in_fp32)"),
        ("optimizer states", w.optimizer, optim),
        ("reference model", w.reference, f"loss.kl_coef={cfg.loss.kl_coef:g}"),
        (
            "activations",
            w.activations,
            f"{tokens} tokens/micro-batch/GPU x {w.layers_in_flight:g} layers in flight "
            f"(1F1B); {_activation_options(cfg)}",
        ),
        ("logits", w.logits, f"last stage: {tokens} tokens x {vocab_shard} x {logit_bytes} B"),
        *_routes_row(cfg, r.dp, w.routes),
        ("reserved", w.reserved, "CUDA context, NCCL, fragmentation"),
        ("total", w.total, f"of {r.gpu_memory_gb:g} GiB"),
    ]
    return [
        f"memory per GPU, GiB: stage {w.stage} is the peak (per stage: "
        + ", ".join(f"{s.stage}: {_gib(s.total)}" for s in r.memory)
        + ")",
        *(f"  {name:<18}{_gib(v):>7}  {note}" for name, v, note in rows),
        "weight push, extra memory of each stage's sender (2 decoder layers or embeddings, "
        f"2 buckets of {cfg.rollout.sync.bucket_mb} MiB or the largest tensor): "
        f"{_gib(weight_push_bytes(m, cfg.rollout.sync.bucket_mb << 20))} GiB; the full model "
        f"would be {_gib(total_params(m) * DTYPE_BYTES[m.params_dtype])} GiB",
        *(
            [
                "rollout.sync.delta: each stage's sender also keeps a host copy (CPU memory) of "
                "the bytes it last sent, its stage's full weights: "
                f"{_gib(delta_copy_bytes(m, dims))} GiB for the largest stage"
            ]
            if cfg.rollout.sync.delta
            else []
        ),
    ]


def push_predictions(r: DryRunReport) -> dict[str, PushPrediction]:
    """Each method's predicted push (``commands.push_time``) for the report's config: its
    engines (``rollout.engines``: the URLs, or the servers started), senders and engines on
    other nodes when the learner spans nodes or an engine's URL is not on loopback, deltas
    (``rollout.sync.delta``) to embedded engines by ``tensor``."""
    rollout, sync = r.cfg.rollout, r.cfg.rollout.sync
    nodes = r.world_size // r.gpus_per_node if r.gpus_per_node else 1
    remote = [url for url in rollout.engines.urls if not _loopback_url(url)]
    return {
        method: predict_push(
            r.cfg.model,
            r.cfg.parallel,
            method=method,
            bucket_mb=sync.bucket_mb,
            delta=sync.delta and method == "tensor" and rollout.engines.type == "embedded",
            engine_type=rollout.engines.type,
            num_engines=num_engines(rollout),
            across_nodes=nodes > 1 or bool(remote),
        )
        for method in ("tensor", "disk", "distributed")
    }


def num_engines(rollout: RolloutConfig) -> int:
    """The engines a push goes to: the URLs attached to, else the servers started."""
    if rollout.engines.type == "sglang" and rollout.engines.urls:
        return len(rollout.engines.urls)
    if rollout.engines.type == "embedded" and not rollout.embedded_process:
        return 1
    return rollout.engines.num_servers


def _loopback_url(url: str) -> bool:
    from urllib.parse import urlparse

    from megatron_grpo.config.rollout import is_loopback

    return is_loopback(urlparse(url).hostname or "")


def _format_push(r: DryRunReport) -> list[str]:
    lines = []
    for method, p in push_predictions(r).items():
        chosen = " (rollout.sync.method)" if method == r.cfg.rollout.sync.method else ""
        delta = " (rollout.sync.delta)" if p.delta else ""
        lines.append(
            f"weight push, {method}{chosen}: {_size(max(p.stage_bytes))}{delta} from the "
            f"largest of {len(p.stage_bytes)} stage(s), {_size(p.engine_bytes)} into each of "
            f"{p.num_engines} engine(s); {max(p.stage_buckets)} bucket(s) of "
            f"{r.cfg.rollout.sync.bucket_mb} MiB; {p.transport.name} over {p.link.name} at "
            f"{p.link.bytes_per_s / 1e9:g} GB/s: predicted {p.seconds:.3g} s"
        )
    return lines


def _routes_row(cfg: Config, dp: int, resident: float) -> list[tuple[str, float, str]]:
    """The routing replay row: the routes of one rollout step's micro-batches (none without)."""
    per_micro_batch, _ = routes_bytes(cfg, dp)
    if not per_micro_batch:
        return []
    m = cfg.model
    what = "engine's" if cfg.rollout.return_routed_experts else ""
    if cfg.train.routing_replay == "r2":
        what = f"{what} and R2's" if what else "R2's"
    note = (
        f"{what} routes, {m.num_layers} layers x top-{m.moe_router_topk} x 2 B a token: "
        f"{_gib(per_micro_batch)} GiB a micro-batch, this rank's step"
    )
    return [("routes", resident, note)]


def _activation_options(cfg: Config) -> str:
    dims, train = cfg.parallel, cfg.train
    sp = "sequence parallel" if dims.uses_sequence_parallel else "no sequence parallelism"
    if train.recompute_granularity is None:
        return f"{sp}, no recomputation"
    if train.recompute_granularity == "selective":
        return f"{sp}, selective recomputation of {', '.join(train.recompute_modules)}"
    return (
        f"{sp}, full recomputation ({train.recompute_method}, "
        f"{train.recompute_num_layers} layer{'s' * (train.recompute_num_layers > 1)})"
    )
