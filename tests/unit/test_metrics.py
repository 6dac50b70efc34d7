import json

import pytest

from megatron_grpo.config import MetricsConfig
from megatron_grpo.metrics import MetricsLogger, format_line, plot_run, read_metrics
from megatron_grpo.rollout.weight_sync import buckets


def test_jsonl_tensorboard_and_plots(tmp_path, capsys):
    log = MetricsLogger(tmp_path, MetricsConfig(tensorboard=True), enabled=True, run_config={})
    for step in (1, 2, 3):
        log.log(step, {"reward_mean": 0.1 * step, "response_length_mean": 3.0 + step, "loss": 0.5})
    log.close()
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert "step    2 | reward_mean 0.2" in capsys.readouterr().out
    assert any((tmp_path / "tensorboard").iterdir())
    written = plot_run(tmp_path)
    assert sorted(p.name for p in written) == ["response_length.png", "reward.png"]
    assert all(p.stat().st_size > 1000 for p in written)


def test_disabled_logger_writes_nothing(tmp_path):
    log = MetricsLogger(tmp_path / "x", MetricsConfig(), enabled=False, run_config={})
    log.log(1, {"loss": 1.0})
    assert not (tmp_path / "x").exists()


def test_plot_errors_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="no metrics file"):
        plot_run(tmp_path)
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 1.0}) + "\n")
    with pytest.raises(ValueError, match="no reward or length metrics"):
        plot_run(tmp_path)


def test_format_line_skips_missing_and_nan():
    assert format_line(5, {"loss": float("nan"), "kl": 0.25}) == "step    5 | kl 0.25"


def test_weight_buckets_are_size_bounded():
    import torch

    named = {f"w{i}": torch.zeros(10) for i in range(5)}  # 40 bytes each
    sizes = [list(b) for b in buckets(named, max_bytes=100)]
    assert sizes == [["w0", "w1"], ["w2", "w3"], ["w4"]]
    big = {"a": torch.zeros(100), "b": torch.zeros(1)}
    assert [list(b) for b in buckets(big, max_bytes=10)] == [["a"], ["b"]]
