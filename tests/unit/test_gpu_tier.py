"""The GPU tier as a machine without a GPU sees it: its tests are collected (without
importing Transformer Engine or SGLang) and skipped naming the missing device; its script's
dry run prints the set-up, the parts and their budgets and installs nothing; its report
writer fills docs/benchmarks.md's blocks from results and leaves the other block alone."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
PARTS = ("layer_specs", "invariance", "context_parallel", "sglang", "demo")


def _pytest(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )


def test_the_tier_is_collected_without_cuda_only_imports():
    code = (
        "import sys, pytest\n"
        "pytest.main(['-q', '-p', 'no:cacheprovider', '-m', 'gpu', '--collect-only', "
        "'tests/gpu'])\n"
        "print('IMPORTED', sorted(m for m in ('transformer_engine', 'sglang') if m in sys.modules))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=240
    )
    assert "IMPORTED []" in done.stdout, done.stdout[-2000:]
    for name in ("layer_specs", "invariance", "context_parallel", "sglang", "demo"):
        assert f"tests/gpu/test_gpu_{name}.py::" in done.stdout, done.stdout[-2000:]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: the tier runs")
def test_every_tier_test_is_skipped_naming_the_missing_device():
    done = _pytest("-m", "gpu", "-rs", "tests/gpu")
    assert done.returncode == 0, done.stdout[-3000:]
    summary = done.stdout.strip().splitlines()[-1]
    assert "skipped" in summary and "passed" not in summary and "failed" not in summary, summary
    reasons = [line for line in done.stdout.splitlines() if line.startswith("SKIPPED")]
    assert reasons and all("needs an NVIDIA CUDA GPU" in r for r in reasons), reasons


def test_dry_run_prints_the_plan_and_budgets_and_installs_nothing(tmp_path):
    env = {
        **os.environ,
        "HOME": str(tmp_path / "home"),
        "GPU_VENV": str(tmp_path / "venv-gpu"),
        "SGLANG_GPU_VENV": str(tmp_path / "venv-sglang"),
    }
    done = subprocess.run(
        ["bash", "scripts/test_gpu.sh", "--dry-run"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "nothing is installed or run" in out
    for step in ("torch", "project", "transformer_engine", "sglang"):
        assert f"setup_gpu_env: {step}: would install" in out, out
    assert "sglang==0.5.23" in out and "transformer-engine[pytorch]" in out
    budgets = {}
    for line in out.splitlines():
        if line.startswith("test_gpu: part "):
            name, budget = line.split()[2].rstrip(","), int(line.split("budget ")[1].split()[0])
            budgets[name] = budget
    assert set(budgets) == set(PARTS), out
    assert "total budget 600 s of 600 s" in out
    assert 90 + sum(budgets.values()) == 600
    assert not list(tmp_path.iterdir()), "the dry run created something"


def _report():
    spec = importlib.util.spec_from_file_location("gpu_report", ROOT / "bench" / "gpu_report.py")
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module


ENV = {"device": "NVIDIA H200", "gpus": 1, "torch": "2.14.1", "transformer_engine": "2.11.0"}
TESTS = {
    "date": "2030-01-02",
    "environment": ENV,
    "parts": {"layer_specs": {"status": "passed", "seconds": 41, "budget_s": 70}},
    "layer_specs": {
        "cases": {
            "dense/bfloat16": {
                "logits": {"max_rel": 0.01, "norm_rel": 0.004},
                "grads": {"max_rel": 0.02, "norm_rel": 0.008},
            }
        }
    },
    "nccl_two_ranks_one_gpu": {"allowed": False, "message": "Duplicate GPU detected"},
    "sglang": {
        "phases": {
            "initial": {
                "tokens": 256,
                "mismatch_mean": 0.01,
                "mismatch_p99": 0.1,
                "mismatch_max": 0.3,
            }
        },
        "pushes": {"tensor": {"s": 0.1, "gb_per_s": 1.5}, "distributed": {"error": "refused"}},
    },
}
BENCH = {
    "bench": "gpu",
    "gpu": True,
    "date": "2030-01-03",
    "environment": ENV,
    "mfu": {"mfu": 0.41, "tokens_per_s": 1e5, "grpo_step/ce_step": {"median": 1.04}},
    "sglang": {
        "generation": {"tokens_per_s": [5e4, 5.1e4], "client/direct": {"median": 0.97}},
        "weight_sync": {"gb_per_s": [20.0], "push/one_request": {"median": 1.3}},
    },
}


def test_the_committed_doc_says_no_gpu_has_run_the_tier():
    report = _report()
    doc = (ROOT / "docs" / "benchmarks.md").read_text()
    for block in report.BLOCKS:
        assert report.NOT_RUN[block] in report._block(doc, block)
    assert "| GPU |" in doc and "not yet run on a GPU" in doc


def test_each_run_writes_its_own_block_with_date_and_device(tmp_path):
    report = _report()
    doc = tmp_path / "benchmarks.md"
    doc.write_text((ROOT / "docs" / "benchmarks.md").read_text())
    (tmp_path / "tests.json").write_text(json.dumps(TESTS))
    (tmp_path / "bench.json").write_text(json.dumps(BENCH))
    (tmp_path / "none.json").write_text(json.dumps({"bench": "gpu", "gpu": False}))

    report.main(["--tests", str(tmp_path / "tests.json"), "--doc", str(doc)])
    text = doc.read_text()
    tests_block = report._block(text, "tests")
    assert (
        "**2030-01-02**, NVIDIA H200" in tests_block and "| layer_specs | passed |" in tests_block
    )
    assert "mismatch mean 0.01" in tests_block and "Duplicate GPU detected" in tests_block
    assert report.NOT_RUN["bench"] in report._block(text, "bench")
    assert "run (tests): figures in the GPU tier section" in text

    report.main(["--bench", str(tmp_path / "bench.json"), "--doc", str(doc)])
    text = doc.read_text()
    assert report._block(text, "tests") == tests_block  # the other block stays
    bench_block = report._block(text, "bench")
    assert "**2030-01-03**" in bench_block and "cross-entropy step: 1.04" in bench_block
    assert "client / one direct batched /generate: 0.97" in bench_block
    assert "run (tests, bench)" in text

    before = doc.read_text()
    report.main(["--bench", str(tmp_path / "none.json"), "--doc", str(doc)])
    assert doc.read_text() == before  # a run without a GPU changes nothing
