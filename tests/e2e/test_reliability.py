"""Faults injected for real: a second launch into a running directory, the launcher killed
with SIGKILL, a stale lock left behind, an error inside a worker, a crash loop."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import demo_run
import pytest
import torch
from demo_run import ROOT, demo_argv

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def processes_naming(text: str) -> list[int]:
    """Live processes whose command line contains ``text``."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = (entry / "stat").read_text().split(")")[-1].split()[0]
        except OSError:
            continue
        if text in cmdline and state != "Z":
            pids.append(int(entry.name))
    return pids


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.5)


def logged_steps(out: Path) -> list[int]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()]


def tiny_run_argv(tmp_path: Path, *overrides: str) -> list[str]:
    """``megatron-grpo train --nproc 2`` on a random tiny model, with a tokenizer and a data
    file made here (no assets to prepare): the real command line, run as a subprocess."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(
        ["what is one plus two"], trainers.WordLevelTrainer(special_tokens=["<unk>"])
    )
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(
        tmp_path / "tok"
    )
    (tmp_path / "train.jsonl").write_text(
        json.dumps({"prompt": "what is one plus two", "label": "3"}) + "\n"
    )
    sets = [
        f"tokenizer={tmp_path / 'tok'}",
        f"data.path={tmp_path / 'train.jsonl'}",
        f"output_dir={tmp_path / 'out'}",
        "data.apply_chat_template=false",
        "model.num_layers=2",
        "model.hidden_size=64",
        "model.ffn_hidden_size=128",
        "model.num_attention_heads=4",
        "model.vocab_size=32",
        "model.add_qkv_bias=true",
        "metrics.tensorboard=false",
        *overrides,
    ]
    argv = [sys.executable, "-m", "megatron_grpo.cli", "train", "--nproc", "2"]
    return argv + [x for s in sets for x in ("--set", s)]


def test_a_missing_train_init_is_refused_in_seconds_with_one_line(tmp_path):
    """Refused by the launching process itself: no torchrun, no worker, no output directory."""
    argv = tiny_run_argv(tmp_path, "train.init=runs/gone/model")
    start = time.monotonic()
    done = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=20)
    seconds = time.monotonic() - start
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.count("\n") == 1, done.stderr[-3000:]
    assert done.stderr == (
        f"megatron-grpo: error: train.init='runs/gone/model' (looked for "
        f"{tmp_path}/runs/gone/model, from the current directory) does not exist: give a "
        "Hugging Face model directory (with config.json) or a megatron checkpoint directory "
        "(with metadata.json)\n"
    )
    assert seconds < 5, f"{seconds:.1f} s"
    assert not (tmp_path / "out").exists()
    print(f"refused in {seconds:.2f} s with {done.stderr.count(chr(10))} line")


def listening_sockets(pids: set[int]) -> list[tuple[int, str, int]]:
    """``(pid, address, port)`` of every TCP socket in LISTEN state that ``pids`` hold."""
    import ipaddress

    owners = {}
    for pid in pids:
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    owners[target[8:-1]] = pid
        except OSError:
            continue
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in Path(table).read_text().splitlines()[1:]:
            fields = row.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state != "0A" or inode not in owners:
                continue
            hex_addr, hex_port = local.split(":")
            raw = bytes.fromhex(hex_addr)
            # /proc writes each 32-bit word of the address in host (little-endian) order
            raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
            found.append((owners[inode], str(ipaddress.ip_address(raw)), int(hex_port, 16)))
    return found


def process_tree(root: int) -> set[int]:
    """``root`` and its live descendants."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int(
                    (entry / "stat").read_text().split(")")[-1].split()[1]
                )
            except OSError:
                continue
    tree, grown = {root}, True
    while grown:
        children = {pid for pid, parent in parents.items() if parent in tree}
        grown = not children <= tree
        tree |= children
    return tree


