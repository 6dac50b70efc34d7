"""Write the GPU tier's figures into docs/benchmarks.md, with the date and the device.

    python bench/gpu_report.py --tests runs/gpu_tier/results.json   # scripts/test_gpu.sh
    python bench/gpu_report.py --bench bench/results/gpu.json       # bench/gpu.sh

The section "GPU tier" of docs/benchmarks.md holds two generated blocks, each between
its own markers: the tests' (``tests/gpu``, run by scripts/test_gpu.sh) and the
benchmark's (bench/gpu.sh). Each run rewrites only its own block, so the other's figures
stay; the summary table's "GPU" row is rewritten from both. A results file that says no
GPU was present changes nothing. No torch here: plain JSON in, Markdown out.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

DOC = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"
BLOCKS = ("tests", "bench")
NOT_RUN = {
    "tests": "No GPU has run `bash scripts/test_gpu.sh` yet: every test of `tests/gpu` has only "
    "been collected, and skipped, on machines without CUDA.",
    "bench": "No GPU has run `bash bench/gpu.sh` yet: no MFU, SGLang tokens/s or weight-push "
    "GB/s has been measured.",
}
SUMMARY_ROW = "| GPU |"


def markers(block: str) -> tuple[str, str]:
    return (
        f"<!-- gpu-tier:{block}:begin (bench/gpu_report.py writes this block) -->",
        f"<!-- gpu-tier:{block}:end -->",
    )


def _num(x: Any, digits: int = 3) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{digits}g}"
    return str(x)


def _header(run: dict[str, Any]) -> list[str]:
    env = run.get("environment", {})
    parts = [f"**{run.get('date', 'undated')}**, {env.get('device', 'unknown device')}"]
    for key in ("gpus", "torch", "transformer_engine", "sglang", "nccl", "commit"):
        if env.get(key) is not None:
            parts.append(f"{key.replace('_', ' ')} {env[key]}")
    return [", ".join(parts) + ".", ""]


def render_tests(run: dict[str, Any]) -> list[str]:
    """The tests block: each part's status and time against its budget, then the figures."""
    out = _header(run)
    out += ["| part | status | seconds (budget) |", "| --- | --- | --- |"]
    for name, part in run.get("parts", {}).items():
        seconds = f"{_num(part.get('seconds'))} ({_num(part.get('budget_s'))})"
        out.append(f"| {name} | {part.get('status', '-')} | {seconds} |")
    out += ["", "| check | figure |", "| --- | --- |"]
    for case, e in run.get("layer_specs", {}).get("cases", {}).items():
        cells = ", ".join(
            f"{what} max {_num(e[what]['max_rel'])} / norm {_num(e[what]['norm_rel'])}"
            for what in ("logits", "grads", "thd_logprobs", "thd_grads")
            if what in e
        )
        out.append(f"| TE spec vs local spec, {case} (relative to the local spec) | {cells} |")
    inv = run.get("invariance_1x1x1_bf16")
    if inv:
        out.append(
            f"| check-invariance 1x1x1, bf16, TE spec, every mode | worst max|Δ|/max|g| "
            f"{_num(inv.get('worst_bf16'))} (tolerance 2e-2); fp32 reference vs transformers "
            f"{_num(inv.get('reference_vs_transformers'))} (TF32 tolerance 5e-3) |"
        )
    for key, value in sorted(run.items()):
        if key.startswith(("invariance_", "context_parallel_")) and key != "invariance_1x1x1_bf16":
            out.append(f"| {key} | worst {_num(value.get('worst'))} |")
    probe = run.get("nccl_two_ranks_one_gpu")
    if probe:
        out.append(f"| two ranks on one GPU under NCCL | {probe.get('message', '-')} |")
    out += _sglang_rows(run.get("sglang"))
    demo = run.get("demo")
    if demo:
        out.append(
            f"| CPU demo's loop on the GPU, {demo.get('steps')} steps, 1 process | "
            f"{_num(demo.get('wall_s'))} s in all; reward {demo.get('reward_mean')} |"
        )
    return out


def _sglang_rows(sglang: dict[str, Any] | None) -> list[str]:
    if not sglang:
        return []
    rows = []
    for phase, p in sglang.get("phases", {}).items():
        rows.append(
            f"| SGLang vs learner log-probs, bf16, {phase} weights | mismatch mean "
            f"{_num(p['mismatch_mean'])}, p99 {_num(p['mismatch_p99'])}, max "
            f"{_num(p['mismatch_max'])} nats over {p['tokens']} sampled tokens |"
        )
    for method, push in sglang.get("pushes", {}).items():
        way = "CUDA IPC" if method == "tensor" else "NCCL broadcast"
        figure = push["error"][-200:] if "error" in push else f"{_num(push['gb_per_s'])} GB/s"
        rows.append(f"| weight push by {way} ({method}), tiny model | {figure} |")
    turn = sglang.get("colocated")
    if turn:
        pool = turn["mem_fraction_static"] * turn["total_memory"]
        rows.append(
            "| colocated turn: device memory released by `/release_memory_occupation` | "
            f"{(turn['free_asleep'] - turn['free_awake']) / 2**30:.2f} GiB "
            f"({(turn['free_asleep'] - turn['free_awake']) / pool:.2f} of the static pool); "
            f"release {_num(turn['release_s'])} s, resume weights "
            f"{_num(turn['resume_weights_s'])} s, push {_num(turn['push_s'])} s, resume KV "
            f"cache {_num(turn['resume_kv_cache_s'])} s |"
        )
    return rows


