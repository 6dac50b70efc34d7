import pytest
import torch

from megatron_grpo.algo.batch import Sample, collate
from megatron_grpo.train.plan import split_evenly


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
    batch = collate([[a], [b]], num_groups=2)
    assert batch.tokens.tolist() == [[5, 6, 7, 8], [9, 3, 4, 0]]
    assert batch.targets.tolist() == [[6, 7, 8, 0], [3, 4, 0, 0]]
    # position t predicts token t + 1, so the mask moves one step left
    assert batch.loss_mask.tolist() == [[0, 1, 1, 0], [1, 0, 0, 0]]
    assert batch.advantages.tolist() == [[0, 2, 2, 0], [-1, 0, 0, 0]]
    assert batch.seq_tokens.tolist() == [2, 1]
    assert batch.group_ids.tolist() == [0, 1]
    assert batch.seg.tolist() == [[0, 0, 0, 0], [1, 1, 1, -1]]
    assert batch.attention_mask is None and batch.rollout_logprobs is None
    assert batch.num_samples == 2 and batch.num_groups == 2


def test_packed_row_restarts_positions_and_blocks_attention():
    a = sample(0, [5, 6, 7], [0, 1, 1])
    b = sample(1, [9, 3], [0, 1])
    batch = collate([[a, b]], num_groups=1)
    assert batch.tokens.tolist() == [[5, 6, 7, 9, 3]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 0, 1]]
    assert batch.targets.tolist() == [[6, 7, 0, 3, 0]]  # no target across samples
    assert batch.loss_mask.tolist() == [[1, 1, 0, 1, 0]]
    assert batch.seg.tolist() == [[0, 0, 0, 1, 1]]
    blocked = batch.attention_mask[0, 0]
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


def test_split_evenly():
    assert split_evenly(list(range(7)), 3) == [[0, 1, 2], [3, 4], [5, 6]]
    with pytest.raises(ValueError, match="cannot split 2 items into 3"):
        split_evenly([1, 2], 3)


def test_micro_batch_moves_positions_and_keeps_per_sample_vectors():
    a = sample(0, [5, 6, 7], [0, 1, 1])
    batch = collate([[a]], num_groups=1)
    batch.loss_weights = torch.tensor([0.5])
    moved = batch.to(torch.device("meta"))
    assert moved.tokens.device.type == "meta" and moved.seg.device.type == "meta"
    assert moved.seq_tokens.device.type == "cpu" and moved.loss_weights.device.type == "cpu"
    assert batch.tokens.device.type == "cpu"  # the original is unchanged


def test_rows_pad_to_a_multiple_and_to_a_least_shape():
    a = sample(0, [5, 6, 7], [0, 1, 1])
    assert collate([[a]], num_groups=1, pad_to_multiple=4).tokens.shape == (1, 4)
    padded = collate([[a]], num_groups=1, shape=(3, 5))
    assert padded.tokens.shape == (3, 5)
    assert padded.seg.tolist()[1:] == [[-1] * 5] * 2  # empty rows hold no sample
    assert padded.loss_mask.sum() == 2 and padded.num_samples == 1


def test_an_idle_micro_batch_is_one_row_of_padding_with_a_zero_loss_weight():
    from megatron_grpo.algo.batch import collate
    from megatron_grpo.algo.policy_loss import token_values

    mb = collate([], num_groups=3, pad_to_multiple=2)
    assert mb.tokens.shape == (1, 2) and mb.num_samples == 0
    assert bool((mb.seg == -1).all()) and float(mb.loss_mask.sum()) == 0
    assert mb.group_ids.dtype == torch.long
    assert token_values(torch.zeros(0), mb.seg).tolist() == [[0.0, 0.0]]


