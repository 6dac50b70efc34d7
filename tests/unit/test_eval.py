"""Evaluation during training: config, pass@k of scored groups, the evaluator on a fake
engine with the real reward scorer, step-0 rows on resume, and the plot."""

import json
from types import SimpleNamespace

import pytest

from megatron_grpo.config import Config, EvalConfig, MetricsConfig, from_dict
from megatron_grpo.eval.runner import Evaluator, build, group_metrics, maybe_run
from megatron_grpo.metrics import MetricsLogger, curves, plot_run, read_metrics
from megatron_grpo.rewards import RewardConfig, RewardScorer
from megatron_grpo.rollout.parts import RolloutSettings
from megatron_grpo.testing import char_tokenizer


def test_config_checks_and_schedule():
    with pytest.raises(ValueError, match=r"eval.k must list values in \[1, .*=4\], got \[8\]"):
        EvalConfig(samples_per_prompt=4, k=[8])
    with pytest.raises(ValueError, match="names must be unique"):
        from_dict(
            EvalConfig, {"datasets": [{"name": "a", "path": "x"}, {"name": "a", "path": "y"}]}
        )
    with pytest.raises(ValueError, match="without '/'"):
        from_dict(EvalConfig, {"datasets": [{"name": "a/b", "path": "x"}]})
    with pytest.raises(ValueError, match="unset rollout.replay_dir"):
        from_dict(
            Config,
            {"eval": {"datasets": [{"name": "a", "path": "x"}]}, "rollout": {"replay_dir": "d"}},
        )
    cfg = from_dict(EvalConfig, {"datasets": [{"name": "a", "path": "x"}], "interval": 3})
    assert [s for s in range(11) if cfg.due(s, last_step=10)] == [0, 3, 6, 9, 10]
    assert not EvalConfig(interval=3).due(3, last_step=10)  # no sets: off


def test_group_metrics_by_hand():
    rewards = [[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.7, 1.0]]
    metrics = group_metrics(rewards, [2, 4, 6, 8] * 3, ks=[1, 2], threshold=0.5)
    # pass@2 per prompt: 1 - C(2,2)/C(4,2) = 5/6, 0, 1
    assert metrics["pass@1"] == pytest.approx((0.5 + 0 + 1) / 3)
    assert metrics["pass@2"] == pytest.approx((5 / 6 + 0 + 1) / 3)
    assert metrics["reward_mean"] == pytest.approx(5.7 / 12)  # (2 + 0 + 3.7) / 12
    assert metrics["response_length_mean"] == 5.0


class FakeRuntime:
    """Answers each prompt with a fixed text per sample index; records the requests."""

    def __init__(self, tokenizer, answers: dict[str, list[str]]):
        self.tokenizer, self.answers, self.requests = tokenizer, answers, []

    def generate_groups(self, prompts, cfg, *, seed, stop_token_ids):
        self.requests.append((len(prompts), cfg.samples_per_prompt, cfg.sampling.temperature, seed))
        groups = []
        for ids in prompts:
            prompt = self.tokenizer.decode(ids).replace(" ", "")
            texts = next(v for k, v in self.answers.items() if k in prompt)
            assert len(texts) == cfg.samples_per_prompt
            groups.append([SimpleNamespace(output_ids=self.tokenizer.encode(t)) for t in texts])
        return groups