def test_a_single_node_launch_listens_on_loopback_only(tmp_path):
    """torchrun's store (and the workers' gloo) of ``train --nproc``: nothing on 0.0.0.0/::."""
    run = subprocess.Popen(
        tiny_run_argv(tmp_path, "train.total_steps=1000"),
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    seen: set[tuple[int, str, int]] = set()
    try:
        deadline = time.monotonic() + 60
        # the agent's store, then each worker's gloo listener once its process group is up
        while len({pid for pid, _, _ in seen}) < 3 and time.monotonic() < deadline:
            assert run.poll() is None, run.stderr.read()[-3000:] if run.stderr else ""
            seen |= set(listening_sockets(process_tree(run.pid)))
            time.sleep(0.2)
    finally:
        os.killpg(run.pid, signal.SIGKILL)
        run.wait()
        wait_for(lambda: not processes_naming(str(tmp_path / "out")), 30, "every worker to exit")
    assert len({pid for pid, _, _ in seen}) >= 3, seen  # torchrun and two workers
    wide = [s for s in seen if not ipaddress_is_loopback(s[1])]
    assert not wide, f"listening beyond loopback: {wide}"
    print(f"listeners: {sorted(seen)}")


def ipaddress_is_loopback(address: str) -> bool:
    import ipaddress

    return ipaddress.ip_address(address).is_loopback


def test_second_launch_refused_and_workers_die_with_a_killed_launcher(tmp_path, assets):
    out = tmp_path / "run"
    first = subprocess.Popen(
        demo_argv(out, assets, "train.total_steps=500", "train.save_interval=1"),
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # its own process group, as a shell job would have
    )
    try:
        wait_for(lambda: len(logged_steps(out)) >= 2, 300, "the first run's second step")
        assert json.loads((out / "run.lock").read_text())["pid"] == first.pid

        # 1. A second launch into the same directory exits 2 naming the holder.
        second = subprocess.run(
            demo_argv(out, assets, "train.total_steps=500"),
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert second.returncode == 2, second.stderr[-3000:]
        assert f"is in use by pid {first.pid}" in second.stderr
        assert first.poll() is None, "the first run must not be disturbed"

        # 2. SIGKILL to the launcher's whole process group: torchrun is killed with it, and
        # the workers, in sessions of their own, follow within seconds.
        assert len(processes_naming(str(out))) >= 3  # launcher, torchrun, 2 workers
        os.killpg(first.pid, signal.SIGKILL)
        first.wait(timeout=30)
        wait_for(lambda: not processes_naming(str(out)), 90, "every worker to exit")
        steps_at_kill = logged_steps(out)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
        for pid in processes_naming(str(out)):
            os.kill(pid, signal.SIGKILL)
    time.sleep(2)
    assert logged_steps(out) == steps_at_kill, "nothing kept writing after the kill"

    # 3. The lock of the dead launcher is stale: the next launch takes it over and resumes
    # from the last checkpoint, with the steps after it logged once.
    latest = int((out / "checkpoints" / "latest").read_text().split("_")[1])
    resumed = subprocess.run(
        demo_argv(out, assets, f"train.total_steps={latest + 1}", "train.save_interval=1"),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"taking over the lock of pid {first.pid}" in resumed.stderr
    assert logged_steps(out) == list(range(1, latest + 2))
    assert not (out / "run.lock").exists()


def test_an_error_inside_a_worker_is_the_last_line(tmp_path, assets):
    """A reward function that raises on rank 0 mid-rollout: the other rank dies in its
    collective; the run's console shows the first error once, as its last line, and the
    traceback is in the file that line names."""
    (tmp_path / "broken_reward.py").write_text(
        "def score(response, label, metadata):\n    raise RuntimeError('verifier crashed')\n"
    )
    done = subprocess.run(
        demo_argv(
            tmp_path / "run",
            assets,
            "train.total_steps=2",
            "reward.type=custom",
            "reward.custom_function=broken_reward:score",
        ),
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("megatron-grpo: error: rank 0: RewardError: "), done.stderr[-3000:]
    traceback = tmp_path / "run" / "logs" / "error_rank0.log"
    assert last.endswith(f"RuntimeError: verifier crashed (traceback: {traceback})")
    console = done.stdout + done.stderr
    assert console.count("verifier crashed") == 1 and "Traceback" not in console, console
    assert "ChildFailedError" not in console
    assert "raise RuntimeError('verifier crashed')" in traceback.read_text()


RESUMED_METRICS = (
    "rollout/reward_mean",
    "rollout/response_length_mean",
    "train/loss",
    "train/grad_norm",
    "train/entropy",
)


def latest_saved(out: Path) -> int:
    pointer = out / "checkpoints" / "latest"
    return int(pointer.read_text().split("_")[1]) if pointer.exists() else 0


def test_crash_loop_ends_where_an_uninterrupted_run_ends(tmp_path, assets):
    """kill -9 of the whole launch up to three times, at different points of a step
    (generation, training, saving), resuming each time: the end state is the uninterrupted
    run's, with every step logged once and no half-written checkpoint left."""
    from megatron_grpo.launch import run_workers

    steps = ("train.total_steps=10", "train.save_interval=1")
    full = tmp_path / "full"
    done = subprocess.run(demo_argv(full, assets, *steps), cwd=ROOT, capture_output=True)
    assert done.returncode == 0, done.stderr[-3000:]

    out = tmp_path / "crashed"
    kills = 0
    for attempt, delay in enumerate((0.3, 0.8, 1.5)):
        log = (tmp_path / f"launch{attempt}.log").open("w")
        launch = subprocess.Popen(
            demo_argv(out, assets, *steps),
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        saved = latest_saved(out)

        def progressed(launch=launch, saved=saved) -> bool:
            return latest_saved(out) > saved or launch.poll() is not None

        wait_for(progressed, 300, "a save")
        time.sleep(delay)  # into the next step's rollout, train step or save
        if launch.poll() is not None:  # it finished first: a fast machine
            assert launch.returncode == 0, (tmp_path / f"launch{attempt}.log").read_text()[-3000:]
            break
        os.killpg(launch.pid, signal.SIGKILL)
        launch.wait(timeout=30)
        kills += 1
        wait_for(lambda: not processes_naming(str(out)), 90, "every worker to exit")
    assert kills >= 2
    done = subprocess.run(demo_argv(out, assets, *steps), cwd=ROOT, capture_output=True)
    assert done.returncode == 0, done.stderr[-3000:]

    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    expected = [json.loads(x) for x in (full / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 11))
    for got, want in zip(rows, expected, strict=True):
        for key in RESUMED_METRICS:
            assert got[key] == pytest.approx(want[key], rel=1e-6, abs=1e-9), (got["step"], key)
    assert not list((out / "checkpoints").glob("*.partial"))
    weights = [
        run_workers(
            f"{demo_run.__file__}:full_params",
            1,
            kwargs={
                "ckpt": str(run / "checkpoints" / "step_00000010"),
                "config": str(run / "config.yaml"),
            },
            timeout=300,
        )[0]
        for run in (full, out)
    ]
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