def test_a_sample_pickles_as_raw_bytes_and_comes_back_equal():
    """Batches cross processes (the rollout producer, broadcast_object): a sample pickles
    its tensors as bytes, not through torch.save's per-tensor machinery."""
    import pickle

    samples = [
        Sample(
            tokens=torch.tensor([5, 6, 7, 8]),
            loss_mask=torch.tensor([0.0, 0.0, 1.0, 1.0]),
            advantage=-0.25,
            group=3,
            sample_id=7,
            rollout_logprobs=torch.tensor([0.0, 0.0, -1.5, -0.125]).to(torch.bfloat16),
        ),
        Sample(
            tokens=torch.tensor([1, 2]),
            loss_mask=torch.tensor([0.0, 1.0]),
            advantage=1.0,
            group=0,
            sample_id=0,
        ),  # fmt: skip
    ]
    data = pickle.dumps(samples)
    assert b"_rebuild_tensor" not in data and b"torch.storage" not in data
    for before, after in zip(samples, pickle.loads(data), strict=True):
        for name in ("tokens", "loss_mask", "rollout_logprobs"):
            a, b = getattr(before, name), getattr(after, name)
            assert (a is None and b is None) or (a.dtype == b.dtype and torch.equal(a, b))
        assert (after.advantage, after.group, after.sample_id) == (
            before.advantage,
            before.group,
            before.sample_id,
        )
        after.tokens[0] = 9  # writable, and its own memory
        assert before.tokens[0] != 9


def test_make_samples_equals_samples_made_one_by_one_and_checks_them_alike():
    from megatron_grpo.algo.batch import make_samples

    tokens, masks = [[5, 6, 7], [1, 2, 3, 4]], [[0, 1, 1], [0, 0, 1, 0]]
    made = make_samples(tokens, masks, [0.5, -1.0], [0, 2], [[0, -0.5, -1], [0, 0, -2, 0]])
    for i, got in enumerate(made):
        want = sample(i, tokens[i], masks[i])
        assert torch.equal(got.tokens, want.tokens) and got.tokens.dtype == torch.long
        assert torch.equal(got.loss_mask, want.loss_mask) and got.loss_mask.dtype == torch.float32
        assert (got.sample_id, got.group) == (i, [0, 2][i])
    assert made[1].rollout_logprobs.tolist() == [0, 0, -2, 0] and made[0].advantage == 0.5
    assert make_samples(tokens, masks, [0.0, 0.0], [0, 0])[0].rollout_logprobs is None
    with pytest.raises(ValueError, match="sample 1: the first token cannot be a loss token"):
        make_samples([[1, 2], [1, 2]], [[0, 1], [1, 1]], [0, 0], [0, 0])
    with pytest.raises(
        ValueError, match=r"sample 0: tokens and loss_mask .* got \(3,\) and \(2,\)"
    ):
        make_samples([[1, 2, 3]], [[0, 1]], [0], [0])
    with pytest.raises(ValueError, match="sample 0: needs at least 2 tokens"):
        make_samples([[1]], [[0]], [0], [0])


def test_a_rollout_batch_pickles_as_columns_and_comes_back_equal():
    import pickle

    from megatron_grpo.algo.batch import make_samples
    from megatron_grpo.rollout.stage import RolloutBatch

    rows = [[i, i + 1, i + 2] for i in range(50)]
    masks = [[0.0, 1.0, 1.0]] * 50
    samples = make_samples(rows, masks, [i / 7 for i in range(50)], [i // 5 for i in range(50)],
                           [[0.0, -0.1 * i, -0.2] for i in range(50)])  # fmt: skip
    batch = RolloutBatch(samples, {"reward_mean": 0.5})
    data = pickle.dumps(batch)
    # One set of columns for the batch, not fifty (one per sample).
    assert data.count(b"_unpickle_columns") == 1
    back = pickle.loads(data)
    assert back.stats == batch.stats and len(back.samples) == 50
    for a, b in zip(batch.samples, back.samples, strict=True):
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.loss_mask, b.loss_mask)
        assert torch.equal(a.rollout_logprobs, b.rollout_logprobs)
        assert (a.advantage, a.group, a.sample_id) == (b.advantage, b.group, b.sample_id)
    # Samples with and without rollout log-probs cannot share a column: one by one.
    mixed = RolloutBatch([samples[0], sample(1, [1, 2], [0, 1])], {})
    back = pickle.loads(pickle.dumps(mixed))
    assert back.samples[1].rollout_logprobs is None
    assert torch.equal(back.samples[0].rollout_logprobs, samples[0].rollout_logprobs)


