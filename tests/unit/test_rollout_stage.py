"""The main rank's rollout step with a scripted engine: dynamic sampling, samples, dump/replay."""

import threading
from dataclasses import dataclass, field

import pytest
import torch

from megatron_grpo.config import AdvantageConfig, RolloutConfig
from megatron_grpo.rollout.stage import collect, dump, replay


@dataclass
class Item:
    prompt_ids: list
    label: str
    metadata: dict
    prompt_text: str = ""


class Sampler:
    def __init__(self):
        self.next = 0

    def next_batch(self, n):
        items = [Item([1, 2 + (self.next + i) % 5], str(self.next + i), {}) for i in range(n)]
        self.next += n
        return items


@dataclass
class Finish:
    type: str


@dataclass
class Gen:
    prompt_ids: tuple
    output_ids: tuple
    rollout_logprobs: tuple
    finish_reason: Finish


class Runtime:
    """Prompt p answers its own label when it is even; odd prompts answer half right."""

    def generate_groups(self, prompts, cfg, *, seed, stop_token_ids, on_group=None):
        groups = []
        for i, p in enumerate(prompts):
            groups.append(
                [
                    Gen(
                        tuple(p),
                        (7, 8, 9)[: 1 + k % 3],
                        (-0.5,) * (1 + k % 3),
                        Finish("length" if k == 0 else "stop"),
                    )
                    for k in range(cfg.samples_per_prompt)
                ]
            )
            if on_group is not None:
                on_group(i, groups[-1])
                self.after_group(i)
        return groups

    def after_group(self, index):
        pass


class Tokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return str(len(ids))


@dataclass
class Scored:
    rewards: list
    num_errors: int = 0
    errors: list = field(default_factory=list)


class Scorer:
    """Reward 1 for responses of length 1 in prompts whose id is even; flat groups otherwise."""

    def __init__(self, runs_elsewhere=False):
        self.calls = 0
        self.runs_elsewhere = runs_elsewhere
        self.scored = threading.Event()

    def score(self, texts, labels, metas, **kwargs):
        self.calls += 1
        self.scored.set()
        # what a TRL-style reward reads: each sample's prompt and completion ids
        assert len(kwargs["prompts"]) == len(kwargs["completion_ids"]) == len(texts)
        assert all(isinstance(ids, list) for ids in kwargs["completion_ids"])
        out = []
        for t, label in zip(texts, labels):
            out.append(1.0 if int(label) % 2 == 0 and t == "1" else 0.0)
        return Scored(out)


def run(dynamic, prompts=4, samples=3, rounds=4, mask_truncated=False, **fakes):
    cfg = RolloutConfig(
        prompts_per_step=prompts, samples_per_prompt=samples, mask_truncated=mask_truncated
    )
    adv = AdvantageConfig(dynamic_sampling=dynamic, max_sampling_rounds=rounds, scale_by_std=False)
    return collect(
        1,
        sampler=Sampler(),
        runtime=fakes.get("runtime", Runtime()),
        scorer=fakes.get("scorer", Scorer()),
        tokenizer=Tokenizer(),
        cfg=cfg,
        adv_cfg=adv,
        seed=0,
        stop_token_ids=[],
    )


def test_samples_carry_masks_logprobs_groups_and_advantages():
    batch = run(dynamic=False)
    assert len(batch.samples) == 12
    s = batch.samples[0]
    assert s.tokens.tolist() == [1, 2, 7]
    assert s.loss_mask.tolist() == [0.0, 0.0, 1.0]
    assert s.rollout_logprobs.tolist() == [0.0, 0.0, -0.5]
    assert [x.group for x in batch.samples] == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    # group 0 (label "0", even): rewards [1, 0, 0] -> advantages [2/3, -1/3, -1/3]
    assert [round(x.advantage, 4) for x in batch.samples[:3]] == [0.6667, -0.3333, -0.3333]
    assert batch.stats["reward_mean"] == pytest.approx(2 / 12)
    assert batch.stats["truncated_fraction"] == pytest.approx(4 / 12)


def test_dynamic_sampling_fills_the_batch_with_groups_that_have_spread():
    batch = run(dynamic=True, prompts=4)
    groups = {}
    for s in batch.samples:
        groups.setdefault(s.group, []).append(s.advantage)
    assert len(groups) == 4
    assert all(max(a) > min(a) for a in groups.values())
    assert batch.stats["groups_dropped"] == 3  # odd labels 1, 3, 5
    assert batch.stats["sampling_rounds"] == 3
    assert batch.stats["groups_flat_kept"] == 0


def test_round_cap_completes_with_flat_groups_and_reports_it():
    batch = run(dynamic=True, prompts=4, rounds=1)
    assert len(batch.samples) == 12
    assert batch.stats["groups_flat_kept"] == 2


def test_overlong_filtering_masks_truncated_completions():
    batch = run(dynamic=False, mask_truncated=True)
    assert batch.samples[0].num_loss_tokens == 0  # finished by length
    assert batch.samples[1].num_loss_tokens == 2


