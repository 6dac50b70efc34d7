"""``train(config, overrides, reward_fn=...)``: GRPO from a notebook or a script.

    from megatron_grpo import train
    result = train("run.yaml", {"optim.lr": 1e-6}, reward_fn=my_reward)

One process (``nproc=1``, the default) trains here, in the caller's process, as
``megatron-grpo train`` does without ``--nproc``. Several (``nproc=N``) are started as
``megatron-grpo train --nproc N`` starts them, from the resolved config, with the command's
output passed on line by line. Under torchrun (``WORLD_SIZE`` set) each process trains
here as its own rank, and ``nproc`` is ignored.

How ``reward_fn`` reaches the scorer (rewards/custom.py): by name when it imports back
from a module (``reward.custom_function``); otherwise, when only this process scores, held
here (any callable, lambdas included); otherwise, when other processes need it (the ranks
of an ``nproc`` launch, ``reward.num_workers`` worker processes, the rollout producer of
``rollout.max_staleness``), pickled by value into ``<output_dir>/reward_fn.pkl``
(``reward.custom_pickle``). A function defined in ``__main__`` (a notebook cell, the script
being run) reaches no other process: that is a ValueError naming the fix.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import functools
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from megatron_grpo.config import Config, apply_override, dump_config, from_dict, to_dict
from megatron_grpo.config.init_model import fill_model_section
from megatron_grpo.config.loader import move_keys, new_key, read_yaml, set_dotted

Overrides = Sequence[str] | Mapping[str, Any]
"""``["optim.lr=1e-6", ...]`` (values parsed as YAML, as ``--set`` does) or
``{"optim.lr": 1e-6, ...}`` (values as given)."""

ERROR_PREFIX = "megatron-grpo: error: "
"""How the command line's refusals and a worker's first error begin."""

OUTPUT_TAIL_LINES = 40
"""Lines of a failed launch's output that its exception repeats."""


@dataclasses.dataclass(frozen=True)
class TrainResult:
    """What a run left: its directory and the metrics it logged."""

    output_dir: Path
    """The run's directory: metrics.jsonl, config.yaml, checkpoints, plots."""
    metrics: list[dict[str, Any]]
    """Every row of ``metrics.jsonl`` in order, one step's metrics each (step 0: the
    held-out evaluation before training); rows of earlier runs it resumed included."""

    @property
    def final(self) -> dict[str, Any]:
        """The last step's metrics (empty when none was logged)."""
        return self.metrics[-1] if self.metrics else {}

    @classmethod
    def read(cls, output_dir: str | Path) -> TrainResult:
        path = Path(output_dir) / "metrics.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        return cls(Path(output_dir), [json.loads(line) for line in lines if line.strip()])


def train(
    config: str | Path | Config | Mapping[str, Any] | None = None,
    overrides: Overrides | None = None,
    *,
    reward_fn: Callable[..., Any] | None = None,
    nproc: int = 1,
) -> TrainResult:
    """Run GRPO and return its directory and metrics.

    ``config``: a YAML file, a ``Config``, a mapping of sections, or None (the defaults);
    ``overrides`` apply on top, as ``--set`` does. ``reward_fn``: a reward function object
    that replaces the config's reward (``reward.type=custom``); written as this project's
    ``(response, label, metadata) -> float``, as TRL's ``(prompts, completions, **kwargs)
    -> list[float]`` or as verl's ``compute_score(data_source, solution_str, ground_truth,
    extra_info=None)``, told apart by ``reward.custom_style`` (auto: by its parameters).
    ``nproc``: processes to train on. A refused config raises ValueError, as the command
    line exits 2; a failed run raises its error (one process) or RuntimeError (several).
    """
    if nproc < 1:
        raise ValueError(f"nproc must be >= 1, got {nproc}")
    cfg = build_config(config, overrides)
    launching = nproc > 1 and "WORLD_SIZE" not in os.environ
    if cfg.reward.label_name is None and cfg.data.label_key != "label":
        # a TRL-style function gets the label under its column's name; the scorer's default
        # is "label" where it is not told data.label_key
        cfg.reward = dataclasses.replace(cfg.reward, label_name=cfg.data.label_key)
    with _reward_in_config(cfg, reward_fn, other_processes(cfg, nproc if launching else 1)):
        if launching:
            _launch(cfg, nproc)
        else:
            _train_here(cfg)
    return TrainResult.read(cfg.output_dir)


def build_config(
    config: str | Path | Config | Mapping[str, Any] | None, overrides: Overrides | None
) -> Config:
    """The config of ``train``: its source with ``overrides`` applied, checked as
    ``load_config`` checks a YAML file (the model section from ``train.init``)."""
    if isinstance(config, Config):
        raw = to_dict(config)
    elif isinstance(config, Mapping):
        raw = copy.deepcopy(dict(config))
    else:
        raw = read_yaml(config) if config is not None else {}
    move_keys(raw)
    if isinstance(overrides, str):
        raise ValueError(f"overrides: give a list of 'key=value' or a mapping, got {overrides!r}")
    if isinstance(overrides, Mapping):
        for key, value in overrides.items():
            set_dotted(raw, new_key(key), value)
    else:
        for item in overrides or []:
            apply_override(raw, item)
    fill_model_section(raw)
    return from_dict(Config, raw)


def other_processes(cfg: Config, nproc: int) -> str | None:
    """Why a process other than this one needs the reward function, or None."""
    if nproc > 1:
        return f"the {nproc} processes of nproc={nproc}"
    if cfg.reward.num_workers:
        return f"the worker processes of reward.num_workers={cfg.reward.num_workers}"
    if cfg.rollout.max_staleness:
        return f"the rollout producer of rollout.max_staleness={cfg.rollout.max_staleness}"
    return None


