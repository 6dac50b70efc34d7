"""``rollout.sync.check``: an engine that loads a push wrongly is named, with the weight."""

from __future__ import annotations

import pytest
import torch
from engine_push import push_weights

from megatron_grpo.config import RolloutConfig, WeightSyncConfig
from megatron_grpo.config.hf import model_config_from_hf
from megatron_grpo.embedded import server as embedded_server
from megatron_grpo.embedded.weights import copy_into_model
from megatron_grpo.rollout.runtime import RolloutRuntime
from megatron_grpo.testing import random_hf_model, tiny_hf_config
from megatron_grpo.weight_sync.check import compare_sample


def test_compare_sample_allows_bf16_rounding_and_names_real_differences():
    ours = torch.tensor([[1.0, -2.0, 3.0], [0.5, 0.25, 4.0]])
    assert compare_sample("w", ours, ours.to(torch.bfloat16).float()) is None
    assert compare_sample("w", ours, ours[:, :2]) is None  # a TP engine's own columns
    moved = ours.clone()
    moved[1, 2] = 4.5
    assert compare_sample("w", ours, moved) == "w: differs by up to 0.5 (largest value 4)"
    assert "shape (1, 3)" in (compare_sample("w", ours, ours[:1]) or "")


@pytest.mark.parametrize("method", ["tensor", "disk"])
def test_a_weight_the_engine_drops_is_named(monkeypatch, method):
    hf_config = tiny_hf_config("qwen2")
    model_cfg = model_config_from_hf(hf_config)
    served = random_hf_model(hf_config, seed=0)
    pushed = {k: v + 1.0 for k, v in random_hf_model(hf_config, seed=1).state_dict().items()}

    def loses_the_final_norm(model, named_tensors, *, require_all):
        kept = {k: v for k, v in named_tensors.items() if k != "model.norm.weight"}
        copy_into_model(model, kept, require_all=False)

    cfg = RolloutConfig(sync=WeightSyncConfig(method=method, check=True))  # type: ignore[arg-type]
    runtime = RolloutRuntime(cfg, hf_model=served, model_cfg=model_cfg)
    try:
        push_weights(runtime, pushed, weight_version="1")  # a faithful engine passes
        monkeypatch.setattr(embedded_server, "copy_into_model", loses_the_final_norm)
        pushed = {k: v + 1.0 for k, v in pushed.items()}
        with pytest.raises(RuntimeError, match=r"(?s)version 2.*: model\.norm\.weight: differs"):
            push_weights(runtime, pushed, weight_version="2")
    finally:
        runtime.close()
