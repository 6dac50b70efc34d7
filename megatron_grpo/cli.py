"""The ``megatron-grpo`` command line."""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import warnings
from pathlib import Path

from megatron_grpo.commands.convert.cli import add_parser as add_convert_parser
from megatron_grpo.commands.invariance.cli import add_parser as add_invariance_parser
from megatron_grpo.config import MovedKeyWarning, dump_config, load_config
from megatron_grpo.console import quiet_third_party_warnings


def add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="YAML config file (defaults apply when omitted)")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config value, e.g. --set optim.lr=1e-6 (repeatable)",
    )


def cmd_config(args: argparse.Namespace) -> int:
    print(dump_config(load_config(args.config, args.overrides)), end="")
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    flags = {"train.allow_config_change": args.allow_config_change}
    flags["metrics.print_config"] = args.print_config
    overrides = args.overrides + [f"{key}=true" for key, on in flags.items() if on]
    if ERROR_DIR_ENV in os.environ or os.environ.get("RANK", "0") != "0":
        # a worker: the launcher (or rank 0) says which of the config's keys moved
        warnings.filterwarnings("ignore", category=MovedKeyWarning)
    cfg = load_config(args.config, overrides)  # fail fast, before any process starts
    sizing = (args.world_size, args.nnodes, args.gpus_per_node, args.gpu_memory_gb)
    if not args.dry_run and any(x is not None for x in (*sizing, args.host_memory_gib)):
        raise ValueError(
            "--world-size, --nnodes, --gpus-per-node, --gpu-memory-gb and --host-memory-gib "
            "need --dry-run"
        )
    if args.dry_run:  # arithmetic only: no process, no process group, no GPU
        from megatron_grpo.commands.dry_run import dry_run, resolve_world_size

        world_size, gpus_per_node = resolve_world_size(
            args.world_size, args.nnodes, args.gpus_per_node
        )
        report = dry_run(
            cfg,
            world_size=world_size,
            gpus_per_node=gpus_per_node,
            gpu_memory_gb=80.0 if args.gpu_memory_gb is None else args.gpu_memory_gb,
            host_memory_gib=2048.0 if args.host_memory_gib is None else args.host_memory_gib,
        )
        print(report.format())
        if not report.fits:
            print(f"megatron-grpo: error: {report.refusal()}", file=sys.stderr)
            return 2
        return 0
    from megatron_grpo.train.preflight import check_paths, preflight

    check_paths(cfg)  # the file system only: refused in a fraction of a second
    launching = args.nproc and "WORLD_SIZE" not in os.environ
    if launching:
        from megatron_grpo.train.run_lock import HELD_ENV, RunLock
        from megatron_grpo.train.run_start import plan_start

        start = plan_start(cfg)  # a resume that changes what was trained is refused here
        if start.kind == "complete":
            print(start.describe(cfg))
            return 0
        code = _preflight_in_child(args.nproc, cfg)
        if code:
            return code
        with RunLock(cfg.output_dir) as lock:  # before any process starts
            env = {HELD_ENV: str(lock.path), LOG_DIR_ENV: str(Path(cfg.output_dir) / "logs")}
            code = _relaunch_under_torchrun(args.nproc, sys.argv[1:], env)
        if code == INTERRUPTED:
            print(_interrupted_line(cfg), file=sys.stderr)
        return code
    preflight(cfg, int(os.environ.get("WORLD_SIZE", "1")))
    from megatron_grpo.launch import die_with_parent, use_private_tempdir
    from megatron_grpo.train.loop import train

    if "TORCHELASTIC_RUN_ID" in os.environ:  # a torchrun worker: end with torchrun
        die_with_parent()
    use_private_tempdir()  # an embedded server's model directory goes with this process
    train(cfg)
    return 0


def _preflight_in_child(nproc: int, cfg) -> int:
    """``preflight`` of the resolved ``cfg`` for ``nproc`` processes, in a process that then
    exits: it loads the tokenizer, the data and the reward (torch and transformers with
    them), which the launcher, alive for the whole run, should not hold. Its error lines
    are printed here; its exit code is returned (2 for a refused config)."""
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".yaml", prefix="preflight_") as resolved:
        resolved.write(dump_config(cfg))
        resolved.flush()
        cmd = [sys.executable, "-m", "megatron_grpo.train.preflight", str(nproc), resolved.name]
        done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        print(done.stderr.rstrip() or f"preflight failed ({done.returncode})", file=sys.stderr)
    return done.returncode


ERROR_DIR_ENV = "MEGATRON_GRPO_ERROR_DIR"
"""Where the workers of a ``--nproc`` launch write the error that ended them."""

LOG_DIR_ENV = "MEGATRON_GRPO_LOG_DIR"
"""Where the workers of a ``--nproc`` launch write the traceback of that error."""

