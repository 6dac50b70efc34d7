"""Trains the CPU demo colocated, in this process (PP 1), with one fault injected for real at
step 2; prints the error the run stopped with as its last line, ``ERROR <type>: <message>``.

    python colocated_faults.py <fault> <assets> <output_dir> [key=value ...]

Faults, on the embedded engine's own process:
- ``release_hangs``: it is frozen (SIGSTOP) just before its memory is released;
- ``resume_refused``: another client resumes its weights just before the trainer does, so
  the engine refuses the trainer's resume (the weights are not released);
- ``push_asleep``: its weights are not resumed before the push (the trainer's wake-up is
  skipped), so the push reaches an engine asleep;
- ``none``: no fault (a resumed run).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import urllib.request
from pathlib import Path

from megatron_grpo import train
from megatron_grpo.train import colocation

FAULT_STEP = 2


def engine_pids() -> list[int]:
    """This process's children that are embedded engines."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            command = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if ppid == os.getpid() and b"megatron_grpo.embedded" in command:
            pids.append(int(entry.name))
    assert pids, "no embedded engine process found"
    return pids


def inject(fault: str) -> None:
    cls = colocation.Colocation
    release, resume = cls.release_engines, cls.resume_weights

    def frozen_release(self) -> None:
        if self.step != FAULT_STEP:
            return release(self)
        pids = engine_pids()
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        try:
            release(self)
        finally:
            for pid in pids:
                os.kill(pid, signal.SIGCONT)

    def resumed_behind(self) -> None:
        if self.step == FAULT_STEP:
            for url in self.runtime.weight_client.urls:
                body = json.dumps({"tags": ["weights"]}).encode()
                urllib.request.urlopen(f"{url}/resume_memory_occupation", body, timeout=30)
        resume(self)

    def skipped_resume(self) -> None:
        if self.step != FAULT_STEP:
            resume(self)

    if fault == "none":
        return
    patch = {
        "release_hangs": ("release_engines", frozen_release),
        "resume_refused": ("resume_weights", resumed_behind),
        "push_asleep": ("resume_weights", skipped_resume),
    }[fault]
    setattr(cls, *patch)


def main() -> None:
    fault, assets, out, *extra = sys.argv[1:]
    inject(fault)
    try:
        train(
            str(Path(__file__).resolve().parents[2] / "examples" / "cpu_demo" / "grpo.yaml"),
            [
                f"tokenizer={assets}/model",
                f"train.init={assets}/model",
                f"data.path={assets}/train.jsonl",
                f"output_dir={out}",
                "parallel.pp=1",
                "rollout.prompts_per_step=4",
                "rollout.samples_per_prompt=4",
                "metrics.tensorboard=false",
                "rollout.placement=colocated",
                "rollout.colocate.transition_timeout_s=10",
                "train.save_interval=1",
                "train.total_steps=3",
                *extra,
            ],
        )
    except Exception as err:  # noqa: BLE001 - the test reads it
        print(f"ERROR {type(err).__name__}: {err}", flush=True)
        sys.exit(1)
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
