"""How a run starts in its output directory: fresh, resumed, complete, or refused."""

import dataclasses
from pathlib import Path

import pytest

from megatron_grpo.config import Config, dump_config, load_config
from megatron_grpo.config.learner import OptimConfig, TrainConfig
from megatron_grpo.train.run_start import (
    ConfigChangedError,
    config_changes,
    plan_start,
    record_start,
)


def config(out: Path, *, steps=40, lr=1e-6, allow=False, **train) -> Config:
    return Config(
        output_dir=str(out),
        optim=OptimConfig(lr=lr),
        train=TrainConfig(total_steps=steps, allow_config_change=allow, **train),
    )


def checkpointed(out: Path, step: int, cfg: Config) -> None:
    """An output directory as a run leaves it: config.yaml and a complete checkpoint."""
    ckpt = out / "checkpoints" / f"step_{step:08d}"
    ckpt.mkdir(parents=True)
    (ckpt / "metadata.json").write_text("{}")
    (out / "checkpoints" / "latest").write_text(ckpt.name)
    (out / "config.yaml").write_text(dump_config(cfg))


def test_a_new_output_directory_starts_fresh_and_says_so(tmp_path):
    cfg = config(tmp_path / "run")
    start = plan_start(cfg)
    assert (start.kind, start.step) == ("fresh", 0)
    assert start.describe(cfg) == f"megatron-grpo: starting a new run in {tmp_path}/run (40 steps)"


def test_a_complete_run_says_so(tmp_path):
    cfg = config(tmp_path)
    checkpointed(tmp_path, 40, cfg)
    start = plan_start(cfg)
    assert (start.kind, start.step, start.changed) == ("complete", 40, {})
    assert "is complete (step 40 of 40); nothing to train" in start.describe(cfg)


def test_a_resume_may_go_on_longer_and_keeps_its_config_beside_the_first(tmp_path):
    first = config(tmp_path)
    checkpointed(tmp_path, 40, first)
    saved = (tmp_path / "config.yaml").read_bytes()
    longer = config(tmp_path, steps=60, save_interval=10)
    start = plan_start(longer)
    assert start.kind == "resume" and start.step == 40
    assert start.changed == {"train.total_steps": (40, 60), "train.save_interval": (0, 10)}
    assert start.describe(longer).endswith(
        "to step 60; train.save_interval: 0 -> 10; train.total_steps: 40 -> 60"
    )
    record_start(longer, start)
    assert (tmp_path / "config.yaml").read_bytes() == saved
    assert (tmp_path / "config.resume_step_00000040.yaml").read_text() == dump_config(longer)


def test_a_resume_with_another_learning_rate_is_refused_by_name(tmp_path):
    checkpointed(tmp_path, 40, config(tmp_path, steps=40))
    with pytest.raises(ConfigChangedError) as e:
        plan_start(config(tmp_path, steps=80, lr=1e-4))
    assert "differs in optim.lr (1e-06 -> 0.0001)" in str(e.value)
    assert "--allow-config-change" in str(e.value)
    start = plan_start(config(tmp_path, steps=80, lr=1e-4, allow=True))
    assert start.changed["optim.lr"] == (1e-6, 1e-4)


def test_the_next_resume_compares_with_the_last_resume_config(tmp_path):
    checkpointed(tmp_path, 40, config(tmp_path))
    changed = config(tmp_path, steps=80, lr=1e-4, allow=True)
    record_start(changed, plan_start(changed))
    again = plan_start(config(tmp_path, steps=80, lr=1e-4))  # as the last resume had it
    assert again.changed == {}


def test_keys_only_one_side_has_are_not_compared():
    assert config_changes({"a": {"b": 1, "old": 2}}, {"a": {"b": 1, "new": 3}}) == {}
    assert config_changes({"a": {"b": [1, 2]}}, {"a": {"b": (1, 2)}}) == {}


OLD_SAVED = Path(__file__).resolve().parents[1] / "fixtures" / "old_configs" / "saved_run.yaml"
"""A config.yaml written before the rollout and reward keys were nested."""


def saved_with_the_old_keys(out: Path) -> Config:
    """``out`` as a run with ``OLD_SAVED`` as its config leaves it at step 20; that config
    in today's keys."""
    checkpointed(out, 20, Config())
    text = OLD_SAVED.read_text().replace("output_dir: runs/old_layout", f"output_dir: {out}")
    (out / "config.yaml").write_text(text)
    return load_config(None, [f"output_dir={out}", *SAVED_AS_NEW])


SAVED_AS_NEW = [
    "train.total_steps=40",
    "rollout.engines.type=sglang",
    "rollout.engines.urls=[http://127.0.0.1:30000]",
    "rollout.sampling.temperature=0.7",
    "rollout.sampling.top_k=20",
    "rollout.sync.method=distributed",
    "rollout.sync.bucket_mb=256",
    "rollout.client.request_timeout_s=300",
    "reward.format.pattern=.*answer.*",
    "reward.format.weight=0.1",
    "reward.remote.timeout_s=10",
    "optim.use_distributed_optimizer=true",
]
"""The overrides ``OLD_SAVED`` was made with, by today's names."""


def test_a_run_saved_with_the_old_keys_resumes_under_the_new_ones(tmp_path):
    cfg = saved_with_the_old_keys(tmp_path)
    start = plan_start(cfg)
    assert (start.kind, start.step, start.changed) == ("resume", 20, {})
    record_start(cfg, start)  # nothing changed: no resume config beside it
    assert not list(tmp_path.glob("config.resume_step_*.yaml"))
    longer = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, total_steps=60))
    assert plan_start(longer).changed == {"train.total_steps": (40, 60)}


def test_a_change_to_a_moved_key_is_refused_by_its_new_name(tmp_path):
    cfg = saved_with_the_old_keys(tmp_path)
    sampling = dataclasses.replace(cfg.rollout.sampling, temperature=0.9)
    hotter = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, sampling=sampling))
    with pytest.raises(
        ConfigChangedError, match=r"rollout\.sampling\.temperature \(0\.7 -> 0\.9\)"
    ):
        plan_start(hotter)
    # a moved time limit may change on resume, as any *_timeout_s may
    patient = [f"output_dir={tmp_path}", *SAVED_AS_NEW, "rollout.client.request_timeout_s=900"]
    changed = plan_start(load_config(None, patient)).changed
    assert changed == {"rollout.client.request_timeout_s": (300.0, 900.0)}
