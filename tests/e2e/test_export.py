"""Acceptance: a trained run exports to Hugging Face in one command.

The CPU demo trains 3 steps (PP=2) with ``train.save_hf_interval=2``, its dense model
and its tiny Qwen3-MoE; then
``megatron-grpo convert megatron-to-hf --megatron-dir <run>`` exports its latest checkpoint.
transformers and the embedded rollout engine load the export and give the learner's
log-probs (the trainer's forward on the run's checkpoint, at the run's layout), and the
model the trainer wrote at the last step holds the export's tensors, bit for bit.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from demo_run import ROOT, demo_argv

from megatron_grpo.launch import run_workers

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

WORKER = Path(__file__).with_name("learner_logprobs.py")
STEPS = 3
LOGPROB_TOLERANCE = 1e-5
PROMPTS = ["6+6=", "0+4=", "8+7=", "3+9="]


def safetensors_state(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        out |= load_file(file)
    return out


def export(megatron_dir: Path, out: Path) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "megatron_grpo.cli", "convert", "megatron-to-hf"]
    argv += ["--megatron-dir", str(megatron_dir), "--out", str(out)]
    return subprocess.run(argv, capture_output=True, text=True, timeout=240, cwd=ROOT)


@pytest.fixture(scope="module")
def moe_assets(tmp_path_factory) -> Path:
    """The demo's assets with its tiny Qwen3-MoE (``prepare.py --moe``)."""
    out = tmp_path_factory.mktemp("moe_assets")
    prepare = [sys.executable, str(ROOT / "examples" / "cpu_demo" / "prepare.py")]
    prepare += ["--out", str(out), "--warmup-steps", "30", "--moe"]
    subprocess.run(prepare, check=True, capture_output=True, timeout=300)
    return out


@pytest.fixture(scope="module", params=["dense", "moe"])
def run(request, tmp_path_factory) -> tuple[Path, Path]:
    """(the run's directory, the Hugging Face model it started from)."""
    if request.param == "dense":
        init = request.getfixturevalue("assets") / "model"
    else:
        init = request.getfixturevalue("moe_assets") / "moe_model"
    out = tmp_path_factory.mktemp(f"run_{request.param}")
    argv = demo_argv(
        out,
        init.parent,
        f"train.init={init}",
        f"train.total_steps={STEPS}",
        "train.save_hf_interval=2",
    )
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return out, init


@pytest.fixture(scope="module")
def exported(run, tmp_path_factory) -> Path:
    run_dir, _ = run
    out = tmp_path_factory.mktemp("export") / "trained"
    done = export(run_dir, out)
    assert done.returncode == 0, done.stderr[-5000:]
    checkpoint = run_dir / "checkpoints" / f"step_{STEPS:08d}"
    assert done.stdout.strip() == f"wrote {out} from {checkpoint}"
    return out


def engine_samples(model_dir: Path, prompts: list[list[int]]) -> list[tuple[list[int], list]]:
    """(prompt + completion, the engine's log-prob of each completion token) of one sampled
    completion of each prompt, from the embedded engine serving ``model_dir``."""
    from megatron_grpo.embedded.server import start_embedded_server
    from megatron_grpo.rollout.client import ClientConfig, SGLangClient
    from megatron_grpo.sglang_api.types import RolloutRequest, SamplingParams

    server = start_embedded_server(model_dir)
    try:
        request = RolloutRequest(
            prompts=tuple(tuple(p) for p in prompts),
            sampling=SamplingParams(max_new_tokens=6, temperature=1.0, ignore_eos=True, seed=7),
        )

        async def generate():
            async with SGLangClient(ClientConfig(urls=(server.url,))) as client:
                return await client.generate(request)

        samples = asyncio.run(generate())
    finally:
        server.stop()
    return [(list(s.prompt_ids) + list(s.output_ids), list(s.rollout_logprobs)) for s in samples]


