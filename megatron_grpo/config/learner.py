"""The learner's sections: optimizer, loss, and the training loop."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

Mode = Literal[
    "token-mean",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
    "group-token-mean",
    "group-seq-mean",
]
"""Loss aggregation modes (docs/loss_normalization.md)."""
MODES: tuple[str, ...] = get_args(Mode)


def check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(
            f"unknown loss aggregation mode {mode!r}; expected one of {', '.join(MODES)}"
        )


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
    use_distributed_optimizer: bool = False
    """Shard the optimizer state (fp32 master weights and Adam's two moments, 12 of the 18
    bytes per parameter) over the data-parallel ranks: megatron-core's distributed optimizer
    (ZeRO-1). Adam only. Off unless set, as in Megatron-LM and slime; the recipes set it.
    Checked by check-invariance --features distopt; a resume continues bit for bit."""
    overlap_grad_reduce: bool = True
    """Reduce (or reduce-scatter) gradients in buckets while the backward pass runs."""
    overlap_param_gather: bool = True
    """With the distributed optimizer: all-gather the updated parameters during the next
    forward pass instead of right after the step. The trainer gathers them first whenever
    it reads the weights (weight sync, checkpoints)."""

    def __post_init__(self) -> None:
        if self.use_distributed_optimizer and self.optimizer != "adam":
            raise ValueError(
                f"optim.use_distributed_optimizer=true needs optim.optimizer=adam, got "
                f"{self.optimizer!r} (megatron-core shards only Adam's state)"
            )
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
    old_logprobs: Literal["learner", "rollout"] = "learner"
    """The old policy of the PPO ratio: the learner's log-probs before the step, or the
    rollout engine's (the policy that generated the samples: with rollout.max_staleness
    >= 1 the ratio and its clipping are then taken against that older policy)."""
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
        if self.old_logprobs == "rollout" and self.tis_level is not None:
            raise ValueError(
                "loss.tis_level corrects the learner's old log-probs toward the engine's; with "
                "loss.old_logprobs=rollout the ratio is already taken against the engine's"
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


GATE_DEFAULTS: dict[str, dict[str, float]] = {
    "float32": {
        "first_step_mismatch": 1e-3,
        "first_step_mismatch_max": 0.1,
        "first_step_rollout_kl": 1e-4,
        "stop_mismatch": 0.5,
    },
    "bfloat16": {
        "first_step_mismatch": 0.1,
        "first_step_mismatch_max": 10.0,
        "first_step_rollout_kl": 0.05,
        "stop_mismatch": 0.5,
    },
}
"""The gates' thresholds by ``model.params_dtype`` (see ``GatesConfig`` for the figures
behind them); ``stop_mismatch`` per step of policy lag (1 + ``rollout.max_staleness``)."""


@dataclass(kw_only=True)
class GatesConfig:
    """On-policy gates: the learner must train the policy that generated its samples.

    At the first on-policy step (step 1 of a fresh run, the first step after a resume: the
    engines have just been given the learner's weights) the learner's log-probs of the
    sampled tokens are compared with the engine's, on the RL step's first optimizer step,
    before the optimizer consumes its gradients: a figure above its threshold stops the
    run with one line naming it, and nothing of that step is trained. Every later step
    stops on ``stop_mismatch``. Each threshold: None (the default) takes the value for
    ``model.params_dtype`` (``GATE_DEFAULTS``; the stop threshold times 1 +
    ``rollout.max_staleness``; config.yaml shows them resolved), 0 turns the gate off. A
    resume may change them. Replayed samples (``rollout.replay_dir``) pass no gate:
    another run's engines made them.

    Measured on the CPU demos (2 processes, 10 steps each; docs/options.md): with a
    float32 learner and engine, the dense, MoE and tool demos' mean |learner - engine|
    log-prob is 1e-7 to 8e-7, its largest token 1.4e-6 (dense, MoE) and 6.4e-5 (tool),
    |rollout_kl| at most 1.3e-7. A bfloat16 learner beside the float32 engine: mean 2e-3 to
    3.5e-3, largest token up to 0.09, |rollout_kl| up to 2.7e-4. At step 1, an engine that
    keeps random weights (its updates lost): mean 2.7, largest 5.2, rollout_kl 2.4; trained
    tokens re-encoded with another vocabulary (end of sequence and padding swapped): mean
    2.3, largest 6.4, rollout_kl 2.3."""

    first_step_mismatch: float | None = None
    """Largest ``train/logprob_mismatch`` (the mean over loss tokens of |learner - engine|
    log-prob) at the first on-policy step. None: 1e-3 for float32 (a thousand times the
    demos' 1e-7 to 8e-7; below the 2e-3 of one side computing in bf16, so a bf16 engine
    beside a float32 learner stops too), 0.1 for bfloat16 (slime's CI bound on its
    train_rollout_logprob_abs_diff; one reported bf16 slime run started at 0.011)."""
    first_step_mismatch_max: float | None = None
    """Largest ``train/logprob_mismatch_max`` (|learner - engine| log-prob of the worst loss
    token) at the first on-policy step: a few tokens far off (a special token with another
    id) that the mean dilutes. None: 0.1 for float32 (the demos' worst token is 6.4e-5 at
    most), 10 for bfloat16 (rare tokens of long bf16 generations differ by nats: raise it,
    or set 0, if a healthy run of yours stops here)."""
    first_step_rollout_kl: float | None = None
    """Largest |``train/rollout_kl``| (the mean over loss tokens of engine - learner
    log-prob: the k1 estimate of KL(engine || learner) on the engine's samples) at the
    first on-policy step. None: 1e-4 for float32 (the demos are below 1.3e-7), 0.05 for
    bfloat16."""
    stop_mismatch: float | None = None
    """Largest ``train/logprob_mismatch`` at every later step: a mismatch that runs away
    (an engine that stops taking the pushes, numerics that drift) ends the run. With
    ``rollout.max_staleness`` k >= 1 it also holds the policy lag of up to k steps. None:
    0.5 x (1 + k), generous: synchronous, the demos stay at 1e-7 and an engine that stopped
    taking pushes passes 0.5 at the demo's step 5 (one reported bf16 slime run went from
    0.011 to 0.036 in 30 steps); asynchronous at the demos' lr 1e-3, the dense demo reaches
    0.16 (k = 1, 2; 256 samples a step) and tests/e2e/test_async.py's run 0.65 (k = 2, 16
    samples a step, an engine killed), under its 1.5."""

    def __post_init__(self) -> None:
        for name, value in self.thresholds().items():
            if value is not None and not value >= 0:
                raise ValueError(f"train.gates.{name} must be >= 0 (0: off), got {value}")

    def thresholds(self) -> dict[str, float | None]:
        return {name: getattr(self, name) for name in GATE_DEFAULTS["float32"]}

    def resolve_defaults(self, params_dtype: str, max_staleness: int) -> None:
        """Fill the thresholds left None with ``params_dtype``'s (float16 as bfloat16), the
        stop threshold widened for ``max_staleness`` steps of policy lag."""
        defaults = GATE_DEFAULTS["float32" if params_dtype == "float32" else "bfloat16"]
        for name, value in self.thresholds().items():
            if value is None:
                lag = 1 + max_staleness if name == "stop_mismatch" else 1
                setattr(self, name, defaults[name] * lag)


@dataclass(kw_only=True)
class TrainConfig:
    """The RL loop: steps, batch sizes, micro-batching, checkpoints."""

    total_steps: int = 10
    """RL steps (rollout + optimizer steps + weight sync) to run in total."""
    global_batch_size: int | None = None
    """Samples per optimizer step. None (the default): the whole rollout batch (one step),
    set when the config is built (the resolved config shows it)."""
    num_iterations: int = 1
    """mu: optimizer passes over each rollout batch (old log-probs computed once)."""
    max_tokens_per_micro_batch: int = 4096
    """Token budget of one micro-batch on one rank, padding included."""
    pack_sequences: bool | None = None
    """Pack samples end to end in micro-batches; None packs unless Transformer Engine is used."""
    init: str | None = None
    """Initial weights: a Hugging Face directory or a megatron checkpoint; None is random."""
    save_interval: int = 0
    """Save a checkpoint every this many steps (and at the end); 0 saves only at the end."""
    keep_last: int = 2
    """Checkpoints kept on disk."""
    save_hf_interval: int | None = None
    """Write the policy as a Hugging Face model (safetensors, config, generation config,
    tokenizer) to ``<output_dir>/hf/step_<N>`` every this many steps and at the last step,
    each pipeline stage its own layers; 0 or None writes none. All are kept."""
    allow_config_change: bool = False
    """Resume a run whose saved config differs in what was trained (``optim.lr``, the model,
    the data, ...); without it such a resume is refused, naming the keys
    (train/run_start.py). ``megatron-grpo train --allow-config-change`` sets it."""
    recompute_granularity: Literal["full", "selective"] | None = None
    """Recompute activations in the backward pass instead of keeping them (megatron-core's
    activation checkpointing): ``full`` keeps only the input of each recomputed layer,
    ``selective`` recomputes ``recompute_modules`` inside every layer; None keeps all."""
    recompute_method: Literal["uniform", "block"] = "uniform"
    """full: ``uniform`` recomputes every layer, in groups of ``recompute_num_layers``;
    ``block`` recomputes the first ``recompute_num_layers`` layers of each pipeline stage."""
    recompute_num_layers: int = 1
    """full: layers per recomputed group (uniform) or recomputed layers per stage (block)."""
    recompute_modules: list[str] = field(default_factory=lambda: ["core_attn"])
    """selective: the parts of a layer to recompute (megatron-core's names, e.g. core_attn,
    mlp, layernorm)."""
    collective_timeout_s: float = 600.0
    """Limit for one collective (torch.distributed's and megatron-core's groups): a rank
    that waits longer reports a hang. Rollouts and evaluations are waited for outside
    collectives, so they may take longer; a main rank that stops for this long during one
    is reported."""
    gates: GatesConfig = field(default_factory=GatesConfig)
    """On-policy gates: the run stops when the engines' log-probs are not the learner's."""
    routing_replay: Literal["off", "r2", "r3"] = "off"
    """Mixture-of-experts routing replay (``mcore.routing_replay``): ``r3`` makes every
    forward pass of the policy route each token to the experts the rollout engine routed it
    to (the engines return them: SGLang's ``--enable-return-routed-experts``), ``r2`` to
    the experts the learner's own routers chose in the behaviour log-prob pass; in both the
    gates stay the learner's router probabilities of those experts, so the routers train.
    ``off`` routes afresh in every pass. The peers' names: slime's
    ``--use-rollout-routing-replay`` / ``--use-routing-replay``, verl's
    ``router_replay.mode=R3|R2``."""

    def __post_init__(self) -> None:
        if self.recompute_num_layers < 1:
            raise ValueError(
                f"train.recompute_num_layers must be >= 1, got {self.recompute_num_layers}"
            )
        if self.recompute_granularity == "selective" and not self.recompute_modules:
            raise ValueError("train.recompute_granularity=selective needs train.recompute_modules")
        if self.routing_replay not in ("off", "r2", "r3"):
            raise ValueError(
                f"train.routing_replay must be off, r2 or r3, got {self.routing_replay!r}"
            )
        for name in ("total_steps", "num_iterations", "max_tokens_per_micro_batch", "keep_last"):
            if getattr(self, name) < 1:
                raise ValueError(f"train.{name} must be >= 1, got {getattr(self, name)}")
        if self.global_batch_size is not None and self.global_batch_size < 1:
            raise ValueError(f"train.global_batch_size must be >= 1, got {self.global_batch_size}")
        if self.save_interval < 0:
            raise ValueError(f"train.save_interval must be >= 0, got {self.save_interval}")
        if self.save_hf_interval is not None and self.save_hf_interval < 0:
            raise ValueError(f"train.save_hf_interval must be >= 0, got {self.save_hf_interval}")
        if not self.collective_timeout_s > 0:
            raise ValueError(
                f"train.collective_timeout_s must be > 0, got {self.collective_timeout_s}"
            )
