"""Typed configuration: nested keyword-only dataclasses, loaded from YAML.

``load_config(path, overrides)`` reads a YAML file, applies dotted
``key=value`` overrides (``optim.lr=1e-6``), and builds the dataclasses.
An unknown key, a value of the wrong type, or an invalid value is a
``ValueError`` that names the key.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from megatron_grpo.advantages import AdvantageConfig
from megatron_grpo.data import DataConfig
from megatron_grpo.metrics import MetricsConfig
from megatron_grpo.normalization import Mode, check_mode
from megatron_grpo.parallel import ParallelDims
from megatron_grpo.rewards.config import RewardConfig
from megatron_grpo.rollout_stage import RolloutConfig


@dataclass(kw_only=True)
class ModelConfig:
    """A Llama / Qwen2 / Qwen3-style decoder (RMSNorm, SwiGLU, RoPE, GQA)."""

    num_layers: int = 2
    """Number of transformer layers."""
    hidden_size: int = 64
    """Model width."""
    ffn_hidden_size: int = 128
    """Width of the SwiGLU MLP (per branch)."""
    num_attention_heads: int = 4
    """Query heads."""
    num_query_groups: int | None = None
    """Key/value heads (GQA); None means one per query head."""
    head_dim: int | None = None
    """Channels per head; None means hidden_size / num_attention_heads."""
    vocab_size: int = 256
    """Tokenizer vocabulary size (before padding for TP)."""
    make_vocab_size_divisible_by: int = 128
    """The embedding is padded to a multiple of this times TP."""
    max_position_embeddings: int = 512
    """Longest sequence the model is built for."""
    rotary_base: float = 10000.0
    """RoPE base (theta)."""
    rope_scaling_factor: float | None = None
    """Llama 3.1-style RoPE scaling factor (HF ``rope_type: llama3``); None disables it.
    megatron-core fixes the other llama3 parameters: low/high frequency factors 1 and 4,
    original context 8192."""
    norm_epsilon: float = 1e-6
    """RMSNorm epsilon."""
    add_qkv_bias: bool = False
    """QKV projection bias (Qwen2)."""
    qk_layernorm: bool = False
    """RMSNorm on queries and keys (Qwen3)."""
    tie_embeddings: bool = False
    """Share the input embedding and the output layer."""
    init_method_std: float = 0.02
    """Standard deviation of the weight initialization."""
    params_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Parameter and activation dtype."""

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads"):
            if getattr(self, name) < 1:
                raise ValueError(f"model.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"model.num_attention_heads={self.num_attention_heads} is not divisible by "
                f"model.num_query_groups={self.num_query_groups}"
            )
        if self.rope_scaling_factor is not None and self.rope_scaling_factor <= 0:
            raise ValueError(
                f"model.rope_scaling_factor must be > 0, got {self.rope_scaling_factor}"
            )
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"model.hidden_size={self.hidden_size} is not divisible by "
                f"model.num_attention_heads={self.num_attention_heads}; set model.head_dim"
            )

    def padded_vocab_size(self, tp: int) -> int:
        multiple = self.make_vocab_size_divisible_by * tp
        return -(-self.vocab_size // multiple) * multiple


@dataclass(kw_only=True)
class OptimConfig:
    """megatron-core optimizer and learning-rate schedule."""

    optimizer: Literal["adam", "sgd"] = "adam"
    """Optimizer; plain SGD is there for invariance checks."""
    lr: float = 1e-6
    """Peak learning rate."""
    min_lr: float = 0.0
    """Learning rate at the end of the decay."""
    weight_decay: float = 0.0
    """Decoupled weight decay."""
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    """Global gradient-norm clip; 0 disables clipping."""
    lr_warmup_steps: int = 0
    """Linear warm-up steps."""
    lr_decay_steps: int | None = None
    """Steps over which the rate decays after warm-up; None means constant."""
    lr_decay_style: Literal["constant", "linear", "cosine"] = "constant"
    """Shape of the decay."""

    def __post_init__(self) -> None:
        if self.lr < 0 or self.min_lr < 0:
            raise ValueError(
                f"optim.lr and optim.min_lr must be >= 0, got {self.lr}, {self.min_lr}"
            )
        if self.min_lr > self.lr:
            raise ValueError(f"optim.min_lr={self.min_lr} is above optim.lr={self.lr}")
        if self.clip_grad < 0:
            raise ValueError(f"optim.clip_grad must be >= 0, got {self.clip_grad}")
        if self.lr_warmup_steps < 0:
            raise ValueError(f"optim.lr_warmup_steps must be >= 0, got {self.lr_warmup_steps}")
        if self.lr_decay_style != "constant" and not self.lr_decay_steps:
            raise ValueError(
                f"optim.lr_decay_style={self.lr_decay_style!r} needs optim.lr_decay_steps"
            )


@dataclass(kw_only=True)
class LossConfig:
    """The GRPO objective: aggregation mode, clipping, KL, entropy, importance sampling."""

    mode: Mode = "token-mean"
    """How per-token losses are aggregated (docs/loss_normalization.md)."""
    max_len: int | None = None
    """L for seq-mean-token-sum-norm (Dr. GRPO); None means the max completion length."""
    eps_clip_low: float = 0.2
    """Lower PPO clip: ratios below 1 - eps_clip_low are clipped."""
    eps_clip_high: float = 0.2
    """Upper PPO clip (clip-higher, e.g. 0.28 in DAPO)."""
    dual_clip: float | None = None
    """Dual-clip constant c > 1 bounding the loss of negative advantages; None disables."""
    ratio_level: Literal["token", "sequence"] = "token"
    """Importance ratio per token (PPO/GRPO) or per sequence (GSPO)."""
    kl_coef: float = 0.0
    """Coefficient of the KL penalty to the reference model; 0 disables it."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator (k3 is the low-variance one)."""
    entropy_coef: float = 0.0
    """Coefficient of the entropy bonus (subtracted from the loss)."""
    tis_level: Literal["token", "sequence"] | None = None
    """Truncated importance sampling against the rollout engine's log-probs; None disables."""
    tis_mode: Literal["truncate", "mask"] = "truncate"
    """Cap weights at tis_upper, or zero tokens whose weight is outside [tis_lower, tis_upper]."""
    tis_upper: float = 2.0
    """Upper bound of the importance weight."""
    tis_lower: float | None = None
    """Lower bound for tis_mode=mask."""

    def __post_init__(self) -> None:
        check_mode(self.mode)
        if self.eps_clip_low < 0 or self.eps_clip_high < 0 or self.eps_clip_low >= 1:
            raise ValueError(
                f"loss.eps_clip_low must be in [0, 1) and loss.eps_clip_high >= 0, "
                f"got {self.eps_clip_low}, {self.eps_clip_high}"
            )
        if self.dual_clip is not None and self.dual_clip <= 1:
            raise ValueError(f"loss.dual_clip must be > 1, got {self.dual_clip}")
        if self.max_len is not None and self.max_len <= 0:
            raise ValueError(f"loss.max_len must be positive, got {self.max_len}")
        if self.tis_upper <= 0 or (
            self.tis_lower is not None and not 0 <= self.tis_lower < self.tis_upper
        ):
            raise ValueError(
                f"loss.tis_lower/tis_upper must satisfy 0 <= lower < upper, "
                f"got {self.tis_lower}, {self.tis_upper}"
            )


@dataclass(kw_only=True)
class TrainConfig:
    """The RL loop: steps, batch sizes, micro-batching, checkpoints."""

    total_steps: int = 10
    """RL steps (rollout + optimizer steps + weight sync) to run in total."""
    global_batch_size: int | None = None
    """Samples per optimizer step; None means the whole rollout batch (one step)."""
    num_iterations: int = 1
    """mu: optimizer passes over each rollout batch (old log-probs computed once)."""
    max_tokens_per_micro_batch: int = 4096
    """Token budget of one micro-batch on one rank, padding included."""
    pack_sequences: bool | None = None
    """Pack samples end to end in micro-batches; None packs unless Transformer Engine is used."""
    init: str | None = None
    """Initial weights: a Hugging Face directory or a megatron checkpoint; None is random."""
    hf_family: Literal["llama", "qwen2", "qwen3"] = "qwen2"
    """HF architecture the weights map to (weight sync, export)."""
    save_interval: int = 0
    """Save a checkpoint every this many steps (and at the end); 0 saves only at the end."""
    keep_last: int = 2
    """Checkpoints kept on disk."""

    def __post_init__(self) -> None:
        for name in ("total_steps", "num_iterations", "max_tokens_per_micro_batch", "keep_last"):
            if getattr(self, name) < 1:
                raise ValueError(f"train.{name} must be >= 1, got {getattr(self, name)}")
        if self.global_batch_size is not None and self.global_batch_size < 1:
            raise ValueError(f"train.global_batch_size must be >= 1, got {self.global_batch_size}")
        if self.save_interval < 0:
            raise ValueError(f"train.save_interval must be >= 0, got {self.save_interval}")


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

    def __post_init__(self) -> None:
        rollout_batch = self.rollout.prompts_per_step * self.rollout.samples_per_prompt
        gbs = self.train.global_batch_size or rollout_batch
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
        if longest > self.model.max_position_embeddings:
            raise ValueError(
                f"model.max_position_embeddings={self.model.max_position_embeddings} is below "
                f"data.max_prompt_length + rollout.max_new_tokens = {longest}"
            )


# --------------------------------------------------------------------------- loading


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Config from a YAML file (or the defaults) and dotted ``key=value`` overrides."""
    raw: dict[str, Any] = {}
    if path is not None:
        text = Path(path).read_text()
        loaded = yaml.safe_load(text)
        if loaded is not None and not isinstance(loaded, dict):
            raise ValueError(f"{path}: the top level of a config must be a mapping")
        raw = loaded or {}
    for item in overrides or []:
        apply_override(raw, item)
    return build(Config, raw, prefix="")


def apply_override(raw: dict[str, Any], item: str) -> None:
    """Apply ``a.b.c=value`` to a nested dict; the value is parsed as YAML."""
    key, sep, value = item.partition("=")
    if not sep or not key:
        raise ValueError(f"override {item!r} is not of the form key=value")
    *parents, leaf = key.strip().split(".")
    node = raw
    for part in parents:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ValueError(f"override {item!r}: {part!r} is not a section")
        node = child
    node[leaf] = yaml.safe_load(value)


def build(cls: type, raw: Any, *, prefix: str) -> Any:
    """Build dataclass ``cls`` from a dict, checking keys and value types."""
    where = prefix.rstrip(".") or "config"
    if not isinstance(raw, dict):
        raise ValueError(f"{where} must be a mapping, got {type(raw).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise ValueError(
            f"unknown config key '{prefix}{unknown[0]}'"
            f" (known keys in {where}: {', '.join(sorted(fields))})"
        )
    kwargs = {name: _convert(hints[name], value, f"{prefix}{name}") for name, value in raw.items()}
    try:
        return cls(**kwargs)
    except TypeError as e:  # a required field is missing
        raise ValueError(f"{where}: {e}") from None


def _convert(tp: Any, value: Any, key: str) -> Any:
    if dataclasses.is_dataclass(tp):
        return build(tp, value, prefix=key + ".")  # type: ignore[arg-type]
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(tp)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _convert(option, value, key)
            except ValueError as e:
                errors.append(str(e))
        raise ValueError(errors[0])
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise ValueError(f"{key}={value!r} is not one of {', '.join(map(repr, choices))}")
        return value
    if origin in (list, tuple):
        if not isinstance(value, list | tuple):
            raise ValueError(f"{key} must be a list, got {value!r}")
        (item_tp, *_) = typing.get_args(tp) or (Any,)
        return origin(_convert(item_tp, v, f"{key}[{i}]") for i, v in enumerate(value))
    if origin is dict:
        if not isinstance(value, dict):
            raise ValueError(f"{key} must be a mapping, got {value!r}")
        return dict(value)
    if tp is Any:
        return value
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str):
        try:
            return float(value)  # YAML reads 1e-6 as a string
        except ValueError:
            pass
    if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
        raise ValueError(f"{key} must be {tp.__name__}, got {value!r}")
    return value


def to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def dump_config(cfg: Any) -> str:
    """The resolved config as YAML, for printing at start and saving beside checkpoints."""
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)
