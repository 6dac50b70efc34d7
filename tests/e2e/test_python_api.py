"""``megatron_grpo.train`` from Python: the example of docs/python_api.md trains the CPU demo
in its own process with a TRL-style function object; an importable verl-style one trains on two
processes; a function defined in ``__main__`` cannot reach other processes and the error
says what to do."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from demo_run import ROOT

from megatron_grpo.api import TrainResult, build_config

EXAMPLE = ROOT / "examples" / "python_api.py"
SMALL = ("rollout.prompts_per_step=4", "rollout.samples_per_prompt=4", "metrics.tensorboard=false")


def run_example(assets: Path, out: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(EXAMPLE), "--assets", str(assets), "--out", str(out), *args]
    for item in SMALL:
        cmd += ["--set", item]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)


def documented_example(assets: Path, out: Path, steps: int) -> str:
    """The example of docs/python_api.md, on these assets, into ``out``, for ``steps``."""
    text = (ROOT / "docs" / "python_api.md").read_text()
    code = text.split("```python\n", 1)[1].split("```", 1)[0]
    for old, new in (
        ('"runs/cpu_demo/assets"', repr(str(assets))),
        ("train.total_steps=10", f"train.total_steps={steps}"),
        ("output_dir=runs/python_api", f"output_dir={out}"),
    ):
        assert old in code, old
        code = code.replace(old, new)
    return code


@pytest.mark.slow
def test_the_documented_example_trains_in_this_process(assets, tmp_path):
    out = tmp_path / "run"
    code = documented_example(assets, out, steps=2)
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=ROOT
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.splitlines()[-1].startswith(f"{out} ")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(0 <= r["rollout/reward_mean"] <= 1 for r in rows)
    config = (out / "config.yaml").read_text()
    # the function object was held in the example's process, called in TRL's style
    assert "custom_function: megatron_grpo.rewards.custom:in_process.accuracy\n" in config
    assert "label_name: null" in config  # the label is under its column, label


def test_a_main_function_cannot_reach_other_processes(assets, tmp_path):
    done = run_example(assets, tmp_path / "run", "--nproc", "2")
    assert done.returncode == 1
    error = done.stderr.strip().splitlines()[-1]
    assert error.startswith("ValueError: reward_fn accuracy cannot reach the 2 processes")
    assert "defined in __main__" in error and "module of its own" in error
    assert not (tmp_path / "run").exists()  # refused before anything started


DRIVER = """
import sys
sys.path.insert(0, {mods!r})  # as a notebook adds its source folder
from my_rewards import compute_score
from megatron_grpo import train

result = train({config!r}, {overrides!r}, reward_fn=compute_score, nproc=2)
print("final", result.final["step"], result.output_dir)
"""

VERL_REWARDS = """
import re


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    numbers = re.findall(r"-?[0-9]+", solution_str)
    correct = bool(numbers) and numbers[-1] == ground_truth
    return {"score": 1.0 if correct else 0.0, "acc": correct}
"""


@pytest.mark.slow
@pytest.mark.distributed
def test_an_importable_verl_function_trains_on_two_processes(assets, tmp_path):
    mods = tmp_path / "src"
    mods.mkdir()
    (mods / "my_rewards.py").write_text(VERL_REWARDS)
    out = tmp_path / "run"
    overrides = {
        "output_dir": str(out),
        "tokenizer": str(assets / "model"),
        "train.init": str(assets / "model"),
        "data.path": str(assets / "train.jsonl"),
        "train.total_steps": 2,
        "rollout.prompts_per_step": 4,
        "rollout.samples_per_prompt": 4,
        "metrics.tensorboard": False,
    }
    config = str(ROOT / "examples" / "cpu_demo" / "grpo.yaml")
    driver = DRIVER.format(mods=str(mods), config=config, overrides=overrides)
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(driver)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,  # the module is found through the driver's sys.path, not the cwd
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"final 2 {out}" in done.stdout
    assert "custom_function: my_rewards:compute_score" in (out / "config.yaml").read_text()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]


def test_overrides_as_a_list_or_a_mapping(tmp_path):
    listed = build_config(None, ["optim.lr=1e-6", "reward.custom_style=trl"])
    mapped = build_config({"optim": {"lr": 1e-6}}, {"reward.custom_style": "trl"})
    assert listed == mapped
    assert listed.optim.lr == 1e-6 and listed.reward.custom_style == "trl"
    assert build_config(listed, {"seed": 7}).seed == 7
    with pytest.raises(ValueError, match="unknown config key 'reward.style'"):
        build_config(None, {"reward.style": "trl"})


def test_train_is_callable_whatever_was_imported_first(tmp_path):
    import megatron_grpo.train.plan  # noqa: F401  (the training package, imported as usual)
    from megatron_grpo import train

    assert train is megatron_grpo.train and callable(train)
    assert train.plan is sys.modules["megatron_grpo.train.plan"]
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "r": 0.5}\n{"step": 2, "r": 0.75}\n')
    assert TrainResult.read(tmp_path).final == {"step": 2, "r": 0.75}
    with pytest.raises(ValueError, match="nproc must be >= 1"):
        train(nproc=0)


COUNT_SOURCES = """
import sys
from megatron_grpo import train
from megatron_grpo.train import loop, sources

calls = []
looked_up = sources.init_kind
sources.init_kind = lambda path: calls.append(path) or looked_up(path)
inner = loop.train
loop.train = lambda cfg: (calls.clear(), inner(cfg))[1]  # count inside train() only
assets = sys.argv[1]
train("examples/cpu_demo/grpo.yaml", [
    f"tokenizer={assets}/model", f"train.init={assets}/model",
    f"data.path={assets}/train.jsonl", "parallel.pp=1", "train.total_steps=2",
    "train.save_interval=1", f"output_dir={sys.argv[2]}", *sys.argv[3:],
])
print("init_kind calls:", len(calls))
"""


def test_the_tokenizer_and_model_sources_are_resolved_once_per_run(tmp_path, assets):
    """train() resolves where the weights and tokenizer come from once (RunInputs) and
    hands that to the learner, the reference model, the engines and the rollout parts."""
    argv = [sys.executable, "-c", COUNT_SOURCES, str(assets), str(tmp_path / "run"), *SMALL]
    done = subprocess.run(argv + ["loss.kl_coef=0.01"], capture_output=True, text=True,
                          timeout=600, cwd=ROOT)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "init_kind calls: 1"