def test_dump_and_replay_round_trip(tmp_path):
    batch = run(dynamic=False)
    dump(batch, tmp_path, 3)
    back = replay(tmp_path, 3)
    assert back.stats == batch.stats
    for a, b in zip(batch.samples, back.samples):
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.loss_mask, b.loss_mask)
        assert a.advantage == b.advantage and a.group == b.group
    with pytest.raises(FileNotFoundError, match="no dump for step 4"):
        replay(tmp_path, 4)


def test_length_by_advantage_splits_better_and_worse_than_the_group():
    from types import SimpleNamespace

    from megatron_grpo.rollout.stage import length_by_advantage

    def gens(*lengths):
        return [SimpleNamespace(output_ids=[0] * n) for n in lengths]

    advantages = torch.tensor([[1.0, -0.5, -0.5], [0.0, 0.0, 0.0]])
    stats = length_by_advantage([gens(2, 10, 20), gens(7, 7, 7)], advantages)
    assert stats == {"response_length_pos_adv_mean": 2.0, "response_length_neg_adv_mean": 15.0}
    assert length_by_advantage([gens(7, 7, 7)], torch.zeros(1, 3)) == {}  # flat: no side


def test_groups_are_scored_while_the_others_are_generated():
    """A reward that runs elsewhere scores each group once it is generated: the first
    group's rewards are being computed before the second group exists."""
    scorer = Scorer(runs_elsewhere=True)
    waited = []

    class Slow(Runtime):
        def after_group(self, index):
            if index == 0:
                waited.append(scorer.scored.wait(timeout=10))

    batch = run(dynamic=True, runtime=Slow(), scorer=scorer)
    assert waited and all(waited) and scorer.calls > 1  # one call per group
    inline = run(dynamic=True)
    assert batch.stats == {
        **inline.stats,
        "generated_tokens_per_s": batch.stats["generated_tokens_per_s"],
    }
    assert [x.advantage for x in batch.samples] == [x.advantage for x in inline.samples]


def test_samples_take_the_engines_routes_and_keep_them_through_a_dump(tmp_path):
    """Routes of prompt + output - 1 positions become [S, L, K] with -1 on the last token; a
    sample without them beside others gets -1 everywhere; a dump and its replay keep them."""
    import numpy as np

    from megatron_grpo.rollout.stage import RolloutBatch, sample_routes

    routed = np.arange(4 * 2 * 2, dtype=np.int32).reshape(4, 2, 2)  # 2 prompt + 3 output - 1
    stop = Finish("stop")
    gens = [Gen((1, 2), (3, 4, 5), (0.0,) * 3, stop), Gen((1,), (6,), (0.0,), stop)]
    gens[0].routed_experts = routed  # type: ignore[attr-defined]
    routes = sample_routes(gens, [5, 2])
    assert routes is not None and routes[0].dtype == torch.int16
    assert routes[0][:4].tolist() == routed.tolist() and (routes[0][4] == -1).all()
    assert (routes[1] == -1).all()
    assert sample_routes([Gen((1,), (2,), (0.0,), stop)], [2]) is None
    with pytest.raises(ValueError, match="routes for 4 positions of a 3-token sample"):
        sample_routes(gens[:1], [3])
    from megatron_grpo.algo.batch import make_samples

    samples = make_samples(
        [[1, 2, 3, 4, 5], [1, 6]], [[0, 0, 1, 1, 1], [0, 1]], [1.0, -1.0], [0, 0], routes=routes
    )
    dump(RolloutBatch(samples, {}), tmp_path, 1)
    back = replay(tmp_path, 1).samples
    assert [torch.equal(a.routes, b.routes) for a, b in zip(samples, back)] == [True, True]


def test_an_episode_keeps_the_routes_of_its_last_turn_that_saw_the_whole_context():
    import numpy as np

    from megatron_grpo.rollout.episode import Trajectory
    from megatron_grpo.sglang_api.types import FinishReason, Generation

    def turn(prompt, output, routes):
        stop = FinishReason(type="stop", detail=output[-1])
        return Generation(
            prompt_index=0,
            sample_index=0,
            prompt_ids=tuple(prompt),
            output_ids=tuple(output),
            rollout_logprobs=(0.0,) * len(output),
            finish_reason=stop,
            weight_version="0",
            routed_experts=routes,
        )

    t = Trajectory([1, 2])
    t.add_model_turn(turn([1, 2], [3, 4], np.zeros((3, 1, 1), np.int32)))
    t.add_tokens([9, 9])  # tool output
    last = np.ones((7, 1, 1), np.int32)  # the context (6 tokens) + 2 output - 1
    t.add_model_turn(turn(t.context, [5, 6], last))
    assert t.episode(FinishReason(type="stop", detail=6)).routed_experts is last
    t.add_model_turn(turn([1], [7], np.zeros((1, 1, 1), np.int32)))  # not the context
    assert t.episode(FinishReason(type="stop", detail=7)).routed_experts is None
