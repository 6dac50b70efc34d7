"""Bodies run on several gloo processes by tests/distributed/test_offload.py."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from megatron_grpo.commands.invariance.cases import (
    MAX_COMPLETION,
    default_loss,
    default_model,
    fixed_batch,
)
from megatron_grpo.config import OptimConfig, ParallelDims
from megatron_grpo.mcore.hf_export import stage_hf_layers
from megatron_grpo.mcore.model import build_model, sync_params
from megatron_grpo.mcore.offload import LearnerOffload, ParamsOffloaded
from megatron_grpo.mcore.optim import build_optimizer
from megatron_grpo.mcore.parallel import init_parallel
from megatron_grpo.train.step import StepSettings, train_on_rollout


def _learner(model_cfg, optim_cfg, ctx, init: list[torch.Tensor] | None):
    model = build_model(model_cfg, ctx, optim=optim_cfg)
    if init is not None:
        with torch.no_grad():
            for p, value in zip(_params(model), init):
                p.copy_(value)
    optimizer, scheduler = build_optimizer(optim_cfg, model_cfg, model, ctx)
    return model, optimizer, scheduler


def _params(model: list) -> list[torch.Tensor]:
    return [p for chunk in model for p in chunk.parameters()]


def _optimizer_state(optimizer) -> list[torch.Tensor]:
    from megatron_grpo.mcore.compat import inner_optimizers

    out = []
    for inner in inner_optimizers(optimizer):
        for group in inner.optimizer.param_groups:
            for master in group["params"]:
                out.append(master)
                out += [v for v in inner.optimizer.state[master].values() if v.numel() > 1]
    return out


def _bytes_on_device(tensors) -> int:
    return sum(t.untyped_storage().nbytes() for t in tensors)


def _refused(call) -> str | None:
    try:
        call()
    except ParamsOffloaded as err:
        return str(err)
    return None


def offload_between_steps(*, tp: int, pp: int, distributed: bool, steps: int) -> dict[str, Any]:
    """The same rollout batch trained ``steps`` times by two learners with the same weights:
    one stays on the device, the other goes through the colocated step's offloads between
    its steps. What each offload freed, and whether the two learners stay bitwise equal."""
    ctx = init_parallel(ParallelDims(tp=tp, pp=pp))
    model_cfg = default_model()
    optim_cfg = OptimConfig(lr=1e-2, clip_grad=1.0, use_distributed_optimizer=distributed)
    samples = fixed_batch(model_cfg.vocab_size)
    settings = StepSettings(
        global_batch_size=len(samples),
        num_iterations=1,
        max_tokens_per_micro_batch=64,
        pack=False,
        vocab_size=model_cfg.vocab_size,
        max_len=MAX_COMPLETION,
    )
    loss_cfg = dataclasses.replace(default_loss("token-mean"), kl_coef=0.0)

    plain = _learner(model_cfg, optim_cfg, ctx, None)
    moved = _learner(model_cfg, optim_cfg, ctx, [p.detach().clone() for p in _params(plain[0])])
    offload = LearnerOffload(moved[0], moved[1], ["optimizer", "grads", "params"])
    predicted = offload.host_bytes()

    record: dict[str, Any] = {"mismatch": [], "predicted_host_bytes": predicted}
    for step in range(steps):
        metrics = []
        for model, optimizer, scheduler in (plain, moved):
            metrics += train_on_rollout(
                model, optimizer, scheduler, ctx, samples, loss_cfg, settings
            )
            sync_params(model)
        if metrics[0] != metrics[1]:
            record["mismatch"].append(f"step {step}: metrics {metrics}")

        params = _params(moved[0])
        in_params = {p.untyped_storage().data_ptr() for p in params}
        state = [  # the fp32 distributed optimizer's master shards view the parameter buffer
            t for t in _optimizer_state(moved[1]) if t.untyped_storage().data_ptr() not in in_params
        ]
        assert state, "the optimizer has tensors of its own"
        grads = [b.grad_data for chunk in moved[0] for b in chunk.buffers]
        offload.offload(["optimizer", "grads"])
        after_first = {
            "optimizer": _bytes_on_device(state),
            "grads": _bytes_on_device(grads),
            "params": _bytes_on_device(params),
        }
        exported = sum(1 for _ in stage_hf_layers(moved[0], model_cfg, ctx))  # reads params
        offload.offload(["params"])
        record.setdefault("freed", []).append(
            {
                "after_optimizer_and_grads": after_first,
                "params_after_params": _bytes_on_device(params),
                "offloaded": offload.offloaded,
                "exported_units": exported,
                "export_refused": _refused(lambda: list(stage_hf_layers(moved[0], model_cfg, ctx))),
                "forward_refused": _refused(lambda: moved[0][0](None, None, None)),
            }
        )
        record["host_copy_bytes"] = _host_copy_bytes(offload)
        offload.reload()
        record.setdefault("host_copy_bytes_after_reload", []).append(_host_copy_bytes(offload))

        for name, a, b in (
            ("params", _params(plain[0]), _params(moved[0])),
            ("optimizer", _optimizer_state(plain[1]), _optimizer_state(moved[1])),
        ):
            if len(a) != len(b) or not all(torch.equal(x, y) for x, y in zip(a, b)):
                record["mismatch"].append(f"step {step}: {name}")
    return record


def _host_copy_bytes(offload) -> int:
    return sum(h.numel() for part in offload._host.values() for h in part)