def render_bench(run: dict[str, Any]) -> list[str]:
    """The benchmark block: MFU, SGLang tokens/s and weight-push GB/s, each with its ratio to
    the reference measured in the same run."""
    out = _header(run)
    out += ["| measure | figure | ratio to the reference of the same run |", "| --- | --- | --- |"]
    mfu = run.get("mfu", {})
    if "error" in mfu:
        out.append(f"| MFU, ~1B, bf16 | {mfu['error']} | - |")
    elif mfu:
        ratio = mfu.get("grpo_step/ce_step", {}) or {}
        out.append(
            f"| MFU of the GRPO step, ~1B Qwen3 shape, bf16, TE {mfu.get('transformer_engine')} "
            f"| {_num(mfu.get('mfu'))} ({_num(mfu.get('model_tflops_per_s'))} TFLOP/s, "
            f"{_num(mfu.get('tokens_per_s'))} tokens/s) | GRPO step / megatron-core "
            f"cross-entropy step: {_num(ratio.get('median'))} |"
        )
    sgl = run.get("sglang", {})
    if "error" in sgl or "sglang" in sgl:
        out.append(f"| SGLang | {sgl.get('error') or sgl.get('sglang')} | - |")
    elif sgl:
        gen, sync = sgl.get("generation", {}), sgl.get("weight_sync", {})
        tps = gen.get("tokens_per_s") or []
        out.append(
            f"| SGLang generation, Qwen3-0.6B shape, through the trainer's client | "
            f"{_num(max(tps) if tps else None)} tokens/s | client / one direct batched "
            f"/generate: {_num((gen.get('client/direct') or {}).get('median'))} |"
        )
        gbs = sync.get("gb_per_s") or []
        out.append(
            f"| weight push by CUDA IPC (WeightPush, bucketed, layer by layer) | "
            f"{_num(max(gbs) if gbs else None)} GB/s | push / one request of every tensor: "
            f"{_num((sync.get('push/one_request') or {}).get('median'))} |"
        )
    return out


def summary_row(doc: str) -> str:
    """The summary table's GPU row, from what the blocks now hold."""
    ran = [b for b in BLOCKS if NOT_RUN[b] not in _block(doc, b)]
    if not ran:
        return (
            "| GPU | MFU, SGLang tokens/s, weight-sync GB/s; the tests/gpu tier | "
            "not yet run on a GPU | - | - |"
        )
    return (
        f"| GPU | MFU, SGLang tokens/s, weight-sync GB/s; the tests/gpu tier | run "
        f"({', '.join(ran)}): figures in the GPU tier section | - | - |"
    )


def _block(doc: str, block: str) -> str:
    begin, end = markers(block)
    start, stop = doc.index(begin), doc.index(end)
    return doc[start + len(begin) : stop]


def update(doc: str, block: str, lines: list[str]) -> str:
    """``doc`` with ``block``'s markers holding ``lines``, and the summary row rewritten."""
    begin, end = markers(block)
    if begin not in doc or end not in doc:
        raise ValueError(f"docs/benchmarks.md has no {block} block ({begin})")
    head, rest = doc.split(begin, 1)
    _, tail = rest.split(end, 1)
    doc = head + begin + "\n" + "\n".join(lines).rstrip() + "\n" + end + tail
    row = summary_row(doc)
    return re.sub(r"^\| GPU \|.*$", lambda _: row, doc, count=1, flags=re.MULTILINE)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tests", type=Path, help="the tests' results JSON (scripts/test_gpu.sh)")
    p.add_argument("--bench", type=Path, help="bench/gpu.sh's JSON")
    p.add_argument("--doc", type=Path, default=DOC)
    args = p.parse_args(argv)
    before = doc = args.doc.read_text()
    for block, path, render in (
        ("tests", args.tests, render_tests),
        ("bench", args.bench, render_bench),
    ):
        if path is None or not path.exists():
            continue
        run = json.loads(path.read_text())
        if run.get("gpu") is False:
            print(f"gpu_report: {path} says no GPU was present; {block} block unchanged")
            continue
        doc = update(doc, block, render(run))
        print(f"gpu_report: wrote the {block} block of {args.doc}")
    if doc != before:
        args.doc.write_text(doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
