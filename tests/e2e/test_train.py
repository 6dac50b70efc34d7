"""End to end: GRPO on CPU with the embedded server; exact resume; replay across layouts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import demo_run
import pytest
import torch
from demo_run import ROOT, demo_argv

from megatron_grpo.launch import run_workers

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

WORKERS = demo_run.__file__  # worker functions, loaded by path in each process


def train(out: Path, assets: Path, *overrides: str, nproc: int = 2, timeout: int = 600):
    args = demo_argv(out, assets, *overrides, nproc=nproc)
    done = subprocess.run(args, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


# KL to a reference model, dynamic sampling, 2 optimizer steps per rollout and mu = 2 passes
RESUMABLE = (
    "train.save_interval=2",
    "advantages.dynamic_sampling=true",
    "loss.kl_coef=0.05",
    "train.global_batch_size=8",
    "train.num_iterations=2",
)
DETERMINISTIC = (
    "rollout/reward_mean",
    "rollout/response_length_mean",
    "train/loss",
    "train/grad_norm",
    "train/entropy",
    "train/kl",
)


EVAL_KEYS = ("eval/sums/pass@1", "eval/sums/pass@4", "eval/sums/reward_mean")


def with_eval(assets: Path) -> tuple[str, ...]:
    """Held-out sums at step 0 and every 2 steps, 4 samples per prompt, pass@1 and pass@4."""
    sums = f"{{name: sums, path: {assets / 'eval.jsonl'}, max_prompts: 8}}"
    return (f"eval.datasets=[{sums}]", "eval.interval=2", "eval.k=[1, 4]")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, assets):
    out = tmp_path_factory.mktemp("full")
    rows = train(out, assets, "train.total_steps=4", *RESUMABLE, *with_eval(assets))
    return out, rows


def test_end_to_end_run_logs_checkpoints_and_plots(uninterrupted):
    out, rows = uninterrupted
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    # the initial policy is evaluated as step 0, then every 2 steps in the step's row
    assert [r["step"] for r in rows if all(k in r for k in EVAL_KEYS)] == [0, 2, 4]
    assert all(0 <= r["eval/sums/pass@1"] <= r["eval/sums/pass@4"] <= 1 for r in rows[::2])
    assert any(r["eval/sums/pass@4"] > 0 for r in rows[::2])  # the resume test compares these
    rows = rows[1:]
    for key in (
        "rollout/reward_mean",
        "rollout/reward_std",
        "rollout/response_length_mean",
        "rollout/response_length_max",
        "rollout/truncated_fraction",
        "rollout/generated_tokens_per_s",
        "train/clip_fraction",
        "train/kl",
        "train/entropy",
        "train/grad_norm",
        "train/logprob_mismatch",
        "train/lr",
        "perf/train_tokens_per_s",
        "perf/time_rollout_s",
        "perf/time_train_s",
        "perf/time_sync_s",
    ):
        assert key in rows[-1], key
    assert all(
        k.split("/")[0] in ("rollout", "train", "perf", "eval") for k in rows[-1] if k != "step"
    )
    # the engine generates with the learner's weights: its log-probs are the learner's
    assert all(r["train/logprob_mismatch"] < 1e-4 for r in rows)
    assert (out / "checkpoints" / "latest").read_text() == "step_00000004"
    assert (out / "config.yaml").exists()
    done = subprocess.run(
        [sys.executable, "-m", "megatron_grpo.cli", "plot", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert (out / "reward.png").stat().st_size > 1000


def test_resume_continues_exactly(tmp_path, assets, uninterrupted):
    _, full = uninterrupted
    train(tmp_path, assets, "train.total_steps=2", *RESUMABLE, *with_eval(assets))
    # resumes from step 2, without evaluating step 0 again
    rows = train(tmp_path, assets, "train.total_steps=4", *RESUMABLE, *with_eval(assets))
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    assert_same_training(rows[3:], full[3:])
    for a, b in zip(rows, full, strict=True):  # every evaluation, before and after the resume
        for key in EVAL_KEYS:
            assert (key in a) == (key in b) and a.get(key) == pytest.approx(b.get(key)), key


def assert_same_training(rows: list[dict], expected: list[dict]) -> None:
    for a, b in zip(rows, expected, strict=True):
        for key in DETERMINISTIC:
            assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-9), (a["step"], key)


def test_resume_with_the_distributed_optimizer_continues_exactly(tmp_path, assets):
    """DP2 with Adam's state sharded over the ranks: the resumed steps are the
    uninterrupted run's (each parameter keeps its own Adam step count)."""
    distopt = (*RESUMABLE, "parallel.pp=1", "optim.use_distributed_optimizer=true")
    full = train(tmp_path / "full", assets, "train.total_steps=4", *distopt)
    train(tmp_path / "resumed", assets, "train.total_steps=2", *distopt)
    rows = train(tmp_path / "resumed", assets, "train.total_steps=4", *distopt)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert_same_training(rows[2:], full[2:])


