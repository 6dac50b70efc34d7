"""Weight sync from every pipeline stage (``weight_sync.push``) into the embedded server.

A TP2 x PP2 launch (4 gloo processes) of a tiny dense model, and a TP2 x PP2 x EP2 launch
(8, data-parallel 2) of a tiny Qwen3-MoE whose experts are split over EP: the model is
loaded from HF, then for
each sync method its weights are moved (seeded noise, the same on every rank) and pushed
by the trainer's own ``WeightPush`` with 1 MiB buckets, so every stage sends several (and
for ``rollout.sync.delta``, a full push first, then the deltas of the moved weights). The
embedded server's weights must then equal the learner's weights exported through the
full-model gather and the conversion mapping, bitwise, with the pushed weight version and
``rollout.sync.check`` on: first rows for ``tensor``, checksums for the others.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from megatron_grpo.launch import run_workers
from megatron_grpo.testing import perturb_weights, random_hf_model, tiny_hf_config

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(400)]

HERE = Path(__file__)
METHODS = ("tensor", "disk", "distributed", "delta")
CHECKS: dict[str, Any] = {
    "tensor": True,
    "disk": "checksum",
    "distributed": "checksum",
    "delta": "checksum",
}


def _moved(model: list, ctx, cfg, seed: int) -> dict[str, torch.Tensor] | None:
    """New weights loaded on every rank; as HF exports them through the full gather, on rank 0."""
    from megatron_grpo.convert.weights import megatron_to_hf
    from megatron_grpo.mcore.full_state import gather_full_state

    perturb_weights(model, ctx, cfg, seed)
    exported = gather_full_state(model, ctx, vocab_size=cfg.vocab_size)
    return None if exported is None else megatron_to_hf(exported, cfg, cfg.hf_family)


def push_every_method(hf_dir: str, ep: int) -> dict[str, Any] | None:
    from megatron_grpo.commands.convert.hf_to_megatron import resolve_hf_model
    from megatron_grpo.config import ParallelDims, RolloutConfig, WeightSyncConfig
    from megatron_grpo.convert.hf_files import HFCheckpoint, MegatronView
    from megatron_grpo.embedded.weights import hf_model_from_config, hf_weights
    from megatron_grpo.mcore.full_state import load_full_state
    from megatron_grpo.mcore.model import build_model
    from megatron_grpo.mcore.parallel import init_parallel
    from megatron_grpo.rollout.runtime import RolloutRuntime
    from megatron_grpo.weight_sync.push import WeightPush

    ctx = init_parallel(ParallelDims(tp=2, pp=2, ep=ep))
    cfg = resolve_hf_model(hf_dir)
    model = build_model(cfg, ctx, wrap_ddp=False)
    load_full_state(model, MegatronView(HFCheckpoint(hf_dir), cfg), cfg, ctx)
    results: dict[str, Any] = {}
    for step, method in enumerate(METHODS, start=1):
        check = CHECKS[method]
        delta = method == "delta"
        sync = WeightSyncConfig(
            method="tensor" if delta else method,  # type: ignore[arg-type]
            bucket_mb=1,
            check=check,
            delta=delta,
        )
        rollout = RolloutConfig(sync=sync)
        runtime = None
        if ctx.is_main:
            runtime = RolloutRuntime(rollout, hf_model=hf_model_from_config(cfg), model_cfg=cfg)
        push = WeightPush(cfg, rollout, ctx)
        if delta:  # a full push first: the one after it sends deltas
            _moved(model, ctx, cfg, seed=100)
            push(model, "base", runtime)
        expected = _moved(model, ctx, cfg, seed=step)
        push(model, str(step), runtime)
        if delta and push.sender is not None:  # every stage sent deltas, not full tensors
            state = push.sender.delta
            kept = sum(data.size for _, _, data in state.previous.values())
            assert state.version == str(step) and 0 < state.sent_bytes < kept, state.sent_bytes
        push.close()
        if runtime is not None:
            assert expected is not None and runtime.server is not None
            served = hf_weights(runtime.server.engine.model)  # MoE experts: per expert
            results[method] = {
                "version": runtime.server.engine.weight_version,
                "differ": sorted(k for k, v in expected.items() if not torch.equal(served[k], v)),
                "unsent": sorted(set(served) - set(expected) - {"lm_head.weight"}),
            }
            runtime.close()
    return results if ctx.is_main else None


CASES = {
    # name: (HF config, EP, processes)
    "dense TP2xPP2": (
        tiny_hf_config("qwen3", hidden_size=128, intermediate_size=512, num_hidden_layers=4),
        1,
        4,
    ),  # fmt: skip
    "MoE TP2xPP2xEP2": (tiny_hf_config("qwen3_moe", num_hidden_layers=4), 2, 8),
}


@pytest.mark.parametrize("case", list(CASES))
def test_every_stage_streams_its_weights_into_the_embedded_server(tmp_path, case):
    hf_config, ep, nprocs = CASES[case]
    random_hf_model(hf_config).save_pretrained(tmp_path / "hf")
    results = run_workers(
        f"{HERE}:push_every_method",
        nprocs,
        kwargs={"hf_dir": str(tmp_path / "hf"), "ep": ep},
        timeout=360,
    )
    main = results[0]
    for step, method in enumerate(METHODS, start=1):
        assert main[method] == {"version": str(step), "differ": [], "unsent": []}, method
