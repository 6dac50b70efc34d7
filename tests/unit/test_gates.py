"""On-policy gates (``train.gates``): the figures from a micro-batch's log-probs, and the
decision, on hand-computed numbers."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from megatron_grpo.algo.batch import Sample, collate
from megatron_grpo.algo.loss import grpo_loss, set_loss_weights
from megatron_grpo.config import Config, GatesConfig, LossConfig, ModelConfig, load_config
from megatron_grpo.train import gates
from megatron_grpo.train.run_start import config_changes
from megatron_grpo.train.step import reduce_metrics

HALF = math.log(0.5)
"""The learner's log-prob of every token below: two-token vocabulary, logits 0."""
FLOAT32 = GatesConfig(
    first_step_mismatch=1e-3,
    first_step_mismatch_max=0.1,
    first_step_rollout_kl=1e-4,
    stop_mismatch=0.5,
)


def sample(sample_id: int, engine_minus_learner: list[float], *, engine: bool = True) -> Sample:
    """A prompt token and ``len(engine_minus_learner)`` completion tokens, with the engine's
    log-probs that far from the learner's."""
    n = len(engine_minus_learner)
    rollout = torch.tensor([0.0] + [HALF + d for d in engine_minus_learner])
    return Sample(
        tokens=torch.tensor([0] + [1] * n),
        loss_mask=torch.tensor([0.0] + [1.0] * n),
        advantage=1.0,
        group=0,
        sample_id=sample_id,
        rollout_logprobs=rollout if engine else None,
    )


def figures(*micro_batches: list[Sample]) -> dict:
    """The loss metrics of one optimizer step over ``micro_batches`` on one rank."""
    mbs = [collate([[s] for s in mb], num_groups=1) for mb in micro_batches]
    cfg = LossConfig()
    set_loss_weights(mbs, cfg, group=None, device=None, count_here=True)
    per_mb = []
    for mb in mbs:
        logits = torch.zeros(*mb.tokens.shape, 2)
        _, _, metrics = grpo_loss(mb, logits, cfg=cfg, tp_group=None, vocab_size=2)
        per_mb.append(metrics)
    return reduce_metrics(per_mb, SimpleNamespace(is_last_stage=True, tp_rank=0, world_size=1))


def test_the_figures_are_means_over_loss_tokens_and_the_worst_token():
    # engine - learner on the three loss tokens: -0.1, +0.3 (micro-batch 1), +0.2 (2)
    m = figures([sample(0, [-0.1, 0.3])], [sample(1, [0.2])])
    assert m["logprob_mismatch"] == pytest.approx((0.1 + 0.3 + 0.2) / 3, abs=1e-6)
    assert m["logprob_mismatch_max"] == pytest.approx(0.3, abs=1e-6)
    assert m["rollout_kl"] == pytest.approx((-0.1 + 0.3 + 0.2) / 3, abs=1e-6)


def test_tokens_without_engine_log_probs_count_in_no_figure():
    m = figures([sample(0, [0.4])], [sample(1, [0.0, 0.0, 0.0], engine=False)])
    assert m["loss_tokens"] == 4
    assert m["logprob_mismatch"] == pytest.approx(0.4, abs=1e-6)  # over 1 token, not 4
    none = figures([sample(0, [0.4], engine=False)])
    assert none["logprob_mismatch"] is none["logprob_mismatch_max"] is none["rollout_kl"] is None


def decide(mean, worst, kl, *, first=True, cfg=FLOAT32, resumed=False):
    metrics = {"logprob_mismatch": mean, "logprob_mismatch_max": worst, "rollout_kl": kl}
    return gates.failure(metrics, cfg, step=7, first=first, resumed=resumed)


