"""The run's configuration: typed sections, loaded from YAML with dotted overrides.

``load_config(path, overrides)`` reads a YAML file, applies ``key=value``
overrides (``optim.lr=1e-6``), takes the model's architecture from
``train.init`` when that checkpoint names it (config/init_model.py) and builds
``Config``; every section is a keyword-only dataclass with a docstring per
field, checked when built:
- ``model``, ``parallel``: config/model.py; the model from a Hugging Face
  ``config.json``: config/hf.py
- ``optim``, ``loss``, ``train``: config/learner.py
- ``rollout`` (with ``rollout.sampling``, ``.engines``, ``.client``, ``.sync``,
  ``.tools``), ``data``, ``advantages``: config/rollout.py
- ``reward`` (with ``reward.format``, ``reward.remote``): config/reward.py
- ``eval``: config/eval.py
- ``metrics`` and the run as a whole: here.

A key that moved keeps working under its old name (``loader.MOVED_KEYS``): it loads into
its new place with a ``MovedKeyWarning`` naming the new one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_grpo.config.eval import EvalConfig, EvalDatasetConfig
from megatron_grpo.config.init_model import fill_model_section
from megatron_grpo.config.learner import (
    MODES,
    GatesConfig,
    LossConfig,
    Mode,
    OptimConfig,
    TrainConfig,
    check_mode,
)
from megatron_grpo.config.loader import (
    MOVED_KEYS,
    MovedKeyWarning,
    apply_override,
    dump_config,
    from_dict,
    move_keys,
    read_yaml,
    to_dict,
)
from megatron_grpo.config.model import ModelConfig, ParallelDims, check_moe_layout
from megatron_grpo.config.reward import (
    FormatRewardConfig,
    RemoteRewardConfig,
    RewardConfig,
    RewardType,
)
from megatron_grpo.config.rollout import (
    AdvantageConfig,
    ColocateConfig,
    DataConfig,
    EngineClientConfig,
    EnginesConfig,
    RolloutConfig,
    SamplingConfig,
    ToolsConfig,
    WeightSyncConfig,
)

__all__ = [
    "MODES",
    "MOVED_KEYS",
    "AdvantageConfig",
    "ColocateConfig",
    "Config",
    "DataConfig",
    "EngineClientConfig",
    "EnginesConfig",
    "EvalConfig",
    "EvalDatasetConfig",
    "FormatRewardConfig",
    "GatesConfig",
    "LossConfig",
    "MetricsConfig",
    "Mode",
    "ModelConfig",
    "MovedKeyWarning",
    "OptimConfig",
    "ParallelDims",
    "RemoteRewardConfig",
    "RewardConfig",
    "RewardType",
    "RolloutConfig",
    "SamplingConfig",
    "ToolsConfig",
    "TrainConfig",
    "WeightSyncConfig",
    "apply_override",
    "check_mode",
    "dump_config",
    "from_dict",
    "load_config",
    "move_keys",
    "to_dict",
]


@dataclass(kw_only=True)
class MetricsConfig:
    """Where metrics go besides ``<output_dir>/metrics.jsonl``."""

    tensorboard: bool = True
    """Write TensorBoard event files under ``<output_dir>/tensorboard``."""
    wandb_project: str | None = None
    """Log to this Weights & Biases project (needs ``wandb`` installed and logged in)."""
    wandb_run_name: str | None = None
    """Run name in wandb; defaults to the output directory's name."""
    print_config: bool = False
    """Print the whole resolved config at start; by default a few lines sum it up (it is
    always in ``<output_dir>/config.yaml``). ``megatron-grpo train --print-config`` sets it."""


