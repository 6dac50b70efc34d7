"""Qwen3-MoE names and layout, HF <-> megatron: experts, router, expert-parallel names."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from megatron_grpo.config.hf import check_family, check_hf_config, get_family, model_config_from_hf
from megatron_grpo.convert.experts import (
    global_expert_name,
    split_stacked_experts,
    unstack_expert_axes,
)
from megatron_grpo.convert.hf_config import hf_config_from_model_config
from megatron_grpo.convert.sharding import shard_for_rank
from megatron_grpo.convert.weights import hf_to_megatron, megatron_layer_keys, megatron_to_hf
from megatron_grpo.testing import random_hf_model, tiny_hf_config


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny random Qwen3-MoE as saved (one tensor per expert projection) and its config."""
    from safetensors.torch import load_file

    hf_config = tiny_hf_config("qwen3_moe")
    path = tmp_path_factory.mktemp("qwen3_moe")
    random_hf_model(hf_config).save_pretrained(path)
    return load_file(path / "model.safetensors"), model_config_from_hf(hf_config)


def test_model_config_reads_the_experts(saved):
    _, cfg = saved
    assert (cfg.num_experts, cfg.moe_router_topk, cfg.moe_ffn_hidden_size) == (4, 2, 32)
    assert cfg.qk_layernorm and cfg.hf_family == "qwen3_moe" and cfg.moe_norm_topk_prob
    assert cfg.moe_aux_loss_coeff == 0.0  # a training choice, not the checkpoint's


def test_round_trip_is_bitwise_and_names_experts(saved):
    state, cfg = saved
    mcore = hf_to_megatron(state, cfg)
    fc1 = mcore["decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight"]
    gate, up = (state[f"model.layers.1.mlp.experts.3.{p}_proj.weight"] for p in ("gate", "up"))
    assert torch.equal(fc1, torch.cat([gate, up]))
    assert torch.equal(
        mcore["decoder.layers.0.mlp.router.weight"], state["model.layers.0.mlp.gate.weight"]
    )
    assert set(megatron_layer_keys(0, cfg)) == {
        k for k in mcore if k.startswith("decoder.layers.0.")
    }
    back = megatron_to_hf(mcore, cfg, "qwen3_moe")
    assert back.keys() == state.keys()
    assert all(torch.equal(back[k], state[k]) for k in state)


def test_experts_and_router_are_whole_on_every_tp_rank(saved):
    state, cfg = saved
    mcore = hf_to_megatron(state, cfg)
    for name in (
        "decoder.layers.0.mlp.router.weight",
        "decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight",
    ):
        assert torch.equal(shard_for_rank(name, mcore[name], 1, 2, cfg), mcore[name])


def test_expert_parallel_names_use_the_global_index():
    name = "decoder.layers.5.mlp.experts.local_experts.1.linear_fc1.weight"
    # EP rank 2 of 4 with 8 experts holds experts 4 and 5
    assert (
        global_expert_name(name, 2, 2)
        == "decoder.layers.5.mlp.experts.local_experts.5.linear_fc1.weight"
    )
    assert global_expert_name("decoder.layers.5.mlp.router.weight", 2, 2).endswith("router.weight")
    stacked = torch.arange(2 * 3 * 2).reshape(2, 3, 2)  # [layers, experts, ...]
    out = unstack_expert_axes("decoder.layers.mlp.experts.experts.linear_fc2.weight", stacked)
    assert out["decoder.layers.1.mlp.experts.local_experts.2.linear_fc2.weight"].tolist() == [
        10,
        11,
    ]
    assert len(out) == 6
    layer = {"decoder.layers.4.mlp.experts.experts.linear_fc1.weight": stacked[1]}
    split = split_stacked_experts(layer | {"decoder.layers.4.mlp.router.weight": stacked[0]})
    assert split["decoder.layers.4.mlp.experts.local_experts.0.linear_fc1.weight"].tolist() == [
        6,
        7,
    ]
    assert "decoder.layers.4.mlp.router.weight" in split and len(split) == 4


def test_export_config_round_trips_and_mismatches_are_named(saved):
    _, cfg = saved
    hf_config = hf_config_from_model_config(cfg, "qwen3_moe")
    assert hf_config.architectures == ["Qwen3MoeForCausalLM"]
    assert model_config_from_hf(hf_config) == cfg
    wrong = dataclasses.replace(cfg, moe_router_topk=1)
    with pytest.raises(
        ValueError, match=re.escape("num_experts_per_tok=2 but model.moe_router_topk=1")
    ):
        check_hf_config(hf_config, wrong)
    with pytest.raises(ValueError, match="does not fit Qwen3ForCausalLM, which is dense"):
        check_family(cfg, get_family("qwen3"))


def test_unsupported_moe_layouts_are_refused_by_name():
    for overrides in ({"decoder_sparse_step": 2}, {"mlp_only_layers": [0]}):
        with pytest.raises(ValueError, match="every layer must be a mixture of experts"):
            model_config_from_hf(tiny_hf_config("qwen3_moe", **overrides))