def test_the_demos_figures_pass_and_a_wrong_engines_stop_at_the_first_step():
    assert decide(1.4e-7, 6.4e-5, -1.3e-7) is None  # the CPU demos' worst, in float32
    line = decide(2.72, 5.22, 2.37)  # an engine that kept random weights
    assert line is not None and "\n" not in line
    assert line.startswith(
        "on-policy gate: step 7 (the first of a new run): train/logprob_mismatch = 2.72 "
        "(mean |learner - engine| log-prob; logprob_mismatch_max 5.22; rollout_kl 2.37) is "
        "above train.gates.first_step_mismatch=0.001"
    )
    for cause in ("pushed wrong", "tokenizer or chat template", "MoE routing", "dtype"):
        assert cause in line
    assert line.endswith("train.gates.first_step_mismatch=0 turns this gate off")
    assert "first after a resume" in decide(2.72, 5.22, 2.37, resumed=True)


@pytest.mark.parametrize(
    ("mean", "worst", "kl", "option"),
    [
        (1.1e-3, 0.0, 0.0, "first_step_mismatch"),  # just above each threshold
        (1e-3, 0.11, 0.0, "first_step_mismatch_max"),  # the mean at its threshold passes
        (1e-4, 0.05, -2e-4, "first_step_rollout_kl"),  # a signed figure: its magnitude
    ],
)
def test_each_first_step_figure_stops_on_its_own_threshold(mean, worst, kl, option):
    line = decide(mean, worst, kl)
    assert line is not None and f"is above train.gates.{option}=" in line


def test_a_threshold_of_zero_or_a_figure_not_measured_passes():
    off = GatesConfig(
        first_step_mismatch=0, first_step_mismatch_max=0, first_step_rollout_kl=0, stop_mismatch=0
    )
    assert decide(2.72, 5.22, 2.37, cfg=off) is None
    assert decide(2.72, 5.22, 2.37, first=False, cfg=off) is None
    assert decide(None, None, None) is None


def test_later_steps_stop_only_when_the_mismatch_runs_away():
    assert decide(0.16, 3.9, 0.06, first=False) is None  # the async demo's worst
    line = decide(0.61, 5.3, 0.5, first=False)  # an engine that stopped taking pushes
    assert line is not None
    assert "step 7 (a later step): train/logprob_mismatch = 0.61" in line
    assert "is above train.gates.stop_mismatch=0.5: the mismatch ran away" in line


def test_the_gate_raises_the_line_before_anything_else():
    gate = gates.for_step(FLOAT32, step=1, first=True, resumed=False)
    gate({"logprob_mismatch": 1e-7, "logprob_mismatch_max": 1e-6, "rollout_kl": 0.0})
    with pytest.raises(gates.OffPolicyError, match=r"^on-policy gate: step 1 "):
        gate({"logprob_mismatch": 0.5, "logprob_mismatch_max": 1.0, "rollout_kl": 0.4})


def test_defaults_follow_the_dtype_and_a_resume_may_change_them():
    fp32 = Config(model=ModelConfig())
    assert fp32.train.gates == FLOAT32
    bf16 = Config(model=ModelConfig(params_dtype="bfloat16"))
    assert bf16.train.gates.first_step_mismatch == 0.1
    assert bf16.train.gates.first_step_mismatch_max == 10.0
    assert bf16.train.gates.stop_mismatch == 0.5
    stale = load_config(overrides=["rollout.max_staleness=2"])  # 2 steps of policy lag more
    assert stale.train.gates.stop_mismatch == 1.5
    assert stale.train.gates.first_step_mismatch == 1e-3  # the first step is on policy
    given = load_config(overrides=["train.gates.first_step_mismatch=0"])
    assert given.train.gates.first_step_mismatch == 0  # off, not the default
    with pytest.raises(ValueError, match="train.gates.stop_mismatch must be >= 0"):
        GatesConfig(stop_mismatch=-1.0)
    from megatron_grpo.config import to_dict
    from megatron_grpo.train.run_start import _resumable

    changed = config_changes(to_dict(fp32), to_dict(given))
    assert list(changed) == ["train.gates.first_step_mismatch"]
    assert all(_resumable(k) for k in changed)
