"""A weight push from one process that holds the whole model, as the tests make it (the
trainer's pushes come from every pipeline stage: train/weight_push.py)."""

from __future__ import annotations

from collections.abc import Mapping

import torch


def push_weights(runtime, named: Mapping[str, torch.Tensor], *, weight_version: str) -> None:
    """Send HF-named weights to every engine of ``runtime`` through its one sender, as a
    stage's push does (begin, send, finish; again when engines were dropped; checked when
    ``rollout.sync.check`` is on)."""
    while True:
        plan = runtime.begin_push(weight_version)
        report = runtime.sender.send(iter([named]), plan)
        if runtime.finish_push(plan, [report]):
            break
    if plan.check:
        runtime.check_push(plan, runtime.sender.check(plan))