def test_thd_row_pads_each_sample_and_records_its_boundaries():
    from megatron_grpo.algo.batch import collate_thd

    a = sample(0, [5, 6, 7], [0, 1, 1])
    b = sample(1, [9, 3, 4, 2, 8], [0, 0, 1, 1, 1], group=1)
    mb = collate_thd([a, b], num_groups=2, pad_to_multiple=4)
    assert mb.tokens.tolist() == [[5, 6, 7, 0, 9, 3, 4, 2, 8, 0, 0, 0]]
    assert mb.targets.tolist() == [[6, 7, 0, 0, 3, 4, 2, 8, 0, 0, 0, 0]]
    assert mb.position_ids.tolist() == [[0, 1, 2, 0, 0, 1, 2, 3, 4, 0, 0, 0]]
    assert mb.seg.tolist() == [[0, 0, 0, -1, 1, 1, 1, 1, 1, -1, -1, -1]]
    assert mb.cu_seqlens.tolist() == [0, 4, 12] and mb.cu_seqlens.dtype == torch.int32
    assert mb.max_seqlen == 8 and mb.attention_mask is None
    assert mb.seq_tokens.tolist() == [2, 3]
    # a least length (one shape under VPP) and an idle micro-batch end with padding
    assert collate_thd([a], num_groups=1, pad_to_multiple=4, min_length=12).cu_seqlens.tolist() == [
        0,
        4,
        12,
    ]
    idle = collate_thd([], num_groups=1, pad_to_multiple=4)
    assert idle.cu_seqlens.tolist() == [0, 4] and idle.num_samples == 0


def test_context_parallel_ranks_hold_chunks_r_and_2cp_minus_1_minus_r_of_each_sequence():
    from megatron_grpo.algo.batch import context_parallel_indices

    cu = torch.tensor([0, 8, 12], dtype=torch.int32)
    assert context_parallel_indices(cu, 2, 0).tolist() == [0, 1, 6, 7, 8, 11]
    assert context_parallel_indices(cu, 2, 1).tolist() == [2, 3, 4, 5, 9, 10]
    with pytest.raises(ValueError, match="padded to a multiple of 4"):
        context_parallel_indices(torch.tensor([0, 6], dtype=torch.int32), 2, 0)


def test_context_parallel_plan_splits_every_micro_batch_and_keeps_whole_counts():
    from megatron_grpo.algo.batch import collate_thd
    from megatron_grpo.commands.invariance import fixed_batch
    from megatron_grpo.config import ParallelDims
    from megatron_grpo.mcore.parallel import ParallelContext
    from megatron_grpo.train.step import StepSettings, plan_micro_batches

    samples = fixed_batch(vocab_size=50)
    settings = StepSettings(
        global_batch_size=len(samples),
        num_iterations=1,
        max_tokens_per_micro_batch=48,
        pack=False,
        vocab_size=50,
        max_len=10,
    )
    shares = []
    for cp_rank in range(2):
        ctx = ParallelContext(
            dims=ParallelDims(cp=2),
            world_size=2,
            rank=cp_rank,
            dp_size=1,
            dp_rank=0,
            tp_rank=0,
            pp_rank=0,
            cp_rank=cp_rank,
            pg=None,
        )
        shares.append(plan_micro_batches(samples, ctx, settings))
    assert len(shares[0]) == len(shares[1]) > 1
    for mb0, mb1 in zip(*shares):
        assert mb0.cu_seqlens.tolist() == mb1.cu_seqlens.tolist()
        assert bool((torch.diff(mb0.cu_seqlens) % 4 == 0).all())  # 2 CP chunks each
        assert mb0.tokens.shape[1] * 2 == int(mb0.cu_seqlens[-1])
        assert mb0.seq_tokens.tolist() == mb1.seq_tokens.tolist()
        ids = mb0.sample_ids.tolist()
        whole = collate_thd([samples[i] for i in ids], num_groups=4, pad_to_multiple=4)
        assert mb0.seq_tokens.tolist() == whole.seq_tokens.tolist()
        # the two shares hold every loss token of the micro-batch once
        assert float(mb0.loss_mask.sum() + mb1.loss_mask.sum()) == float(whole.loss_mask.sum())
