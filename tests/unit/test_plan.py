import random

import pytest

from megatron_grpo.train.plan import balance, naive_padding_fraction, pack, plan, split_to_multiple


def test_balance_spreads_tokens():
    lengths = [100, 90, 10, 10, 10, 10, 50, 40]
    ranks = balance(lengths, 2)
    assert sorted(i for r in ranks for i in r) == list(range(8))
    loads = [sum(lengths[i] for i in r) for r in ranks]
    assert loads == [160, 160]
    with pytest.raises(ValueError, match="3 samples, fewer than the 4 DP ranks"):
        balance([1, 2, 3], 4)


def test_packed_micro_batches_respect_the_budget_and_keep_every_sample():
    lengths = [7, 3, 5, 2, 8, 1]
    mbs = pack(range(6), lengths, max_tokens=10, packed=True)
    assert all(len(mb) == 1 for mb in mbs)  # one packed row each
    assert all(sum(lengths[i] for i in mb[0]) <= 10 for mb in mbs)
    assert sorted(i for mb in mbs for i in mb[0]) == list(range(6))
    assert len(mbs) == 3  # 26 tokens in bins of 10: FFD finds the minimum here


def test_unpacked_micro_batches_count_padding_in_the_budget():
    lengths = [9, 8, 3, 3, 3]
    mbs = pack(range(5), lengths, max_tokens=18, packed=False)
    for mb in mbs:
        width = max(lengths[row[0]] for row in mb)
        assert width * len(mb) <= 18
    assert sorted(row[0] for mb in mbs for row in mb) == list(range(5))


def test_sample_over_budget_is_named():
    with pytest.raises(
        ValueError, match="sample 1 has 30 tokens, more than the micro-batch budget"
    ):
        pack([0, 1], [5, 30], max_tokens=20, packed=True)


def test_long_tailed_lengths_pack_with_little_padding():
    rng = random.Random(0)
    lengths = [min(4096, int(rng.paretovariate(1.2) * 100)) for _ in range(512)]
    packed = plan(lengths, dp_size=4, max_tokens=8192, packed=True)
    assert packed.padding_fraction(lengths) < 0.05
    assert naive_padding_fraction(lengths, micro_batch_size=8) > 0.5


def test_unpacked_split_weighs_padding_against_micro_batch_count():
    # Greedy filling would make [10, 5] + [5, 5]: 5 padded positions. Splitting after the
    # longest row pads nothing for the same number of micro-batches.
    assert pack(range(4), [10, 5, 5, 5], max_tokens=20, packed=False) == [[[0]], [[1], [2], [3]]]
    # Equal lengths: one micro-batch, not one per row.
    assert pack(range(4), [4, 4, 4, 4], max_tokens=16, packed=False) == [[[0], [1], [2], [3]]]
    # A little padding beats a micro-batch more (its cost is 1/16 of the budget: 4.4 tokens).
    assert pack(range(3), [22, 21, 21], max_tokens=70, packed=False) == [[[0], [1], [2]]]


def test_unpacked_long_tailed_lengths_pad_under_five_percent():
    rng = random.Random(0)
    lengths = [min(16384, int(rng.lognormvariate(7.0, 1.0)) + 200) for _ in range(1024)]
    unpacked = plan(lengths, dp_size=8, max_tokens=16384, packed=False)
    assert unpacked.padding_fraction(lengths) < 0.05


def test_split_to_multiple_halves_the_fullest_micro_batch():
    # unpacked rows are split by row, a packed row by its samples; nothing is lost
    assert split_to_multiple([[[0], [1], [2]], [[3]]], 2) == [[[0], [1], [2]], [[3]]]
    assert split_to_multiple([[[0], [1], [2]]], 2) == [[[0]], [[1], [2]]]
    assert split_to_multiple([[[0, 1, 2, 3]]], 4) == [[[0]], [[1]], [[2]], [[3]]]
    with pytest.raises(ValueError, match="1 samples on a DP rank cannot make a multiple of 2"):
        split_to_multiple([[[0]]], 2)


def test_check_invariance_lays_out_a_dp_rank_without_loss_tokens():
    """check-invariance's empty-rank batch, through the trainer's planner at DP2: one rank
    gets only the fully masked sample, and the ranks get different micro-batch counts."""
    from megatron_grpo.commands.invariance.cases import Variant

    variant = Variant(1, global_batch="empty-rank")
    batch = variant.batch(vocab_size=100)
    lengths = [len(s) for s in batch]
    split = plan(lengths, dp_size=2, max_tokens=variant.token_budget(lengths, 2), packed=False)
    loss_tokens = [
        sum(batch[i].num_loss_tokens for mb in rank for row in mb for i in row)
        for rank in split.ranks
    ]
    assert sorted(loss_tokens)[0] == 0 and sorted(loss_tokens)[1] > 0
    assert sorted(len(rank) for rank in split.ranks) == [1, 2]


@pytest.mark.parametrize("dp_size", [2, 4])
@pytest.mark.parametrize("num_micro_batches", [1, 3])
def test_check_invariance_scatters_prompt_groups_over_dp_ranks(dp_size, num_micro_batches):
    """check-invariance's sparse-groups batch, through the trainer's planner: the ranks hold
    prompt groups as they do at scale (a few of many), so group ids numbered per rank would
    name other groups than the batch's, and the one DP all-reduce would add them up."""
    from megatron_grpo.commands.invariance.cases import SPARSE_GROUP_SIZES, Variant

    variant = Variant(num_micro_batches, global_batch="sparse-groups")
    batch = variant.batch(vocab_size=100)
    lengths = [len(s) for s in batch]
    budget = variant.token_budget(lengths, dp_size)
    split = plan(lengths, dp_size=dp_size, max_tokens=budget, packed=False)
    num_groups = len(SPARSE_GROUP_SIZES)
    held = [[batch[i].group for mb in rank for row in mb for i in row] for rank in split.ranks]
    per_group = [[rank.count(g) for rank in held] for g in range(num_groups)]

    assert all(len(set(rank)) < num_groups for rank in held)  # every rank lacks some group
    assert len({frozenset(rank) for rank in held}) == dp_size  # no two ranks hold the same
    assert any(sum(c > 0 for c in counts) == 1 and sum(counts) > 1 for counts in per_group)
    assert any(len({c for c in counts if c}) > 1 for counts in per_group)  # split unevenly
    renumbered = [sorted(set(rank)) != list(range(len(set(rank)))) for rank in held]
    assert all(renumbered) if dp_size == 4 else any(renumbered)
    if num_micro_batches > 1:  # some group's samples on one rank fall in several micro-batches
        assert any(
            len({k for k, mb in enumerate(rank) for row in mb for i in row if batch[i].group == g})
            > 1
            for rank in split.ranks
            for g in range(num_groups)
        )
    last = [s for s in batch if s.group == num_groups - 1]
    assert len(last) == 1 and last[0].num_loss_tokens == 0  # a group P does not count


def test_split_to_count_halves_then_idles():
    from megatron_grpo.train.plan import split_to_count

    assert split_to_count([[[0], [1], [2]]], 2) == [[[0]], [[1], [2]]]
    assert split_to_count([[[0, 1]]], 3) == [[[0]], [[1]], []]  # an idle micro-batch
    assert split_to_count([[[0]], [[1]]], 2) == [[[0]], [[1]]]