def transformers_logprobs(model_dir: Path, sequence: list[int]) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        logits = model(torch.tensor([sequence])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(sequence[1:])[:, None])[:, 0]


def test_the_export_gives_the_learners_logprobs_in_transformers_and_the_engine(run, exported):
    run_dir, _ = run
    tokenizer = transformers.AutoTokenizer.from_pretrained(exported)
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    samples = engine_samples(exported, prompts)
    sequences = [tokens for tokens, _ in samples]
    results = run_workers(
        f"{WORKER}:learner_logprobs",
        2,
        kwargs={
            "config": str(run_dir / "config.yaml"),
            "checkpoint": str(run_dir / "checkpoints" / f"step_{STEPS:08d}"),
            "sequences": sequences,
        },
        timeout=240,
    )
    (learner,) = [r for r in results if r is not None]  # the last pipeline stage's
    worst_hf = worst_engine = 0.0
    for (tokens, engine), want in zip(samples, learner, strict=True):
        want = torch.tensor(want)
        got = transformers_logprobs(exported, tokens)
        worst_hf = max(worst_hf, (got - want).abs().max().item())
        completion = want[len(tokens) - 1 - len(engine) :]
        worst_engine = max(worst_engine, (torch.tensor(engine) - completion).abs().max().item())
    print(
        f"max |log-prob - learner's| over {sum(len(t) - 1 for t in sequences)} tokens: "
        f"transformers {worst_hf:.2e}; engine {worst_engine:.2e} "
        f"({sum(len(e) for _, e in samples)} sampled tokens)"
    )
    assert worst_hf < LOGPROB_TOLERANCE and worst_engine < LOGPROB_TOLERANCE


def test_the_export_has_config_generation_config_and_tokenizer(run, exported):
    """The run started from a Hugging Face model: its config (in the run's dtype),
    generation config and tokenizer come back."""
    _, init = run
    config, source = (json.loads((d / "config.json").read_text()) for d in (exported, init))
    assert config == source | {"dtype": "float32"}
    for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (exported / name).read_bytes() == (init / name).read_bytes(), name
    generation = transformers.GenerationConfig.from_pretrained(exported)
    tokenizer = transformers.AutoTokenizer.from_pretrained(exported)
    assert generation.eos_token_id == tokenizer.eos_token_id is not None


def test_save_hf_interval_writes_the_exports_tensors(run, exported):
    """Steps 2 (the interval) and 3 (the last); step 3's tensors are the export's, each
    pipeline stage's layers in a file of its own."""
    run, _ = run
    assert sorted(p.name for p in (run / "hf").iterdir()) == ["step_00000002", "step_00000003"]
    saved = run / "hf" / f"step_{STEPS:08d}"
    index = json.loads((saved / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]
    want, got = safetensors_state(exported), safetensors_state(saved)
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) and got[k].dtype == want[k].dtype for k in want)
    for name in ("config.json", "generation_config.json", "tokenizer.json"):
        assert (saved / name).read_bytes() == (exported / name).read_bytes(), name
    step2 = safetensors_state(run / "hf" / "step_00000002")
    assert not all(torch.equal(step2[k], want[k]) for k in want)  # step 3 trained on


@pytest.mark.parametrize("run", ["dense"], indirect=True)
def test_a_checkpoint_of_the_run_exports_alike(run, exported, tmp_path):
    """``--megatron-dir <run>/checkpoints/step_N`` takes the run's config and tokenizer."""
    run, _ = run
    checkpoint = run / "checkpoints" / f"step_{STEPS:08d}"
    done = export(checkpoint, tmp_path / "out")
    assert done.returncode == 0, done.stderr[-5000:]
    want, got = safetensors_state(exported), safetensors_state(tmp_path / "out")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    for name in ("config.json", "generation_config.json", "tokenizer.json"):
        assert (tmp_path / "out" / name).read_bytes() == (exported / name).read_bytes(), name
