"""How a run starts in its output directory: fresh, resumed, or already complete.

The saved config describes the checkpoints beside it, so a resume may change only what
does not change what was trained: how long to go on, how often to save, log and evaluate,
how long to wait and when to stop (``RESUMABLE``). Any other difference refuses the resume by name,
unless the user asks for it (``train.allow_config_change``). ``config.yaml`` is the
config the run started with and is never rewritten; a resume whose config differs keeps
its own beside it, ``config.resume_step_<N>.yaml``, which the next resume compares with.
A config saved before some of its keys moved is compared under their new names.
"""

from __future__ import annotations

import copy
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from megatron_grpo.config import Config, dump_config, from_dict, move_keys, to_dict
from megatron_grpo.train.state import latest_checkpoint

CONFIG_FILE = "config.yaml"
RESUME_CONFIG = "config.resume_step_{step:08d}.yaml"

RESUMABLE = (
    "train.total_steps",
    "train.save_interval",
    "train.save_hf_interval",
    "train.keep_last",
    "train.gates.",
    "metrics.",
    "eval.",
)
"""Keys (or ``section.`` prefixes) a resume may change; so may any ``*_timeout_s``."""


class ConfigChangedError(ValueError):
    """A resume whose config differs from the run's in what was trained."""


@dataclass(frozen=True)
class RunStart:
    kind: Literal["fresh", "resume", "complete"]
    step: int
    """The step of the checkpoint resumed from (0 for a fresh run)."""
    checkpoint: Path | None
    changed: dict[str, tuple[Any, Any]] = field(default_factory=dict)
    """Keys whose value differs from the saved config: ``{key: (saved, now)}``."""

    def describe(self, cfg: Config) -> str:
        """The line that says how the run starts."""
        out, total = cfg.output_dir, cfg.train.total_steps
        if self.kind == "fresh":
            return f"megatron-grpo: starting a new run in {out} ({total} steps)"
        if self.kind == "complete":
            return (
                f"megatron-grpo: the run in {out} is complete (step {self.step} of {total}); "
                "nothing to train. Raise train.total_steps to go on, or set another output_dir"
            )
        changes = "".join(f"; {k}: {a!r} -> {b!r}" for k, (a, b) in self.changed.items())
        return (
            f"megatron-grpo: resuming the run in {out} from step {self.step} "
            f"({self.checkpoint}) to step {total}{changes}"
        )


def plan_start(cfg: Config) -> RunStart:
    """How ``cfg``'s run starts, from its output directory's files alone (any process may
    call it; nothing is written). A refused resume raises ConfigChangedError."""
    out = Path(cfg.output_dir)
    checkpoint = latest_checkpoint(out)
    if checkpoint is None:
        return RunStart("fresh", 0, None)
    step = _step_of(checkpoint)
    saved_path = saved_config_path(out)
    changed = {}
    if saved_path is not None:
        changed = config_changes(yaml.safe_load(saved_path.read_text()) or {}, to_dict(cfg))
        refused = [k for k in changed if not _resumable(k)]
        if refused and not cfg.train.allow_config_change:
            shown = ", ".join(f"{k} ({changed[k][0]!r} -> {changed[k][1]!r})" for k in refused)
            raise ConfigChangedError(
                f"{out} holds checkpoints of a run whose config ({saved_path.name}) differs in "
                f"{shown}: to resume with the change anyway, pass --allow-config-change (set "
                "train.allow_config_change=true); to start afresh, set another output_dir"
            )
    kind: Literal["resume", "complete"] = "complete" if step >= cfg.train.total_steps else "resume"
    return RunStart(kind, step, checkpoint, changed)


def record_start(cfg: Config, start: RunStart) -> None:
    """The main rank's record of the run's config: ``config.yaml`` for a new run, a resume
    config beside it when a resume changes anything."""
    out = Path(cfg.output_dir)
    if start.kind == "fresh":
        (out / CONFIG_FILE).write_text(dump_config(cfg))
    elif start.changed or saved_config_path(out) is None:
        (out / RESUME_CONFIG.format(step=start.step)).write_text(dump_config(cfg))


def saved_config_path(out: Path) -> Path | None:
    """The config the checkpoints were last trained with: the newest resume config, else
    ``config.yaml``; None when there is neither."""
    resumes = sorted(out.glob("config.resume_step_*.yaml"))
    if resumes:
        return resumes[-1]
    first = out / CONFIG_FILE
    return first if first.exists() else None


def config_changes(saved: dict[str, Any], now: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """Dotted keys whose value differs, a moved key of ``saved`` under its new name
    (``MOVED_KEYS``); keys only one side has (an option added or removed by another version
    of this package) are not compared."""
    saved = copy.deepcopy(saved)
    move_keys(saved, warn=False)  # the saved config is the package's, not the user's
    a, b = _flatten(_resolved(saved)), _flatten(now)
    keys = sorted(a.keys() & b.keys() - {"train.allow_config_change"})
    return {k: (a[k], b[k]) for k in keys if a[k] != b[k]}


def _resolved(saved: dict[str, Any]) -> dict[str, Any]:
    """The saved config with the defaults this version resolves filled in as it fills them
    (an older run saved ``null`` for them), when it loads; else as it is."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return to_dict(from_dict(Config, saved))
    except (ValueError, TypeError, KeyError):
        return saved


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:  # YAML and the dataclasses agree on lists and tuples once dumped
            flat[f"{prefix}{key}"] = list(value) if isinstance(value, tuple) else value
    return dict(sorted(flat.items()))


def _resumable(key: str) -> bool:
    return key.endswith("_timeout_s") or any(
        key == k or (k.endswith(".") and key.startswith(k)) for k in RESUMABLE
    )


def _step_of(checkpoint: Path) -> int:
    match = re.fullmatch(r"step_(\d+)", checkpoint.name)
    if match is None:
        raise ValueError(f"{checkpoint} is not named step_<N>, as this package saves them")
    return int(match.group(1))


def config_summary(cfg: Config) -> str:
    """A few lines on what the run trains, for the console (the whole config is in the
    output directory)."""
    m, p, r, t = cfg.model, cfg.parallel, cfg.rollout, cfg.train
    init = cfg.train.init or "random weights"
    return "\n".join(
        [
            f"  model: {m.num_layers} layers, hidden {m.hidden_size}, vocabulary "
            f"{m.vocab_size}, from {init}; layout TP={p.tp} PP={p.pp} CP={p.cp} EP={p.ep}",
            f"  steps: {t.total_steps} x {r.prompts_per_step} prompts x "
            f"{r.samples_per_prompt} samples; loss {cfg.loss.mode}, lr {cfg.optim.lr:g}; "
            f"rollout engine {r.engines.type}",
            f"  config: {Path(cfg.output_dir) / CONFIG_FILE} (--print-config prints it here)",
        ]
    )
