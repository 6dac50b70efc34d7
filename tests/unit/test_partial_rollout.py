"""Partial rollouts: a weight update while samples generate aborts them and resumes them from
their tokens so far, so each token's log-prob is exactly its recorded version's."""

from __future__ import annotations

import copy
import threading
import time

import numpy as np
import pytest
import torch
from engine_push import push_weights

from megatron_grpo.config import RolloutConfig
from megatron_grpo.config.hf import model_config_from_hf
from megatron_grpo.convert.experts import split_hf_experts
from megatron_grpo.rollout.runtime import RolloutRuntime
from megatron_grpo.testing import random_hf_model, tiny_hf_config


def logprobs_under(model, tokens: list[int], start: int) -> torch.Tensor:
    """log p(tokens[t] | tokens[:t]) for t >= start, the whole prefix run by ``model``."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tokens])).logits[0].double()
    logp = torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0]
    return logp[start - 1 :]


PROMPTS = [[3, 4, 5], [6, 7], [8, 9, 10, 11], [12]]


def two_versions(family: str, **config):
    """A random tiny model of ``family`` (version 0) and a perturbed copy (version 1)."""
    old = random_hf_model(tiny_hf_config(family, **config), seed=0)
    new = copy.deepcopy(old)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return old, new


def generate_across_an_update(runtime, cfg, new_state: dict) -> list:
    """Every sample of ``PROMPTS``' groups, with ``new_state`` pushed as version 1 once the
    engine has made 5 decode steps; the runtime is closed after."""
    result: dict = {}

    def rollout() -> None:
        result["groups"] = runtime.generate_groups(PROMPTS, cfg, seed=7, stop_token_ids=[])

    try:
        producer = threading.Thread(target=rollout)
        producer.start()
        engine = runtime.server.engine
        deadline = time.monotonic() + 30
        while engine.stats.steps < 5 and time.monotonic() < deadline:
            time.sleep(0.001)
        push_weights(runtime, new_state, weight_version="1")
        producer.join(timeout=120)
        assert not producer.is_alive()
    finally:
        runtime.close()
    return [s for group in result["groups"] for s in group]


def test_a_weight_update_mid_generation_resumes_samples_at_the_new_version():
    old, new = two_versions("qwen2")
    cfg = RolloutConfig(prompts_per_step=4, samples_per_prompt=2, max_new_tokens=60)
    runtime = RolloutRuntime(
        cfg, hf_model=old, weight_version="0", model_cfg=model_config_from_hf(old.config)
    )
    samples = generate_across_an_update(runtime, cfg, new.state_dict())
    split = [s for s in samples if [v for v, _ in s.version_spans] == ["0", "1"]]
    assert split, [s.version_spans for s in samples]  # the update came mid-sequence
    assert all(s.weight_version == "1" for s in split)
    worst = 0.0
    for s in samples:
        tokens = list(s.prompt_ids) + list(s.output_ids)
        assert sum(n for _, n in s.version_spans) == len(s.output_ids)
        done = 0  # output tokens checked so far
        for version, n in s.version_spans:
            model = {"0": old, "1": new}[version]
            expected = logprobs_under(model, tokens, len(s.prompt_ids) + done)[:n]
            got = torch.tensor(s.rollout_logprobs[done : done + n]).double()
            worst = max(worst, float((expected - got).abs().max()))
            done += n
    assert worst <= 1e-5, worst


def routes_under(model, tokens: list[int]) -> list[list[set[int]]]:
    """Each position's top-k expert set in each layer, one plain forward of ``model``."""
    chosen: list[torch.Tensor] = []
    hooks = [
        layer.mlp.gate.register_forward_hook(lambda m, a, out: chosen.append(out[2]))
        for layer in model.model.layers
    ]
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([tokens]))
    finally:
        for h in hooks:
            h.remove()
    return [[set(layer[t].tolist()) for layer in chosen] for t in range(len(tokens))]


def test_a_resumed_sample_has_the_new_versions_routes_at_every_position():
    """R3 across a weight update: a sample cut mid-generation is resent as prompt + its
    tokens so far; its routes are those of its last segment's request, the new weights'
    over every position (prompt, both segments' tokens, all but the last token)."""
    old, new = two_versions("qwen3_moe", max_position_embeddings=256)
    cfg = RolloutConfig(
        prompts_per_step=4, samples_per_prompt=2, max_new_tokens=40, return_routed_experts=True
    )
    model_cfg = model_config_from_hf(old.config)
    runtime = RolloutRuntime(
        cfg,
        hf_model=old,
        weight_version="0",
        model_cfg=model_cfg,
        routed_layers=model_cfg.num_layers,
    )
    # the checkpoint's names: one tensor per expert
    samples = generate_across_an_update(runtime, cfg, split_hf_experts(new.state_dict()))
    assert any(len(s.version_spans) > 1 for s in samples), [s.version_spans for s in samples]
    differ = 0
    for s in samples:
        tokens = list(s.prompt_ids) + list(s.output_ids)
        assert s.routed_experts.shape[:2] == (len(tokens) - 1, model_cfg.num_layers)
        model = {"0": old, "1": new}[s.version_spans[-1][0]]
        want = routes_under(model, tokens[:-1])
        got = [[set(layer.tolist()) for layer in position] for position in s.routed_experts]
        assert got == want
        differ += got != routes_under({"0": new, "1": old}[s.version_spans[-1][0]], tokens[:-1])
    assert differ  # the two versions route differently: the check tells them apart


def test_engines_that_route_for_another_model_are_refused_before_the_first_rollout():
    """``check_routes``: one probe token's routes against the policy's config."""
    import dataclasses

    from megatron_grpo.rollout.runtime import check_engine_routes

    model, _ = two_versions("qwen3_moe")
    model_cfg = model_config_from_hf(model.config)
    cfg = RolloutConfig(prompts_per_step=1, samples_per_prompt=1, return_routed_experts=True)
    runtime = RolloutRuntime(
        cfg, hf_model=model, model_cfg=model_cfg, routed_layers=model_cfg.num_layers
    )
    try:
        runtime.check_routes(model_cfg)
        other = dataclasses.replace(model_cfg, moe_router_topk=model_cfg.moe_router_topk + 1)
        with pytest.raises(ValueError, match=r"x model.moe_router_topk=3: they serve another"):
            runtime.check_routes(other)
    finally:
        runtime.close()
    fewer = dataclasses.replace(model_cfg, num_experts=2)
    with pytest.raises(ValueError, match="expert 3, the policy has model.num_experts=2"):
        check_engine_routes(np.full((2, model_cfg.num_layers, 2), 3), fewer)
    with pytest.raises(ValueError, match="returned no routed experts"):
        check_engine_routes(None, model_cfg)
