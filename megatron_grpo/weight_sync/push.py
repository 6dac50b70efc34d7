"""Weight sync from the learner's ranks: every pipeline stage streams its own weights.

Collective over the world; only the ranks of data-parallel replica 0 (and, with expert
parallelism, of expert-data-parallel replica 0) do more than bring their parameters up to
date (``mcore.hf_export.takes_part``):
1. the main rank opens the push on the engines (``weight_sync.engines``) and sends every
   rank of replica 0 a ``SyncPlan`` over a gloo group of those ranks (made once, here);
2. each stage streams its layers (``mcore.hf_export``): the TP ranks join in the gathers,
   the stage's sender (TP rank 0) sends buckets (``weight_sync.sender``);
3. the reports go back to the main rank, which closes the push, or drops engines that
   died during it and has every stage push again to the others;
4. with ``rollout.sync.check``, each sender reads back what it sent (``weight_sync.check``).
No rank holds more than its own shard, a decoder layer's full tensors and a few buckets.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from megatron_grpo.config import ModelConfig, RolloutConfig
from megatron_grpo.mcore.hf_export import is_stage_sender, stage_hf_layers, takes_part
from megatron_grpo.mcore.model import sync_params
from megatron_grpo.mcore.parallel import ParallelContext
from megatron_grpo.weight_sync.check import raise_on_problems
from megatron_grpo.weight_sync.engines import begin_push, finish_push
from megatron_grpo.weight_sync.plan import StageReport
from megatron_grpo.weight_sync.sender import StageSender
from megatron_grpo.weight_sync.stream import drain


class WeightPush:
    """Built on every rank (collective: it makes the group of replica 0's ranks)."""

    def __init__(
        self, model_cfg: ModelConfig, rollout_cfg: RolloutConfig, ctx: ParallelContext
    ) -> None:
        from megatron_grpo.mcore import device
        from megatron_grpo.rollout.runtime import client_config

        self.model_cfg, self.ctx = model_cfg, ctx
        self.member = takes_part(ctx)
        self.group: Any = None
        if ctx.world_size > 1:
            members: list[Any] = [None] * ctx.world_size
            dist.all_gather_object(members, self.member)
            ranks = [r for r, m in enumerate(members) if m]
            self.group = dist.new_group(ranks, backend="gloo")
        self.sender: StageSender | None = None
        if is_stage_sender(ctx):
            self.sender = StageSender(
                lambda urls: client_config(rollout_cfg, urls),
                ctx.pp_rank,
                backend=device.distributed_backend(),
            )

    def __call__(self, model: list, weight_version: str, runtime: Any) -> None:
        """Push the policy's weights; ``runtime`` is the main rank's ``RolloutRuntime``."""
        sync_params(model)
        if not self.member:
            return
        while True:
            plan = self._from_main(begin_push, runtime, weight_version)
            layers = stage_hf_layers(model, self.model_cfg, self.ctx)
            if self.sender is not None:
                report = self.sender.send(layers, plan)
            else:
                drain(layers)
                report = StageReport(stage=self.ctx.pp_rank)
            reports = self._gather(report)
            if self._from_main(finish_push, runtime, plan, reports):
                break
        if plan.check:
            problems = self.sender.check(plan) if self.sender is not None else []
            found = self._gather(problems)
            problems = [p for ps in found for p in ps]
            self._from_main(raise_on_problems, plan, problems)

    def _from_main(self, make: Callable[..., Any], *args: Any) -> Any:
        """``make(*args)`` on the main rank, its result on every member; an error there is
        raised on every member (naming it), not left as a wait."""
        box: list[Any] = [None]
        error: BaseException | None = None
        if self.ctx.is_main:
            try:
                box[0] = ("ok", make(*args))
            except BaseException as err:
                error = err
                box[0] = ("error", f"{type(err).__name__}: {err}")
        if self.group is not None:
            dist.broadcast_object_list(box, src=0, group=self.group)
        if error is not None:
            raise error
        kind, value = box[0]
        if kind == "error":
            raise RuntimeError(f"weight sync stopped on the main rank: {value}")
        return value

    def _gather(self, obj: Any) -> list[Any]:
        """``obj`` of every member, on the main rank ([] elsewhere)."""
        if self.group is None:
            return [obj]
        size = dist.get_world_size(self.group)
        out: list[Any] | None = [None] * size if self.ctx.is_main else None
        dist.gather_object(obj, out, dst=0, group=self.group)
        return out or []

    def close(self) -> None:
        """Close this rank's sender (before the main rank's runtime stops the engines)."""
        if self.sender is not None:
            self.sender.close()
