"""Colocated placement (``rollout.placement: colocated``): memory per GPU of both phases, the
engines' TP, and the host memory that the learner's offload takes, by arithmetic alone.

The engines and the learner take turns on the same GPUs, so each GPU must hold, in bytes:

- the training phase: the learner's peak (``memory_model.stage_memory``, the peak stage) and
  what an asleep engine keeps (``ENGINE_RUNTIME_GIB``);
- the rollout phase: the engine's static pool, ``mem_fraction_static`` x the GPU's memory
  (its weight shard and KV cache), its runtime outside that pool (``ENGINE_RUNTIME_GIB``),
  and what the learner keeps resident with ``rollout.colocate.offload``: its weights unless
  ``params`` is offloaded, its fp32 gradients unless ``grads``, its optimizer states unless
  ``optimizer``, the reference model (never offloaded), and ``RESERVED_GIB`` for its CUDA
  context, NCCL buffers and allocator.

Host memory per node: what one rank offloads (the largest stage's) x the node's ranks, plus
``rollout.colocate.host_memory_headroom_gib``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from megatron_grpo.commands.memory_model import GIB, RESERVED_GIB, StageMemory
from megatron_grpo.rollout.engines import check_engine_tp, default_engine_tp, engine_weight_bytes

ENGINE_RUNTIME_GIB = 2.0
"""What one SGLang engine process keeps on its GPU outside its static pool, awake and asleep:
its CUDA context, NCCL buffers, CUDA graphs and their static input buffers. SGLang's
``/release_memory_occupation`` releases the weights and the KV cache (torch_memory_saver
regions); what stays was 1.1 GB for a 1B model once weights, KV cache and req_to_token were
released (sgl-project/sglang#2542); the CUDA graphs' pool stays unless
``SGLANG_MEMORY_SAVER_CUDA_GRAPH`` is set (sgl-project/sglang#7873: 1-3 GiB on a moderate model,
as lightseekorg/tokenspeed#274 measures), and their static buffers stay even then
(sgl-project/sglang#30474)."""


# --------------------------------------------------------------------------- engine TP


# --------------------------------------------------------------------------- the learner


def learner_parts(stage: StageMemory) -> dict[str, float]:
    """The learner's states on one GPU, by the name ``rollout.colocate.offload`` gives them."""
    return {"params": stage.weights, "grads": stage.gradients, "optimizer": stage.optimizer}


def learner_resident(stage: StageMemory, offload: Sequence[str]) -> dict[str, float]:
    """What the learner keeps on one GPU while the engines generate: its states not offloaded,
    the reference model, and ``RESERVED_GIB`` (CUDA context, NCCL, allocator)."""
    kept = {k: v for k, v in learner_parts(stage).items() if k not in offload}
    if stage.reference:
        kept["reference"] = stage.reference
    kept["reserved"] = RESERVED_GIB * GIB
    return kept


def offloaded_bytes(stage: StageMemory, offload: Sequence[str]) -> float:
    """Host memory one rank takes while the engines generate: its offloaded states."""
    return sum(v for k, v in learner_parts(stage).items() if k in offload)


# --------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class ColocatedMemory:
    """Both phases on one GPU and the offload's host memory on one node, in bytes."""

    gpu_memory: float
    host_memory: float
    host_headroom: float
    mem_fraction_static: float
    offload: tuple[str, ...]
    engine_tp: int
    engine_tp_chosen: bool
    """True when ``engine_tp`` is the default rule's choice (the config's is None)."""
    engines_per_node: int
    ranks_per_node: int
    engine_weights: float
    """One engine GPU's weight shard."""
    learner_peak: float
    """The learner's training peak (the peak stage's total)."""
    resident: dict[str, float]
    """What the learner keeps during the rollout phase (the largest over stages)."""
    offloaded_per_rank: float

    @property
    def engine_pool(self) -> float:
        return self.mem_fraction_static * self.gpu_memory

    @property
    def engine_runtime(self) -> float:
        return ENGINE_RUNTIME_GIB * GIB

    @property
    def training_phase(self) -> float:
        return self.learner_peak + self.engine_runtime

    @property
    def rollout_phase(self) -> float:
        return self.engine_pool + self.engine_runtime + sum(self.resident.values())

    @property
    def host_need(self) -> float:
        return self.offloaded_per_rank * self.ranks_per_node + self.host_headroom

    @property
    def fits(self) -> bool:
        return not self.shortfalls()

    def shortfalls(self) -> list[str]:
        """What does not fit, each with by how much and what to change; empty when all do."""
        out = []
        if self.training_phase > self.gpu_memory:
            out.append(self._training_shortfall())
        if self.rollout_phase > self.gpu_memory:
            out.append(self._rollout_shortfall())
        if self.host_need > self.host_memory:
            out.append(self._host_shortfall())
        return out

    def _training_shortfall(self) -> str:
        over = self.training_phase - self.gpu_memory
        return (
            f"the training phase does not fit: {_gib(self.training_phase)} GiB per GPU (the "
            f"learner's peak {_gib(self.learner_peak)} + the asleep engine's "
            f"{_gib(self.engine_runtime)}), {_gib(over)} GiB above the GPU's "
            f"{_gib(self.gpu_memory)}. Shrink the learner's peak by {_gib(over)} GiB (raise "
            "parallel.tp or parallel.pp, lower train.max_tokens_per_micro_batch), or place "
            "the engines on GPUs of their own (rollout.placement: disaggregated)"
        )

    def _rollout_shortfall(self) -> str:
        over = self.rollout_phase - self.gpu_memory
        room = self.gpu_memory - self.engine_runtime - sum(self.resident.values())
        fixes = [
            f"lower rollout.colocate.mem_fraction_static (now {self.mem_fraction_static:g}; "
            f"at most {max(room, 0) / self.gpu_memory:.2f} fits beside the learner)"
        ]
        movable = [k for k in ("optimizer", "grads", "params") if k in self.resident]
        if movable:
            freed = sum(self.resident[k] for k in movable)
            fixes.append(
                f"add {', '.join(movable)} to rollout.colocate.offload ({_gib(freed)} GiB per GPU)"
            )
        kept = ", ".join(f"{k} {_gib(v)}" for k, v in self.resident.items())
        return (
            f"the rollout phase does not fit: {_gib(self.rollout_phase)} GiB per GPU (the "
            f"engine's static pool {_gib(self.engine_pool)} + its runtime "
            f"{_gib(self.engine_runtime)} + the learner's resident {kept}), {_gib(over)} GiB "
            f"above the GPU's {_gib(self.gpu_memory)}. To fit: " + "; or ".join(fixes)
        )

    def _host_shortfall(self) -> str:
        over = self.host_need - self.host_memory
        return (
            f"the offload does not fit in host memory: {_gib(self.host_need)} GiB per node "
            f"({_gib(self.offloaded_per_rank)} GiB of {', '.join(self.offload)} per rank x "
            f"{self.ranks_per_node} ranks + rollout.colocate.host_memory_headroom_gib "
            f"{_gib(self.host_headroom)}), {_gib(over)} GiB above --host-memory-gib "
            f"{_gib(self.host_memory)}. Offload less (rollout.colocate.offload, if the rollout "
            "phase still fits), shard the optimizer (optim.use_distributed_optimizer=true), "
            "or pass --host-memory-gib if the nodes have more"
        )

    def format(self) -> list[str]:
        how = "the smallest whose weight shard takes at most half the pool" * self.engine_tp_chosen
        kept = " + ".join(f"{k} {_gib(v)}" for k, v in self.resident.items())
        offload = ", ".join(self.offload) or "nothing"
        kv = self.engine_pool - self.engine_weights
        return [
            f"colocated: {self.engines_per_node} engine{'s' * (self.engines_per_node > 1)} per "
            f"node x engine TP {self.engine_tp}"
            + (f" ({how})" if how else "")
            + f"; offloaded while the engines generate: {offload}",
            f"  training phase per GPU, GiB {_gib(self.training_phase):>7} = learner's peak "
            f"{_gib(self.learner_peak)} + asleep engine {_gib(self.engine_runtime)} (CUDA "
            "context, NCCL, CUDA graphs; weights and KV cache released)",
            f"  rollout phase per GPU, GiB  {_gib(self.rollout_phase):>7} = engine's static "
            f"pool {_gib(self.engine_pool)} (mem_fraction_static {self.mem_fraction_static:g}: "
            f"weights {_gib(self.engine_weights)} + KV cache {_gib(kv)}) + engine runtime "
            f"{_gib(self.engine_runtime)} + learner resident {kept}",
            f"  host memory per node, GiB   {_gib(self.host_need):>7} = "
            f"{_gib(self.offloaded_per_rank)} offloaded per rank x {self.ranks_per_node} ranks "
            f"+ {_gib(self.host_headroom)} headroom, of {_gib(self.host_memory)}",
        ]

    def verdict_detail(self) -> str:
        return (
            f"training {_gib(self.training_phase)}, rollout {_gib(self.rollout_phase)} of "
            f"{_gib(self.gpu_memory)} GiB per GPU; host {_gib(self.host_need)} of "
            f"{_gib(self.host_memory)} GiB per node"
        )


def colocated_memory(
    *,
    offload: Sequence[str],
    mem_fraction_static: float,
    engine_tp: int | None,
    host_headroom_gib: float,
    num_params: int,
    stages: Sequence[StageMemory],
    gpus_per_node: int,
    gpu_memory_gib: float,
    host_memory_gib: float,
) -> ColocatedMemory:
    """Both phases of ``stages``' learner beside engines of a model of ``num_params``
    parameters, on nodes of ``gpus_per_node`` GPUs of ``gpu_memory_gib`` and
    ``host_memory_gib`` of host memory. ValueError when no engine fits a node."""
    gpu, pool = gpu_memory_gib * GIB, mem_fraction_static * gpu_memory_gib * GIB
    weights = engine_weight_bytes(num_params)
    if engine_tp is None:
        tp = default_engine_tp(weights, gpus_per_node, pool)
    else:
        check_engine_tp(engine_tp, weights, gpus_per_node, pool)
        tp = engine_tp
    residents = [learner_resident(s, offload) for s in stages]
    return ColocatedMemory(
        gpu_memory=gpu,
        host_memory=host_memory_gib * GIB,
        host_headroom=host_headroom_gib * GIB,
        mem_fraction_static=mem_fraction_static,
        offload=tuple(offload),
        engine_tp=tp,
        engine_tp_chosen=engine_tp is None,
        engines_per_node=gpus_per_node // tp,
        ranks_per_node=gpus_per_node,
        engine_weights=weights / tp,
        learner_peak=max(s.total for s in stages),
        resident=max(residents, key=lambda r: sum(r.values())),
        offloaded_per_rank=max(offloaded_bytes(s, offload) for s in stages),
    )


def _gib(num_bytes: float) -> str:
    return f"{num_bytes / GIB:.1f}"
