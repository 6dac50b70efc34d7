"""Weight sync from every pipeline stage (``train.weight_push``) into the embedded server.

One TP2 x PP2 launch (4 gloo processes): a tiny random model is loaded from HF, then for
each sync method its weights are moved (seeded noise, the same on every rank) and pushed
by the trainer's own ``WeightPush`` with 1 MiB buckets, so every stage sends several. The
embedded server's weights must then equal the learner's weights exported through the
full-model gather and the conversion mapping, bitwise, with the pushed weight version and
``rollout.check_weight_sync`` on.
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
METHODS = ("tensor", "disk", "distributed")


def _moved(model: list, ctx, cfg, seed: int) -> dict[str, torch.Tensor] | None:
    """New weights loaded on every rank; as HF exports them through the full gather, on rank 0."""
    from megatron_grpo.convert.weights import megatron_to_hf
    from megatron_grpo.mcore.full_state import gather_full_state

    perturb_weights(model, ctx, cfg, seed)
    exported = gather_full_state(model, ctx, vocab_size=cfg.vocab_size)
    return None if exported is None else megatron_to_hf(exported, cfg, cfg.hf_family)


def push_every_method(hf_dir: str) -> dict[str, Any] | None:
    from megatron_grpo.commands.convert.hf_to_megatron import resolve_hf_model
    from megatron_grpo.config import ParallelDims, RolloutConfig
    from megatron_grpo.convert.hf_files import HFCheckpoint, MegatronView
    from megatron_grpo.mcore.full_state import load_full_state
    from megatron_grpo.mcore.model import build_model
    from megatron_grpo.mcore.parallel import init_parallel
    from megatron_grpo.rollout.embedded.weights import hf_model_from_config
    from megatron_grpo.rollout.runtime import RolloutRuntime
    from megatron_grpo.train.weight_push import WeightPush

    ctx = init_parallel(ParallelDims(tp=2, pp=2))
    cfg = resolve_hf_model(hf_dir)
    model = build_model(cfg, ctx, wrap_ddp=False)
    load_full_state(model, MegatronView(HFCheckpoint(hf_dir), cfg), cfg, ctx)
    results: dict[str, Any] = {}
    for step, method in enumerate(METHODS, start=1):
        rollout = RolloutConfig(sync_method=method, sync_bucket_mb=1, check_weight_sync=True)  # type: ignore[arg-type]
        runtime = None
        if ctx.is_main:
            runtime = RolloutRuntime(rollout, hf_model=hf_model_from_config(cfg), model_cfg=cfg)
        push = WeightPush(cfg, rollout, ctx, main_sender=runtime.sender if runtime else None)
        expected = _moved(model, ctx, cfg, seed=step)
        push(model, str(step), runtime)
        push.close()
        if runtime is not None:
            assert expected is not None and runtime.server is not None
            served = runtime.server.engine.model.state_dict()
            results[method] = {
                "version": runtime.server.engine.weight_version,
                "differ": sorted(k for k, v in expected.items() if not torch.equal(served[k], v)),
                "unsent": sorted(set(served) - set(expected) - {"lm_head.weight"}),
            }
            runtime.close()
    return results if ctx.is_main else None


def test_every_stage_streams_its_weights_into_the_embedded_server(tmp_path):
    hf = random_hf_model(tiny_hf_config("qwen3", hidden_size=128, intermediate_size=512,
                                        num_hidden_layers=4))  # fmt: skip
    hf.save_pretrained(tmp_path / "hf")
    results = run_workers(
        f"{HERE}:push_every_method", 4, kwargs={"hf_dir": str(tmp_path / "hf")}, timeout=360
    )
    main = results[0]
    for step, method in enumerate(METHODS, start=1):
        assert main[method] == {"version": str(step), "differ": [], "unsent": []}, method
