import pytest
import torch

from megatron_grpo.algo.advantages import fill_batch, group_advantages, has_spread
from megatron_grpo.config import AdvantageConfig


def test_mean_baseline_with_and_without_std_scaling():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    drgrpo = group_advantages(r, AdvantageConfig(scale_by_std=False))
    assert drgrpo.tolist() == [[0.5, -0.5, -0.5, 0.5], [0.0, 0.0, 0.0, 0.0]]
    grpo = group_advantages(r, AdvantageConfig(scale_by_std=True, std_eps=0.0))
    std = torch.tensor([1.0, 0.0, 0.0, 1.0]).std()  # unbiased, as in GRPO implementations
    torch.testing.assert_close(grpo[0], torch.tensor([0.5, -0.5, -0.5, 0.5]) / std)
    assert grpo[1].tolist() == [0.0] * 4  # no spread, no signal, no NaN


def test_leave_one_out_baseline():
    r = torch.tensor([[3.0, 0.0, 0.0]])
    adv = group_advantages(r, AdvantageConfig(baseline="leave_one_out", scale_by_std=False))
    torch.testing.assert_close(adv, torch.tensor([[3.0, -1.5, -1.5]]))
    with pytest.raises(ValueError, match="at least 2 samples"):
        group_advantages(torch.tensor([[1.0]]), AdvantageConfig(baseline="leave_one_out"))


def test_dynamic_sampling_keeps_groups_with_spread_in_order():
    r = torch.tensor([[0.0, 0.0], [0.0, 1.0], [1.0, 1.0], [1.0, 0.0], [0.0, 1.0]])
    spread = has_spread(r).tolist()
    assert spread == [False, True, False, True, True]
    filled = fill_batch(spread, 2)
    assert filled.kept == [1, 3] and filled.num_dropped == 2


def test_config_validation():
    with pytest.raises(ValueError, match="max_sampling_rounds must be >= 1"):
        AdvantageConfig(max_sampling_rounds=0)
