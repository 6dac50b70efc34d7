"""The ``eval`` section: held-out prompt sets scored during training (pass@k)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(kw_only=True)
class EvalDatasetConfig:
    """One held-out set; the fields left None are taken from the ``data`` section."""

    name: str
    """Its name in the metrics: ``eval/<name>/pass@k``."""
    path: str | list[str]
    """Files or saved dataset folders, as ``data.path``."""
    prompt_key: str | None = None
    label_key: str | None = None
    split: str | None = None
    system_prompt: str | None = None
    max_prompts: int | None = None
    """Use only the first this many prompts; None uses all."""

    def __post_init__(self) -> None:
        if not self.name or "/" in self.name:
            raise ValueError(f"eval.datasets: name {self.name!r} must be non-empty without '/'")
        if not self.path:
            raise ValueError(f"eval.datasets[{self.name}].path is empty")
        if self.max_prompts is not None and self.max_prompts < 1:
            raise ValueError(
                f"eval.datasets[{self.name}].max_prompts must be >= 1, got {self.max_prompts}"
            )


@dataclass(kw_only=True)
class EvalConfig:
    """Evaluation on the main rank with the trainer's rollout engines and reward scorer.

    Each evaluation generates ``samples_per_prompt`` completions of every prompt of every
    set, scores them, and logs ``eval/<name>/pass@<k>`` for each k (the unbiased
    estimator), ``reward_mean`` and ``response_length_mean``, in the step's metrics row.
    Its sampling seed depends only on the step, so a resumed run logs the same values."""

    datasets: list[EvalDatasetConfig] = field(default_factory=list)
    """Held-out sets; none turns evaluation off."""
    interval: int = 0
    """Evaluate after every this many RL steps (and after the last); 0: never during training."""
    at_start: bool = True
    """Evaluate the initial policy, logged as step 0 (not when resuming)."""
    samples_per_prompt: int = 4
    """Completions per prompt: the n of pass@k."""
    k: list[int] = field(default_factory=lambda: [1])
    """The k values of pass@k, each at most samples_per_prompt."""
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int | None = None
    """Generation budget; None uses rollout.max_new_tokens."""
    correct_threshold: float = 1.0
    """A completion counts as correct for pass@k when its reward is at least this."""

    def __post_init__(self) -> None:
        if self.interval < 0:
            raise ValueError(f"eval.interval must be >= 0, got {self.interval}")
        if self.samples_per_prompt < 1:
            raise ValueError(f"eval.samples_per_prompt must be >= 1, got {self.samples_per_prompt}")
        bad = [k for k in self.k if not 1 <= k <= self.samples_per_prompt]
        if not self.k or bad:
            raise ValueError(
                f"eval.k must list values in [1, eval.samples_per_prompt="
                f"{self.samples_per_prompt}], got {self.k}"
            )
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ValueError(
                f"eval.temperature must be >= 0 and eval.top_p in (0, 1], "
                f"got {self.temperature}, {self.top_p}"
            )
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError(f"eval.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        names = [d.name for d in self.datasets]
        if len(set(names)) != len(names):
            raise ValueError(f"eval.datasets names must be unique, got {names}")

    @property
    def enabled(self) -> bool:
        return bool(self.datasets)

    def due(self, step: int, *, last_step: int) -> bool:
        """Whether to evaluate after ``step`` (0: before training)."""
        if not self.enabled:
            return False
        if step == 0:
            return self.at_start
        return self.interval > 0 and (step % self.interval == 0 or step == last_step)