@contextlib.contextmanager
def _reward_in_config(
    cfg: Config, reward_fn: Callable[..., Any] | None, elsewhere: str | None
) -> Iterator[None]:
    """``cfg.reward`` set to call ``reward_fn`` (by name, held here, or pickled), for as
    long as the block runs."""
    from megatron_grpo.rewards import custom

    if reward_fn is None:
        yield
        return
    if not callable(reward_fn):
        raise ValueError(f"reward_fn must be callable, got {type(reward_fn).__name__}")
    as_custom = functools.partial(
        dataclasses.replace, cfg.reward, type="custom", custom_function=None, custom_pickle=None
    )
    spec = custom.importable_spec(reward_fn)
    if spec is not None:
        cfg.reward = as_custom(custom_function=spec)
        yield
    elif elsewhere is None:
        with custom.held(reward_fn) as spec:
            cfg.reward = as_custom(custom_function=spec)
            yield
    else:
        try:
            data = custom.pickled(reward_fn)
        except ValueError as e:
            name = getattr(reward_fn, "__qualname__", type(reward_fn).__qualname__)
            raise ValueError(
                f"reward_fn {name} cannot reach {elsewhere}: {e}. Define it at the top level "
                "of a module of its own and import it from there (e.g. my_rewards.py beside "
                "the notebook: from my_rewards import ...), or train in this process alone "
                "(nproc=1, reward.num_workers=0, rollout.max_staleness=0)"
            ) from None
        path = Path(cfg.output_dir) / "reward_fn.pkl"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        cfg.reward = as_custom(custom_pickle=str(path.resolve()))
        yield


def _train_here(cfg: Config) -> None:
    """Train in this process (one rank of torchrun's, or the only one), as
    ``megatron-grpo train`` does; the process group goes when it is done."""
    import torch.distributed as dist

    from megatron_grpo.mcore.parallel import destroy_parallel
    from megatron_grpo.train.loop import train as train_loop
    from megatron_grpo.train.preflight import check_paths, preflight

    check_paths(cfg)
    preflight(cfg, int(os.environ.get("WORLD_SIZE", "1")))
    ours = not dist.is_initialized()  # a torchrun script may have started its own
    try:
        with _run_tempdir():
            train_loop(cfg)
    finally:
        if ours:
            destroy_parallel()
        else:
            from megatron.core import parallel_state

            parallel_state.destroy_model_parallel()


@functools.cache
def _process_tempdir() -> str:
    """A directory of this process's own, removed when it ends however it ends
    (``launch.use_private_tempdir``), without changing ``tempfile``'s default for good."""
    from megatron_grpo.launch import use_private_tempdir

    default = tempfile.tempdir
    path = use_private_tempdir()
    tempfile.tempdir = default
    return path


@contextlib.contextmanager
def _run_tempdir() -> Iterator[None]:
    """``tempfile``'s default for one run (an embedded engine's model files): a directory
    removed after it, and with this process."""
    default = tempfile.tempdir
    with tempfile.TemporaryDirectory(dir=_process_tempdir()) as path:
        tempfile.tempdir = path
        try:
            yield
        finally:
            tempfile.tempdir = default


def _with_import_root(env: Mapping[str, str], spec: str | None) -> dict[str, str]:
    """``env`` with the directory that the module of ``spec`` was imported from (a package
    beside the notebook, or on a ``sys.path`` entry the notebook added) first on
    ``PYTHONPATH``, so that the processes started from it import that module too."""
    env = dict(env)
    module = sys.modules.get((spec or "").partition(":")[0])
    file = getattr(module, "__file__", None)
    if module is None or file is None:
        return env
    root = Path(file).resolve().parent
    depth = module.__name__.count(".") + (Path(file).name == "__init__.py")
    for _ in range(depth):
        root = root.parent
    installed = {Path(sys.prefix).resolve(), Path(sys.base_prefix).resolve()}
    if any(root.is_relative_to(prefix) for prefix in installed):  # a fresh process finds it
        return env
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), env.get("PYTHONPATH")) if p)
    return env


def _launch(cfg: Config, nproc: int) -> None:
    """``megatron-grpo train --nproc`` on the resolved config; its output goes to this
    process's stdout (a notebook's cell too) line by line."""
    from megatron_grpo.launch import die_with_parent

    with tempfile.TemporaryDirectory(prefix="megatron_grpo_api_") as tmp:
        path = Path(tmp) / "config.yaml"
        path.write_text(dump_config(cfg))
        cmd = [sys.executable, "-m", "megatron_grpo.cli", "train", "--config", str(path)]
        cmd += ["--nproc", str(nproc)]
        tail: collections.deque[str] = collections.deque(maxlen=OUTPUT_TAIL_LINES)
        with subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            env=_with_import_root(os.environ, cfg.reward.custom_function),
            preexec_fn=die_with_parent,
        ) as proc:
            try:
                assert proc.stdout is not None
                for line in proc.stdout:
                    sys.stdout.write(line)
                    tail.append(line.rstrip("\n"))
            except BaseException:  # an interrupt: the launch (and torchrun with it) ends too
                proc.terminate()
                raise
        code = proc.returncode
    if code == 0:
        return
    errors = [line.removeprefix(ERROR_PREFIX) for line in tail if line.startswith(ERROR_PREFIX)]
    if code == 2 and errors:  # refused before or by a worker: a config error
        raise ValueError(errors[-1])
    shown = errors[-1] if errors else "\n".join(tail)
    raise RuntimeError(f"megatron-grpo train --nproc {nproc} failed (exit code {code}): {shown}")
