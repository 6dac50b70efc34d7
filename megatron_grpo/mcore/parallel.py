"""Parallel layout: validated once, initialized once, passed explicitly.

``ParallelDims`` is the user-facing layout (tensor, pipeline, context and
data-parallel sizes). ``init_parallel`` starts torch.distributed from
torchrun's environment (gloo on CPU, nccl on GPU), initializes megatron-core's
parallel state and returns a ``ParallelContext`` holding every process group
the rest of the code needs. Nothing below the entry point reaches for
megatron-core's global parallel state.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any, Protocol, cast

import torch
import torch.distributed as dist

from megatron_grpo.config import ParallelDims
from megatron_grpo.mcore import compat, device


class ProcessGroups(Protocol):
    """The groups of megatron-core's ``ProcessGroupCollection`` this package reads (the
    collection sets its attributes at run time, so it is typed here, once)."""

    tp: dist.ProcessGroup
    pp: dist.ProcessGroup
    cp: dist.ProcessGroup
    dp: dist.ProcessGroup
    dp_cp: dist.ProcessGroup
    ep: dist.ProcessGroup
    expt_dp: dist.ProcessGroup


@dataclass(frozen=True)
class ParallelContext:
    """Everything a rank needs to know about the layout, built once by ``init_parallel``."""

    dims: ParallelDims
    world_size: int
    rank: int
    dp_size: int
    dp_rank: int
    tp_rank: int
    pp_rank: int
    cp_rank: int
    pg: ProcessGroups
    """megatron-core's ``ProcessGroupCollection`` (tp, pp, cp, dp, dp_cp, mp, embd, ep,
    expt_tp, expt_dp, ...), handed to its builders as ``pg_collection``."""
    ep_rank: int = 0
    """This rank's place in the expert-parallel group: it holds experts
    ``[ep_rank * E / ep, (ep_rank + 1) * E / ep)`` of every MoE layer."""

    @property
    def tp_group(self) -> dist.ProcessGroup:
        return self.pg.tp

    @property
    def pp_group(self) -> dist.ProcessGroup:
        return self.pg.pp

    @property
    def cp_group(self) -> dist.ProcessGroup:
        """The ranks that split each sequence between them (context parallelism)."""
        return self.pg.cp

    @property
    def dp_group(self) -> dist.ProcessGroup:
        return self.pg.dp

    @property
    def dp_cp_group(self) -> dist.ProcessGroup:
        """The group that holds distinct data: where loss denominators are all-reduced."""
        return self.pg.dp_cp

    @property
    def ep_group(self) -> dist.ProcessGroup:
        """The ranks that split one MoE layer's experts between them (all-to-all)."""
        return self.pg.ep

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.dims.pp - 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_parallel(
    dims: ParallelDims, *, seed: int = 1234, timeout_minutes: float = 10
) -> ParallelContext:
    """Start torch.distributed from torchrun's environment and megatron-core's groups."""
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.process_groups_config import ProcessGroupCollection

    compat.install()  # the release check; on CPU, the device layer
    if not dist.is_initialized():
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        dims.data_parallel_size(world_size)  # fail before any collective
        if device.cuda_available():
            # One rank per GPU; with more ranks than GPUs NCCL itself refuses a shared device
            # at its first collective ("Duplicate GPU detected") where its version does.
            local_rank = int(os.environ.get("LOCAL_RANK", "0"))
            torch.cuda.set_device(local_rank % torch.cuda.device_count())
        dist.init_process_group(
            backend=device.distributed_backend(),
            init_method="env://" if "MASTER_ADDR" in os.environ else _single_process_init(),
            world_size=world_size,
            rank=int(os.environ.get("RANK", "0")),
            timeout=datetime.timedelta(minutes=timeout_minutes),
        )
    world_size = dist.get_world_size()
    dp_size = dims.data_parallel_size(world_size)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=dims.tp,
        pipeline_model_parallel_size=dims.pp,
        virtual_pipeline_model_parallel_size=dims.vpp,
        context_parallel_size=dims.cp,
        expert_model_parallel_size=dims.ep,
        expert_tensor_parallel_size=1,  # whole experts on each rank (ParallelDims)
        distributed_timeout_minutes=timeout_minutes,
    )
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    pg = cast(ProcessGroups, ProcessGroupCollection.use_mpu_process_groups())
    return ParallelContext(
        dims=dims,
        world_size=world_size,
        rank=dist.get_rank(),
        dp_size=dp_size,
        dp_rank=dist.get_rank(pg.dp),
        tp_rank=dist.get_rank(pg.tp),
        pp_rank=dist.get_rank(pg.pp),
        cp_rank=dist.get_rank(pg.cp),
        pg=pg,
        ep_rank=dist.get_rank(pg.ep),
    )


def _single_process_init() -> str:
    """A file-store rendezvous for running one process without torchrun."""
    import tempfile

    return "file://" + os.path.join(tempfile.mkdtemp(prefix="megatron_grpo_"), "rendezvous")


def broadcast_object(obj: Any, ctx: ParallelContext) -> Any:
    """``obj`` from global rank 0 on every rank."""
    if ctx.world_size == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def destroy_parallel() -> None:
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