@pytest.fixture
def setup(tmp_path):
    rows = [{"prompt": "1+1=", "label": "2"}, {"prompt": "2+3=", "label": "5"}]
    rows.append({"prompt": "4+4=", "label": "8"})
    (tmp_path / "held.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    tokenizer = char_tokenizer(["0123456789+="])
    answers = {"1+1=": ["2", "3", "2", "2"], "2+3=": ["1", "1", "1", "1"], "4+4=": list("8888")}
    raw = {
        "seed": 3,
        "eval": {
            "datasets": [{"name": "sums", "path": str(tmp_path / "held.jsonl"), "max_prompts": 2}],
            "samples_per_prompt": 4,
            "k": [1, 4],
            "temperature": 0.6,
            "interval": 2,
        },
    }
    cfg = from_dict(Config, raw)
    runtime = FakeRuntime(tokenizer, answers)
    scorer = RewardScorer(RewardConfig(type="math"))
    return (
        cfg,
        runtime,
        Evaluator(
            cfg.eval,
            RolloutSettings.of(cfg),
            runtime=runtime,
            scorer=scorer,
            tokenizer=tokenizer,
            stop_token_ids=[],
        ),
    )


def test_evaluator_scores_held_out_prompts(setup):
    cfg, runtime, evaluator = setup
    metrics = evaluator.run(2)
    # first two prompts only (max_prompts): 3 of 4 right, and 0 of 4
    assert metrics["sums/pass@1"] == pytest.approx((0.75 + 0.0) / 2)
    assert metrics["sums/pass@4"] == pytest.approx((1.0 + 0.0) / 2)
    assert metrics["sums/reward_mean"] == pytest.approx(3 / 8)
    assert metrics["sums/response_length_mean"] == 1.0
    assert metrics["sums/reward_errors"] == 0.0 and metrics["time_s"] >= 0
    (request,) = runtime.requests
    assert request[:3] == (2, 4, 0.6)  # the eval's sampling, not the training's


def test_evaluator_seed_depends_on_the_step_only(setup):
    cfg, runtime, evaluator = setup
    evaluator.run(2)
    evaluator.run(4)
    evaluator.run(2)
    seeds = [r[3] for r in runtime.requests]
    assert seeds[0] == seeds[2] != seeds[1]


def test_maybe_run_follows_the_schedule(setup):
    cfg, runtime, evaluator = setup
    total = cfg.train.total_steps
    assert maybe_run(evaluator, cfg.eval, 1, total) == {}
    assert "sums/pass@1" in maybe_run(evaluator, cfg.eval, 2, total)
    assert maybe_run(None, cfg.eval, 2, total) == {}  # not the main rank
    replayed = build(cfg.eval, RolloutSettings.of(cfg), None, SimpleNamespace(is_main=True))
    assert replayed is None  # replayed rollouts


def test_step_zero_row_survives_a_resume_and_goes_when_starting_afresh(tmp_path):
    cfg = MetricsConfig(tensorboard=False)
    first = MetricsLogger(tmp_path, cfg, enabled=True, run_config={})
    first.log(0, {"eval/sums/pass@1": 0.25})
    for step in (1, 2, 3):
        first.log(step, {"train/loss": float(step)})
    first.close()
    resumed = MetricsLogger(tmp_path, cfg, enabled=True, run_config={}, start_step=2)
    resumed.close()
    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1, 2]
    fresh = MetricsLogger(tmp_path, cfg, enabled=True, run_config={}, start_step=0)
    fresh.log(0, {"eval/sums/pass@1": 0.5})
    fresh.close()
    assert read_metrics(tmp_path) == [{"step": 0, "eval/sums/pass@1": 0.5}]


def test_step_zero_line_without_a_step_done(tmp_path, capsys):
    log = MetricsLogger(
        tmp_path, MetricsConfig(tensorboard=False), enabled=True, run_config={}, total_steps=4
    )
    log.log(0, {"eval/sums/pass@1": 0.25, "eval/sums/pass@4": 0.5})
    log.log(1, {"train/loss": 1.0})
    log.close()
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "step    0/4 | sums/pass@1 0.25"
    assert lines[1].startswith("step    1/4 | loss 1 | elapsed ")


def test_pass_at_k_is_plotted_beside_the_training_reward(tmp_path):
    rows = [{"step": 0, "eval/sums/pass@1": 0.2, "eval/sums/pass@4": 0.5, "eval/time_s": 1.0}]
    rows += [{"step": s, "rollout/reward_mean": 0.1 * s} for s in (1, 2)]
    rows.append({"step": 2, "eval/sums/pass@1": 0.4, "eval/sums/pass@4": 0.7})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    series = curves(read_metrics(tmp_path), "rollout/reward_mean")
    assert list(series) == ["rollout/reward_mean", "eval/sums/pass@1", "eval/sums/pass@4"]
    assert series["eval/sums/pass@4"] == [(0, 0.5), (2, 0.7)]
    (written,) = plot_run(tmp_path)
    assert written.name == "reward.png" and written.stat().st_size > 1000