INTERRUPTED = 130
"""Exit code of a run stopped by Ctrl-C (128 + SIGINT)."""


def _interrupted_line(cfg) -> str:
    """What a run stopped by Ctrl-C ends with: where it stopped, and how to go on."""
    from megatron_grpo.train.state import latest_checkpoint

    latest = latest_checkpoint(cfg.output_dir)
    where = f"the last checkpoint is {latest}" if latest else "no checkpoint was saved yet"
    again = shlex.join(["megatron-grpo", *sys.argv[1:]])
    return f"megatron-grpo: stopped (Ctrl-C); {where}; the same command resumes: {again}"


def _relaunch_under_torchrun(nproc: int, argv: list[str], env: dict[str, str]) -> int:
    """Run this same command under torchrun on ``nproc`` local processes, with ``env``
    added; torchrun (and through it the workers) ends when this process does. When a
    worker fails, the first error a worker raised is the last line printed.

    One node: torchrun's store and gloo listen on loopback only (``launch.loopback_torchrun``,
    ``GLOO_SOCKET_IFNAME=lo`` unless set)."""
    import tempfile

    from megatron_grpo.launch import die_with_parent, use_private_tempdir

    use_private_tempdir()

    rest, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a == "--nproc":
            skip = True
            continue
        if a.startswith("--nproc="):
            continue
        rest.append(a)
    cmd = [
        sys.executable,
        "-m",
        "megatron_grpo.launch",
        "torchrun",
        f"--nproc_per_node={nproc}",
        "-m",
        "megatron_grpo.cli",
        *rest,
    ]
    env = {
        "OMP_NUM_THREADS": "1",
        "GLOO_SOCKET_IFNAME": "lo",
        **os.environ,
        **env,
    }
    with tempfile.TemporaryDirectory(prefix="megatron_grpo_errors_") as errors:
        process = subprocess.Popen(
            cmd, env={**env, ERROR_DIR_ENV: errors}, preexec_fn=die_with_parent
        )
        try:
            code = process.wait()
        except KeyboardInterrupt:  # torchrun, in this terminal's group, stops the workers
            process.wait()
            return INTERRUPTED
        first = _first_worker_error(errors) if code else None
    if first is None:
        return code
    where = f" (traceback: {first['traceback']})" if first.get("traceback") else ""
    print(
        f"megatron-grpo: error: rank {first['rank']}: {first['type']}: {first['message']}{where}",
        file=sys.stderr,
    )
    return 2 if first["type"] in ("ValueError", "FileNotFoundError") else 1


def _first_worker_error(errors: str) -> dict | None:
    import json

    found = [json.loads(p.read_text()) for p in Path(errors).glob("rank*.json")]
    return min(found, key=lambda e: e["time"]) if found else None


def _record_worker_error(error: BaseException) -> bool:
    """Under a ``--nproc`` launch, leave ``error`` for the launcher to print last, with
    its traceback in ``<output_dir>/logs/error_rank<N>.log``; whether it was left."""
    import json
    import time
    import traceback

    where = os.environ.get(ERROR_DIR_ENV)
    if where is None or "RANK" not in os.environ:
        return False
    rank = os.environ["RANK"]
    record = {
        "rank": int(rank),
        "type": type(error).__name__,
        "message": str(error).splitlines()[0] if str(error) else "",
        "time": time.time(),
    }
    logs = os.environ.get(LOG_DIR_ENV)
    if logs is not None and not isinstance(error, (ValueError, FileNotFoundError)):
        path = Path(logs) / f"error_rank{rank}.log"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(traceback.format_exception(error)))
        record["traceback"] = str(path)
    (Path(where) / f"rank{rank}.json").write_text(json.dumps(record))
    return True


def cmd_plot(args: argparse.Namespace) -> int:
    from megatron_grpo.metrics import plot_run

    for path in plot_run(args.run_dir, args.out):
        print(path)
    return 0


def cmd_compare_modes(args: argparse.Namespace) -> int:
    from megatron_grpo.commands.compare import compare_modes
    from megatron_grpo.config import MODES, check_mode

    variants: dict[str, list[str]] = {}
    for item in args.variant:
        name, sep, override = item.partition(":")
        if not (name and sep and "=" in override):
            raise ValueError(f"--variant takes NAME:KEY=VALUE, got {item!r}")
        variants.setdefault(name, []).append(override)
    if variants and args.modes is not None:
        raise ValueError("give --modes or --variant, not both")
    modes = [] if variants else list(MODES)
    if args.modes not in (None, "all"):
        modes = [m for m in args.modes.split(",") if m]
    for mode in modes:
        check_mode(mode)
    result = compare_modes(
        config=args.config,
        modes=modes,
        variants=variants,
        num_seeds=args.seeds,
        out=args.out,
        overrides=args.overrides,
        nproc=args.nproc,
        threshold=args.threshold,
        window=args.window,
        k=args.last_k,
        timeout=args.timeout or None,
    )
    print(result.markdown, end="")
    for path in result.files:
        print(path)
    return 1 if result.failed else 0


