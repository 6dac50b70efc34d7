import io
import json
import re
import subprocess
import sys

import pytest

from megatron_grpo.config import MetricsConfig
from megatron_grpo.metrics import (
    NAMESPACES,
    STDOUT_KEYS,
    MetricsLogger,
    format_line,
    namespaced,
    plot_run,
    read_metrics,
)
from megatron_grpo.weight_sync.stream import buckets


def test_jsonl_tensorboard_and_plots(tmp_path, capsys):
    log = MetricsLogger(tmp_path, MetricsConfig(tensorboard=True), enabled=True, run_config={})
    for step in (1, 2, 3):
        log.log(
            step,
            {
                "rollout/reward_mean": 0.1 * step,
                "rollout/response_length_mean": 3.0 + step,
                "train/loss": 0.5,
            },
        )
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
    log.log(1, {"train/loss": 1.0})
    assert not (tmp_path / "x").exists()


def test_plot_errors_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="no metrics file"):
        plot_run(tmp_path)
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "train/loss": 1.0}) + "\n")
    with pytest.raises(ValueError, match="no reward or length metrics"):
        plot_run(tmp_path)


def test_plot_names_the_file_and_line_of_a_bad_row(tmp_path):
    good = json.dumps({"step": 1, "rollout/reward_mean": 0.5})
    (tmp_path / "metrics.jsonl").write_text(f'{good}\n{{"step": 2, "rollout/rew\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: not a JSON row"):
        plot_run(tmp_path)


def test_a_resumed_run_logs_from_its_checkpoint_without_duplicates(tmp_path):
    """Steps 1-4 were logged and the last line was cut short by a kill; the checkpoint is
    at step 2: the resumed logger keeps steps 1-2 and its step 3 replaces the old one, in
    metrics.jsonl and in TensorBoard."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = MetricsConfig(tensorboard=True)
    first = MetricsLogger(tmp_path, cfg, enabled=True, run_config={})
    for step in (1, 2, 3, 4):
        first.log(step, {"train/loss": float(step)})
    first.close()
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 5, "train/lo')
    resumed = MetricsLogger(tmp_path, cfg, enabled=True, run_config={}, start_step=2)
    resumed.log(3, {"train/loss": 30.0})
    resumed.close()
    rows = read_metrics(tmp_path)
    assert [(r["step"], r["train/loss"]) for r in rows] == [(1, 1.0), (2, 2.0), (3, 30.0)]
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    scalars = [(e.step, e.value) for e in events.Scalars("train/loss")]
    assert scalars == [(1, 1.0), (2, 2.0), (3, 30.0)]


def test_format_line_skips_missing_and_nan():
    assert format_line(5, {"train/loss": float("nan"), "train/kl": 0.25}) == "step    5 | kl 0.25"
    assert format_line(5, {"train/kl": 0.25}, total_steps=40) == "step    5/40 | kl 0.25"
    assert format_line(5, {"kl": 0.25}) == "step    5", "names outside a namespace are not shown"


def test_metric_names_are_grouped_by_concern():
    assert namespaced("train", {"loss": 1.0}) == {"train/loss": 1.0}
    assert all(k.split("/")[0] in NAMESPACES for k in STDOUT_KEYS)


LOG_THREE_STEPS = """
import sys
from megatron_grpo.config import MetricsConfig
from megatron_grpo.metrics import MetricsLogger

log = MetricsLogger(sys.argv[1], MetricsConfig(tensorboard=False), enabled=True,
                    run_config={}, total_steps=4, start_step=1)
for step in (2, 3, 4):
    log.log(step, {"rollout/reward_mean": 0.25 * step, "train/loss": 0.5})
log.close()
"""


def test_redirected_output_has_one_plain_line_per_step(tmp_path):
    """As under ``> run.log 2>&1``: stdout and stderr into one file, no terminal."""
    log_file = tmp_path / "run.log"
    with log_file.open("w") as f:
        subprocess.run(
            [sys.executable, "-c", LOG_THREE_STEPS, str(tmp_path / "run")],
            stdout=f,
            stderr=subprocess.STDOUT,
            check=True,
            timeout=120,
        )
    text = log_file.read_bytes().decode()  # read_text() would turn a "\r" into a line break
    assert "\r" not in text, f"carriage returns of a progress bar in the log:\n{text!r}"
    lines = text.splitlines()
    assert [line.split(" | ")[0] for line in lines] == ["step    2/4", "step    3/4", "step    4/4"]
    assert lines[1].startswith("step    3/4 | reward_mean 0.75 | loss 0.5 | elapsed "), lines[1]
    times = r" \| elapsed \d\d:\d\d \| remaining \d\d:\d\d$"
    assert all(re.search(times, line) for line in lines), text
    assert lines[-1].endswith("| remaining 00:00"), lines[-1]


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("tty", [True, False])
def test_progress_bar_only_on_a_terminal(tmp_path, monkeypatch, tty):
    stream = FakeTerminal if tty else io.StringIO
    out, err = stream(), stream()
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err)
    log = MetricsLogger(
        tmp_path, MetricsConfig(tensorboard=False), enabled=True, run_config={}, total_steps=2
    )
    for step in (1, 2):
        log.log(step, {"rollout/reward_mean": 0.5, "train/kl": 0.25})
    log.close()
    lines = out.getvalue().splitlines()
    if tty:  # the bar on stderr, the step lines above it as format_line writes them
        assert "GRPO steps" in err.getvalue() and "\r" in err.getvalue(), err.getvalue()
        assert "2/2" in err.getvalue(), err.getvalue()
        assert lines == [
            "step    1 | reward_mean 0.5 | kl 0.25",
            "step    2 | reward_mean 0.5 | kl 0.25",
        ]
    else:
        assert err.getvalue() == ""
        assert [line.split(" | elapsed ")[0] for line in lines] == [
            "step    1/2 | reward_mean 0.5 | kl 0.25",
            "step    2/2 | reward_mean 0.5 | kl 0.25",
        ]


def test_weight_buckets_are_size_bounded():
    import torch

    named = {f"w{i}": torch.zeros(10) for i in range(5)}  # 40 bytes each
    sizes = [list(b) for b in buckets(named, max_bytes=100)]
    assert sizes == [["w0", "w1"], ["w2", "w3"], ["w4"]]
    big = {"a": torch.zeros(100), "b": torch.zeros(1)}
    assert [list(b) for b in buckets(big, max_bytes=10)] == [["a"], ["b"]]


def test_an_all_masked_batch_reports_its_token_means_as_not_measured(tmp_path, capsys):
    """No loss token in the global batch: entropy, KL and the fractions are null in
    metrics.jsonl and left off the step line, not a 0.0 that reads as a measurement."""
    from types import SimpleNamespace

    from megatron_grpo.algo.loss import METRIC_MAXES, METRIC_SUMS
    from megatron_grpo.train.step import reduce_metrics

    single = SimpleNamespace(is_last_stage=True, tp_rank=0, world_size=1)
    zeros = dict.fromkeys(METRIC_SUMS + METRIC_MAXES, 0.0)
    metrics = reduce_metrics([{"loss": 0.0, **zeros}], single)
    assert metrics["loss_tokens"] == 0 and metrics["loss"] == 0.0
    names = ("entropy", "kl", "clip_fraction", "is_rejected_fraction")
    for name in names + ("logprob_mismatch", "logprob_mismatch_max", "rollout_kl"):
        assert metrics[name] is None, name
    log = MetricsLogger(tmp_path, MetricsConfig(tensorboard=True), enabled=True, run_config={})
    log.log(1, namespaced("train", metrics))
    log.close()
    assert read_metrics(tmp_path)[0]["train/entropy"] is None
    assert "entropy" not in capsys.readouterr().out


def test_train_metrics_are_means_over_the_optimizer_steps_with_the_last_beside_them():
    from megatron_grpo.metrics import over_optimizer_steps

    history = [
        {"loss": 1.0, "grad_norm": 4.0, "kl": None},
        {"loss": 2.0, "grad_norm": 2.0, "kl": None},
        {"loss": 6.0, "grad_norm": None, "kl": None},
    ]
    assert over_optimizer_steps(history) == {
        "loss": 3.0,
        "grad_norm": 3.0,  # the steps that have one
        "kl": None,
        "last_step/loss": 6.0,
        "last_step/grad_norm": None,
        "last_step/kl": None,
        "optimizer_steps": 3.0,
    }