def test_bad_dataset_rows_are_reported_and_skipped(tmp_path, assets):
    data = tmp_path / "mixed.jsonl"
    good = (assets / "train.jsonl").read_bytes().splitlines()[:50]
    bad = [
        b'{"label": "3"}',
        b'{"prompt": "", "label": "1"}',
        b'{"prompt": "\xff\xfe", "label": "2"}',
        b"not json",
    ]
    data.write_bytes(b"\n".join(good[:10] + bad + good[10:]) + b"\n")
    done = subprocess.run(
        demo_argv(
            tmp_path / "run",
            assets,
            f"data.path={data}",
            "parallel.pp=1",
            "train.total_steps=1",
            nproc=1,
        ),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    log = done.stdout + done.stderr
    for line in (11, 12, 13, 14):
        assert f"mixed.jsonl:{line}" in log or f"line {line}" in log, log[-3000:]


def test_replayed_step_gives_the_same_parameters_at_two_layouts(tmp_path, assets):
    sgd = (
        "optim.optimizer=sgd",
        "optim.lr=0.5",
        "optim.lr_warmup_steps=0",
        "optim.clip_grad=0",
        "train.total_steps=1",
    )
    train(tmp_path / "gen", assets, *sgd, f"rollout.dump_dir={tmp_path / 'dump'}")
    replay = (*sgd, f"rollout.replay_dir={tmp_path / 'dump'}")
    train(tmp_path / "dp2", assets, *replay, "parallel.pp=1", nproc=2)
    train(tmp_path / "tp2pp2", assets, *replay, "parallel.pp=2", "parallel.tp=2", nproc=4)
    states = [
        run_workers(
            f"{WORKERS}:full_params",
            1,
            timeout=200,
            kwargs={
                "ckpt": str(tmp_path / run / "checkpoints" / "step_00000001"),
                "config": str(tmp_path / run / "config.yaml"),  # the run's, model resolved
            },
        )[0]
        for run in ("dp2", "tp2pp2", "gen")
    ]
    scale = max(float(t.abs().max()) for t in states[0].values())
    for other in states[1:]:
        worst = max(float((other[k] - states[0][k]).abs().max()) for k in states[0])
        assert worst / scale < 1e-5

    # ... and the update equals a plain transformers implementation of the loss.
    from megatron_grpo.config import load_config
    from megatron_grpo.convert.weights import megatron_to_hf

    ref = run_workers(
        f"{WORKERS}:reference_update",
        1,
        timeout=200,
        kwargs={"init": str(assets / "model"), "dump": str(tmp_path / "dump"), "lr": 0.5},
    )[0]
    before = ref.pop("_before")
    after = megatron_to_hf(
        states[1], load_config(tmp_path / "tp2pp2" / "config.yaml").model, "qwen2"
    )
    update_scale = max(float(u.abs().max()) for u in ref.values())
    worst = max(float((after[k] - before[k] - ref[k]).abs().max()) for k in ref)
    assert worst / update_scale < 1e-4, worst / update_scale


def test_attached_sglang_servers_get_the_learners_weights_before_the_first_rollout(
    tmp_path, assets
):
    """A server attached with other weights than the policy's (a Megatron train.init, a
    resumed run; here a random model) is sent the learner's weights before step 1, so the
    rollout log-probs of step 1 are the learner's own."""
    import transformers

    from megatron_grpo.embedded.server import start_embedded_server

    torch.manual_seed(123)
    config = transformers.AutoConfig.from_pretrained(assets / "model")
    other = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    server = start_embedded_server(
        other, tokenizer=transformers.AutoTokenizer.from_pretrained(assets / "model")
    )
    try:
        rows = train(
            tmp_path,
            assets,
            "rollout.engines.type=sglang",
            f"rollout.engines.urls=[{server.url}]",
            "rollout.sync.method=disk",
            "train.total_steps=1",
        )
    finally:
        server.stop()
    assert rows[0]["train/logprob_mismatch"] < 1e-4, rows[0]


def test_overlapped_param_gather_serves_and_saves_the_updated_weights(tmp_path, assets):
    """DP2 with the distributed optimizer, parameter gather overlapped or not: after a step
    the engine holds (checked on every push) and generates with, and the checkpoint holds,
    the updated weights."""
    runs = {
        overlap: train(
            tmp_path / overlap,
            assets,
            "train.total_steps=2",
            "parallel.pp=1",
            "optim.use_distributed_optimizer=true",
            f"optim.overlap_param_gather={overlap}",
            "rollout.sync.check=true",  # each push read back from the engine
            nproc=2,
        )
        for overlap in ("true", "false")
    }
    # step 2 was generated after step 1's sync: the engine's log-probs are the learner's
    assert all(r["train/logprob_mismatch"] < 1e-4 for r in runs["true"]), runs["true"]
    for a, b in zip(runs["true"], runs["false"]):
        for key in DETERMINISTIC:
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), key
    states = [
        run_workers(
            f"{WORKERS}:full_params",
            1,
            timeout=200,
            kwargs={
                "ckpt": str(tmp_path / overlap / "checkpoints" / "step_00000002"),
                "config": str(tmp_path / overlap / "config.yaml"),
            },
        )[0]
        for overlap in ("true", "false")
    ]
    for name, tensor in states[0].items():
        assert torch.equal(tensor, states[1][name]), name
