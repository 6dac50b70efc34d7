"""Colocated against disaggregated placement: the peak of all the run's processes' resident
sets together, the engine's resident set awake and asleep, and the step time.

    python bench/colocation.py            # a ~100M-parameter Qwen3 on the demo's task, 2x PP
    python bench/colocation.py --quick    # the demo's tiny model

Each run is the trainer itself (``megatron-grpo train --nproc 2``, the CPU demo's config with
a larger model of the demo's tokenizer, random weights): once with
``rollout.placement: disaggregated`` and the embedded engine in a process of its own (the
same engine as colocated), once colocated. A sampler reads every 20 ms the resident set of
every process under the launcher (learner ranks, engine, helpers) and keeps the largest
sum, and the engine's own. glibc returns freed memory at once in every process
(``MALLOC_ENV``), so a resident set follows what is live.

Reported: peak of the summed resident sets, colocated / disaggregated (< 1: colocation needs
less memory at its peak); the engine's smallest resident set after its first release against
its largest, beside its weights' bytes; the median step time, colocated / disaggregated.
On a CPU the learner's offload moves bytes from host memory to host memory: what it saves on a
GPU does not show here, only the engine's release does.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import yaml
from _common import Ratio, parser, summary, write_result

from megatron_grpo.testing.memory import MALLOC_ENV, rss

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "examples" / "cpu_demo"
STEPS = 6


def children(pid: int) -> list[int]:
    """Every process under ``pid``."""
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        try:
            kids = Path(f"/proc/{parent}/task/{parent}/children").read_text().split()
        except OSError:
            continue
        for kid in map(int, kids):
            found.append(kid)
            todo.append(kid)
    return found


class TreeSampler:
    """The largest summed resident set of a process tree, and the engine's resident sets."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak = pid, 0
        self.engine: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            total = 0
            for pid in [self.pid, *children(self.pid)]:
                try:
                    size = rss(pid)
                    command = Path(f"/proc/{pid}/cmdline").read_bytes()
                except OSError:
                    continue
                total += size
                if b"megatron_grpo.embedded" in command:
                    self.engine.append(size)
            self.peak = max(self.peak, total)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def prepare(tmp: Path, quick: bool) -> tuple[Path, Path]:
    """The demo's assets, and (unless ``quick``) a larger random model with its tokenizer."""
    assets = tmp / "assets"
    subprocess.run(
        [sys.executable, str(DEMO / "prepare.py"), "--out", str(assets), "--warmup-steps", "0"],
        check=True,
        capture_output=True,
    )
    if quick:
        return assets, assets / "model"
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(assets / "model")
    config.update(
        {
            "hidden_size": 1024,
            "intermediate_size": 3072,
            "num_hidden_layers": 8,
            "num_attention_heads": 16,
            "num_key_value_heads": 4,
            "head_dim": 64,
            "layer_types": ["full_attention"] * 8,
        }
    )
    big = tmp / "big_model"
    AutoModelForCausalLM.from_config(config).save_pretrained(big)
    for f in (assets / "model").iterdir():  # the tokenizer and its chat template
        if not (big / f.name).exists() and not f.name.endswith(".safetensors"):
            shutil.copy(f, big / f.name)
    return assets, big


def config_file(tmp: Path, model: Path) -> Path:
    """The demo's config without its model section (it follows ``train.init``)."""
    cfg = yaml.safe_load((DEMO / "grpo.yaml").read_text())
    cfg["model"] = {"make_vocab_size_divisible_by": 1}
    cfg["tokenizer"] = cfg["train"]["init"] = str(model)
    path = tmp / "grpo.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def run(config: Path, assets: Path, out: Path, placement: str) -> dict:
    sets = [
        f"output_dir={out}",
        f"data.path={assets / 'train.jsonl'}",
        f"train.total_steps={STEPS}",
        "train.save_interval=0",
        "rollout.prompts_per_step=8",
        "rollout.samples_per_prompt=4",
        "metrics.tensorboard=false",
        f"rollout.placement={placement}",
        "rollout.engines.embedded_server=process",
    ]
    command = [sys.executable, "-m", "megatron_grpo.cli", "train", "--config", str(config)]
    command += ["--nproc", "2", *(x for s in sets for x in ("--set", s))]
    proc = subprocess.Popen(
        command, cwd=ROOT, env={**os.environ, **MALLOC_ENV}, stdout=subprocess.PIPE, text=True
    )
    sampler = TreeSampler(proc.pid)
    output, _ = proc.communicate(timeout=1800)
    sampler.close()
    if proc.returncode != 0:
        raise RuntimeError(f"{placement} run failed:\n{output[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    phases = ("perf/time_rollout_s", "perf/time_train_s", "perf/time_sync_s")
    step_s = [sum(r[k] for k in phases) for r in rows]
    return {"peak": sampler.peak, "engine": sampler.engine, "step_s": step_s[1:]}


def weights_bytes(model: Path) -> int:
    from safetensors import safe_open

    total = 0
    for f in model.glob("*.safetensors"):
        with safe_open(f, "pt") as st:
            for name in st.keys():  # noqa: SIM118 - safe_open has no __iter__
                t = st.get_slice(name)
                n = 1
                for d in t.get_shape():
                    n *= d
                total += n * 4  # the embedded engine holds fp32
    return total


def main() -> None:
    args = parser(__doc__).parse_args()
    with tempfile.TemporaryDirectory(prefix="mgrpo_bench_coloc_") as name:
        tmp = Path(name)
        assets, model = prepare(tmp, args.quick)
        config = config_file(tmp, model)
        runs = {
            placement: run(config, assets, tmp / placement, placement)
            for placement in ("disaggregated", "colocated")
        }
        weights = weights_bytes(model)
    apart, shared = runs["disaggregated"], runs["colocated"]
    peak = Ratio.of("peak summed RSS colocated/disaggregated", [shared["peak"] / apart["peak"]])
    step = Ratio.of(
        "step time colocated/disaggregated",
        [summary(shared["step_s"])["median"] / summary(apart["step_s"])["median"]],
    )
    awake, asleep = max(shared["engine"]), min(shared["engine"][len(shared["engine"]) // 4 :])
    print(peak.line(target=1.0))
    print(step.line())
    mib = 2**20
    print(
        f"  peak summed RSS: disaggregated {apart['peak'] / mib:.0f} MiB, colocated "
        f"{shared['peak'] / mib:.0f} MiB; engine (colocated) awake {awake / mib:.0f} MiB, asleep "
        f"{asleep / mib:.0f} MiB: {(awake - asleep) / weights:.2f} of its weights' "
        f"{weights / mib:.0f} MiB released"
    )
    write_result(
        "colocation",
        args.out,
        {
            "quick": args.quick,
            "steps": STEPS,
            "peak_rss_ratio": peak,
            "step_time_ratio": step,
            "peak_rss_bytes": {k: v["peak"] for k, v in runs.items()},
            "engine_rss_awake_bytes": awake,
            "engine_rss_asleep_bytes": asleep,
            "engine_weights_bytes": weights,
        },
    )


if __name__ == "__main__":
    main()
