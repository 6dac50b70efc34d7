"""A weight push from one process that holds the whole model, as the tests make it (the
trainer's pushes come from every pipeline stage: weight_sync/push.py)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping

import torch

from megatron_grpo.mcore import device
from megatron_grpo.rollout.runtime import client_config
from megatron_grpo.weight_sync.check import raise_on_problems
from megatron_grpo.weight_sync.engines import begin_push, finish_push
from megatron_grpo.weight_sync.sender import StageSender


def push_weights(
    runtime,
    named: Mapping[str, torch.Tensor],
    *,
    weight_version: str,
    before_check: Callable[[], None] | None = None,
) -> None:
    """Send HF-named weights to every engine of ``runtime`` through one sender, as a stage's
    push does (begin, send, finish; again when engines were dropped; checked when
    ``rollout.sync.check`` is on, after ``before_check()``)."""
    backend = device.distributed_backend()
    sender = StageSender(functools.partial(client_config, runtime.cfg), 0, backend=backend)
    try:
        while True:
            plan = begin_push(runtime, weight_version)
            report = sender.send(iter([named]), plan)
            if finish_push(runtime, plan, [report]):
                break
        if before_check is not None:
            before_check()
        if plan.check:
            raise_on_problems(plan, sender.check(plan))
    finally:
        sender.close()
