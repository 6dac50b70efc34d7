import pytest
import torch

from megatron_grpo.algo.batch import Sample, collate, micro_batches_for_rank, split_evenly


def sample(i, tokens, mask, adv=1.0, group=0):
    return Sample(
        tokens=torch.tensor(tokens),
        loss_mask=torch.tensor(mask, dtype=torch.float32),
        advantage=adv,
        group=group,
        sample_id=i,
    )


def test_collate_shifts_onto_logit_positions_and_pads():
    a = sample(0, [5, 6, 7, 8], [0, 0, 1, 1], adv=2.0)
    b = sample(1, [9, 3, 4], [0, 1, 0], adv=-1.0, group=1)
    batch = collate([[a], [b]])
    assert batch["tokens"].tolist() == [[5, 6, 7, 8], [9, 3, 4, 0]]
    assert batch["targets"].tolist() == [[6, 7, 8, 0], [3, 4, 0, 0]]
    # position t predicts token t + 1, so the mask moves one step left
    assert batch["loss_mask"].tolist() == [[0, 1, 1, 0], [1, 0, 0, 0]]
    assert batch["advantages"].tolist() == [[0, 2, 2, 0], [-1, 0, 0, 0]]
    assert batch["seq_tokens"].tolist() == [2, 1]
    assert batch["group_ids"].tolist() == [0, 1]
    assert batch["seg"].tolist() == [[0, 0, 0, 0], [1, 1, 1, -1]]
    assert "attention_mask" not in batch


def test_packed_row_restarts_positions_and_blocks_attention():
    a = sample(0, [5, 6, 7], [0, 1, 1])
    b = sample(1, [9, 3], [0, 1])
    batch = collate([[a, b]])
    assert batch["tokens"].tolist() == [[5, 6, 7, 9, 3]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1]]
    assert batch["targets"].tolist() == [[6, 7, 0, 3, 0]]  # no target across samples
    assert batch["loss_mask"].tolist() == [[1, 1, 0, 1, 0]]
    assert batch["seg"].tolist() == [[0, 0, 0, 1, 1]]
    blocked = batch["attention_mask"][0, 0]
    allowed = (~blocked).int().tolist()
    assert allowed == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],
        [0, 0, 0, 1, 0],
        [0, 0, 0, 1, 1],
    ]


def test_sample_validation_names_the_sample():
    with pytest.raises(ValueError, match="sample 3: the first token cannot be a loss token"):
        sample(3, [1, 2], [1, 1])
    with pytest.raises(ValueError, match="sample 4: tokens and loss_mask must be 1-D"):
        sample(4, [1, 2, 3], [0, 1])


def test_split_evenly_and_rank_shares():
    assert split_evenly(list(range(7)), 3) == [[0, 1, 2], [3, 4], [5, 6]]
    with pytest.raises(ValueError, match="cannot split 2 items into 3"):
        split_evenly([1, 2], 3)
    samples = [sample(i, [1, 2, 3], [0, 1, 1]) for i in range(8)]
    mbs = micro_batches_for_rank(samples, dp_size=2, dp_rank=1, num_micro_batches=2)
    assert [mb["sample_ids"].tolist() for mb in mbs] == [[4, 5], [6, 7]]
    packed = micro_batches_for_rank(samples, dp_size=2, dp_rank=1, num_micro_batches=2, pack=True)
    assert [mb["tokens"].shape for mb in packed] == [(1, 6), (1, 6)]
