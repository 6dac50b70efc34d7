"""End to end on a tiny Qwen3-MoE: the trainer's own loop (``megatron-grpo train``) from
replayed rollouts, single process and at DP2 x PP2 with EP2, the routers' balance loss on;
both end at the same parameters and log the same balance loss. With the distributed
optimizer (experts' states sharded over expert-DP) a resumed run continues bit for bit."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import demo_run
import pytest

from megatron_grpo.launch import run_workers

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
VOCAB = 100
OVERRIDES = (
    "model.make_vocab_size_divisible_by=8",
    "model.moe_aux_loss_coeff=0.05",
    "rollout.prompts_per_step=3",
    "rollout.samples_per_prompt=4",
    "train.global_batch_size=12",
    "train.total_steps=2",
    "train.max_tokens_per_micro_batch=64",
    "optim.optimizer=sgd",
    "optim.lr=0.1",
    "optim.clip_grad=0",
    "metrics.tensorboard=false",
)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, Path]:
    """A tiny random Qwen3-MoE as a Hugging Face directory, and two steps of rollouts."""
    from megatron_grpo.commands.invariance.cases import fixed_batch
    from megatron_grpo.rollout.stage import RolloutBatch, dump
    from megatron_grpo.testing import random_hf_model, tiny_hf_config

    root = tmp_path_factory.mktemp("moe_e2e")
    random_hf_model(tiny_hf_config("qwen3_moe", vocab_size=VOCAB)).save_pretrained(root / "hf")
    for step in (1, 2, 3):
        dump(RolloutBatch(fixed_batch(VOCAB, seed=step), {}), root / "dump", step)
    return {"hf": root / "hf", "dump": root / "dump", "root": root}


def metrics(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def train(inputs: dict[str, Path], name: str, nproc: int, *overrides: str) -> Path:
    out = inputs["root"] / name
    settings = (
        f"train.init={inputs['hf']}",
        f"rollout.replay_dir={inputs['dump']}",
        f"output_dir={out}",
        *OVERRIDES,
        *overrides,
    )
    argv = [sys.executable, "-m", "megatron_grpo.cli", "train", "--nproc", str(nproc)]
    done = subprocess.run(
        argv + [x for s in settings for x in ("--set", s)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return out


def final_params(out: Path) -> dict:
    (params,) = run_workers(
        f"{demo_run.__file__}:full_params",
        1,
        timeout=200,
        kwargs={
            "ckpt": str(out / "checkpoints" / "step_00000002"),
            "config": str(out / "config.yaml"),
        },
    )
    return params


def test_moe_trains_to_the_same_parameters_at_ep2(inputs):
    single = train(inputs, "single", 1)
    parallel = train(inputs, "dp2_pp2_ep2", 4, "parallel.pp=2", "parallel.ep=2")
    rows = [metrics(out) for out in (single, parallel)]
    for a, b in zip(*rows):
        assert a["train/moe_aux_loss"] > 0 and a["train/moe_max_load"] >= 1.0
        assert b["train/moe_aux_loss"] == pytest.approx(a["train/moe_aux_loss"], rel=1e-5)
        assert b["train/grad_norm"] == pytest.approx(a["train/grad_norm"], rel=1e-5)
    want, got = final_params(single), final_params(parallel)
    assert got.keys() == want.keys()
    scale = max(float(t.abs().max()) for t in want.values())
    worst = max(float((got[k] - want[k]).abs().max()) for k in want)
    print(
        f"DP2 x PP2 x EP2 vs single process after 2 steps: max |dp| / max |p| = {worst / scale:.2e}"
    )
    assert worst / scale < 1e-5


DISTOPT = (
    "parallel.pp=2",
    "parallel.ep=2",
    "optim.optimizer=adam",
    "optim.lr=1e-3",
    "optim.use_distributed_optimizer=true",
    "train.save_interval=1",
)


def test_moe_with_the_distributed_optimizer_resumes_bit_for_bit(inputs):
    whole = metrics(train(inputs, "whole", 4, *DISTOPT, "train.total_steps=3"))
    train(inputs, "resumed", 4, *DISTOPT, "train.total_steps=2")
    resumed = metrics(train(inputs, "resumed", 4, *DISTOPT, "train.total_steps=3"))
    assert [r["step"] for r in resumed] == [1, 2, 3]
    for key in ("train/loss", "train/grad_norm", "train/moe_aux_loss", "train/moe_max_load"):
        assert resumed[-1][key] == whole[-1][key], key


@pytest.fixture(scope="module")
def moe_assets(tmp_path_factory) -> Path:
    """The CPU demo's assets with the tiny Qwen3-MoE warmed up beside the dense model."""
    out = tmp_path_factory.mktemp("moe_assets")
    subprocess.run(
        [sys.executable, str(ROOT / "examples" / "cpu_demo" / "prepare.py"), "--out", str(out)]
        + ["--warmup-steps", "100", "--moe"],
        check=True,
        capture_output=True,
        timeout=600,
    )
    return out


@pytest.mark.timeout(900)
def test_the_cpu_demo_trains_a_tiny_moe_a_set_away(moe_assets, tmp_path):
    """The demo with ``--set train.init=<moe_model>`` (live rollouts from the embedded
    server, PP2): the model section follows the checkpoint, every weight push is read back
    from the engine, the engine's log-probs are the learner's, and the reward rises."""
    out = tmp_path / "run"
    argv = demo_run.demo_argv(
        out,
        moe_assets,
        f"train.init={moe_assets / 'moe_model'}",
        "rollout.prompts_per_step=32",
        "rollout.samples_per_prompt=8",
        "train.total_steps=24",
        "rollout.sync.check=true",
    )
    done = subprocess.run(argv, capture_output=True, text=True, timeout=800, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    resolved = (out / "config.yaml").read_text()
    assert "hf_family: qwen3_moe" in resolved and "num_experts: 4" in resolved
    rows = metrics(out)
    assert [r["step"] for r in rows] == list(range(1, 25))
    assert max(r["train/logprob_mismatch"] for r in rows) < 1e-5
    reward = [r["rollout/reward_mean"] for r in rows]
    first, last = sum(reward[:5]) / 5, sum(reward[-5:]) / 5
    assert last > first + 0.03, (first, last, reward)