def add_train_parser(sub) -> None:
    p = sub.add_parser(
        "train",
        help="run GRPO (under torchrun, or --nproc N to start the processes here)",
    )
    add_config_args(p)
    p.add_argument(
        "--nproc",
        type=int,
        default=0,
        help="start N local processes with torchrun (ignored when already under torchrun)",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="check the layout and estimate memory per GPU for the target world size, "
        "without GPUs or processes; exit 2 when it is invalid or does not fit",
    )
    p.add_argument(
        "--allow-config-change",
        action="store_true",
        help="resume a run whose saved config differs in what was trained (e.g. optim.lr); "
        "without it such a resume is refused, naming the keys",
    )
    p.add_argument(
        "--print-config",
        action="store_true",
        help="print the whole resolved config at start (it is always in the output dir)",
    )
    p.add_argument("--world-size", type=int, help="GPUs in total (with --dry-run)")
    p.add_argument("--nnodes", type=int, help="nodes (with --dry-run; default 1)")
    p.add_argument("--gpus-per-node", type=int, help="GPUs per node (with --dry-run; default 8)")
    p.add_argument(
        "--gpu-memory-gb",
        type=float,
        help="memory of one GPU in GiB (with --dry-run; default 80)",
    )
    p.add_argument(
        "--host-memory-gib",
        type=float,
        help="host memory of one node in GiB, for the offload of rollout.placement: colocated "
        "(with --dry-run; default 2048, an 8-GPU H100 node's 2 TiB)",
    )
    p.set_defaults(func=cmd_train)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megatron-grpo", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("config", help="validate a config and print it resolved")
    add_config_args(p)
    p.set_defaults(func=cmd_config)

    add_train_parser(sub)
    add_convert_parser(sub)

    p = sub.add_parser("plot", help="draw reward and length curves of a run to PNG")
    p.add_argument("run_dir", help="a run's output_dir (holding metrics.jsonl)")
    p.add_argument("--out", help="where to write the PNG files (default: run_dir)")
    p.set_defaults(func=cmd_plot)

    add_invariance_parser(sub, add_config_args)

    p = sub.add_parser(
        "compare-modes",
        help="train once per loss mode and seed, then plot the curves and tabulate",
        description="Run the same training once per loss.mode and seed (sequentially, each "
        "a 'megatron-grpo train' subprocess into OUT/<mode>/seed_<S>), reusing runs that "
        "already finished, then write one figure per metric with one curve per mode and "
        "a summary table (summary.md, summary.csv). Exits 1 if a run failed.",
    )
    add_config_args(p)
    p.add_argument("--modes", help="comma-separated loss modes, or 'all' (the default)")
    p.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME:KEY=VALUE",
        help="instead of loss modes, compare named variants: each --variant adds one "
        "override to variant NAME (e.g. --variant async:rollout.max_staleness=1)",
    )
    p.add_argument(
        "--seeds", type=int, default=1, help="seeds per mode: the config's seed, +1, +2, ..."
    )
    p.add_argument("--out", help="where runs, figures and tables go (default: output_dir)")
    p.add_argument("--nproc", type=int, default=1, help="processes per training run")
    p.add_argument("--threshold", type=float, default=0.5, help="reward for steps-to-threshold")
    p.add_argument("--window", type=int, default=5, help="moving-average window (steps)")
    p.add_argument("--last-k", type=int, default=5, help="steps averaged for final values")
    p.add_argument("--timeout", type=float, default=0, help="seconds per run; 0: no limit")
    p.set_defaults(func=cmd_compare_modes)
    return parser


def _say_moved_keys_in_one_line() -> None:
    """A moved config key is the user's to fix: one line naming it, not Python's warning
    with the loader's file and source line."""
    plain = warnings.formatwarning

    def formatted(message, category, filename, lineno, line=None) -> str:
        if issubclass(category, MovedKeyWarning):
            return f"megatron-grpo: warning: {message}\n"
        return plain(message, category, filename, lineno, line)

    warnings.formatwarning = formatted


def main(argv: list[str] | None = None) -> int:
    quiet_third_party_warnings()
    _say_moved_keys_in_one_line()
    args = build_parser().parse_args(argv)
    args.argv = list(argv) if argv is not None else sys.argv[1:]
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        if not _record_worker_error(e):  # under a launch, the launcher prints it once
            print(f"megatron-grpo: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if os.environ.get(ERROR_DIR_ENV) is None:
            raise
        return INTERRUPTED  # the launcher says where the run stopped
    except Exception as e:
        if not _record_worker_error(e):
            raise
        return 1


if __name__ == "__main__":
    sys.exit(main())