@dataclass(kw_only=True)
class Config:
    """The whole run."""

    seed: int = 1234
    """Seed for model initialization and sampling."""
    output_dir: str = "runs/default"
    """Where checkpoints, metrics and the resolved config go."""
    tokenizer: str | None = None
    """Hugging Face tokenizer directory; None uses train.init when it is a HF directory."""
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelDims = field(default_factory=ParallelDims)
    optim: OptimConfig = field(default_factory=OptimConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    advantages: AdvantageConfig = field(default_factory=AdvantageConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    def __post_init__(self) -> None:
        check_moe_layout(
            self.model,
            self.parallel,
            self.train.recompute_granularity,
            routing_replay=self.train.routing_replay,
        )
        self.train.gates.resolve_defaults(self.model.params_dtype, self.rollout.max_staleness)
        if self.rollout.return_routed_experts is None:  # the default, resolved here once
            self.rollout.return_routed_experts = self.train.routing_replay == "r3"
        if self.rollout.return_routed_experts and not self.model.is_moe:
            raise ValueError(
                "rollout.return_routed_experts=true needs a mixture-of-experts model "
                "(model.num_experts)"
            )
        if self.train.routing_replay == "r3" and not self.rollout.return_routed_experts:
            raise ValueError(
                "train.routing_replay=r3 replays the engines' routes: it needs "
                "rollout.return_routed_experts=true (or unset)"
            )
        rollout_batch = self.rollout.prompts_per_step * self.rollout.samples_per_prompt
        if self.train.global_batch_size is None:  # the default, resolved here once
            self.train.global_batch_size = rollout_batch
        gbs = self.train.global_batch_size
        if rollout_batch % gbs:
            raise ValueError(
                f"train.global_batch_size={gbs} does not divide the rollout batch "
                f"rollout.prompts_per_step x rollout.samples_per_prompt = {rollout_batch}"
            )
        if gbs % self.rollout.samples_per_prompt:
            raise ValueError(
                f"train.global_batch_size={gbs} is not a multiple of "
                f"rollout.samples_per_prompt={self.rollout.samples_per_prompt}: "
                "a prompt group must not be split across optimizer steps"
            )
        if self.eval.enabled and self.rollout.replay_dir is not None:
            raise ValueError("eval.datasets needs rollout engines: unset rollout.replay_dir")
        longest = (self.data.max_prompt_length or 0) + self.rollout.max_new_tokens
        if (
            self.data.max_prompt_length is not None
            and longest > self.train.max_tokens_per_micro_batch
        ):
            raise ValueError(
                f"train.max_tokens_per_micro_batch={self.train.max_tokens_per_micro_batch} is "
                "below the longest sample, data.max_prompt_length + rollout.max_new_tokens = "
                f"{longest}"
            )
        longest = max(longest, (self.data.max_prompt_length or 0) + (self.eval.max_new_tokens or 0))
        if longest > self.model.max_position_embeddings:
            raise ValueError(
                f"model.max_position_embeddings={self.model.max_position_embeddings} is below "
                f"data.max_prompt_length + rollout.max_new_tokens (or eval.max_new_tokens) = "
                f"{longest}"
            )
        if self.data.max_prompt_length is None and self.rollout.replay_dir is None:
            self.data.max_prompt_length = self._room_for_prompts()  # (replayed: no prompts)

    def _room_for_prompts(self) -> int:
        """The longest prompt whose sample fits the context and a micro-batch: the default
        of data.max_prompt_length, which the checks above hold for."""
        new_tokens = max(self.rollout.max_new_tokens, self.eval.max_new_tokens or 0)
        room = min(
            self.model.max_position_embeddings - new_tokens,
            self.train.max_tokens_per_micro_batch - self.rollout.max_new_tokens,
        )
        if room < 1:
            raise ValueError(
                f"no room for a prompt: model.max_position_embeddings="
                f"{self.model.max_position_embeddings} and train.max_tokens_per_micro_batch="
                f"{self.train.max_tokens_per_micro_batch} must exceed rollout.max_new_tokens="
                f"{self.rollout.max_new_tokens} (and eval.max_new_tokens)"
            )
        return room


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Config from a YAML file (or the defaults) and dotted ``key=value`` overrides.

    The model's architecture comes from ``train.init`` when that is a Hugging
    Face directory or a converted megatron checkpoint; model fields given as
    well must agree with it (``init_model.fill_model_section``). A moved key,
    in the file or an override, loads into its new place with a warning; an
    override by the old name sets the new key, as one by the new name would.
    """
    raw: dict[str, Any] = read_yaml(path) if path is not None else {}
    move_keys(raw)
    for item in overrides or []:
        apply_override(raw, item)
    fill_model_section(raw)
    return from_dict(Config, raw)
