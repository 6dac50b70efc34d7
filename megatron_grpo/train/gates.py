"""On-policy gates: the run stops when the engines did not generate with the learner's policy.

The learner's log-probs of the sampled tokens, at the weights it last pushed, must be the
engine's (``train.gates``). The figures come from the RL step's first optimizer step (its
loss metrics, ``train.step.reduce_metrics``), checked before the optimizer consumes the
gradients, so a stop trains nothing and every checkpoint and metrics row already written
stays. At the first on-policy step of a launch (step 1 of a fresh run, the first step
after a resume: the engines have just been given the learner's weights) three figures
are held to tight thresholds; at every later step the mean is held to a generous one,
which ends a run whose mismatch runs away. ``failure`` is the decision, a pure function.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from megatron_grpo.config import GatesConfig

LIKELY_CAUSES = (
    "the engines' weights are not the learner's (not pushed, or pushed wrong: "
    "rollout.sync.check names a weight an engine loads wrongly), the tokens trained are "
    "not the tokens sampled (a tokenizer or chat template that differs, e.g. a rollout "
    "hook that re-tokenizes text), MoE routing without replay (train.routing_replay=r3), "
    "a dtype mismatch "
    "(model.params_dtype against the engine's dtype)"
)


class OffPolicyError(RuntimeError):
    """The learner's log-probs are not the engine's beyond a ``train.gates`` threshold."""


@dataclass(frozen=True)
class Figure:
    metric: str
    """The ``train/`` metric the gate reads."""
    option: str
    """Its threshold's option under ``train.gates``."""
    what: str
    """What the figure is, for the message."""
    absolute: bool = False
    """Compare its absolute value (a signed figure)."""


FIRST_STEP = (
    Figure("logprob_mismatch", "first_step_mismatch", "mean |learner - engine| log-prob"),
    Figure("logprob_mismatch_max", "first_step_mismatch_max", "max |learner - engine| log-prob"),
    Figure(
        "rollout_kl",
        "first_step_rollout_kl",
        "mean engine - learner log-prob, KL(engine || learner)",
        absolute=True,
    ),
)
"""What the first on-policy step checks, in this order (the first above its threshold is
reported)."""
LATER_STEPS = (Figure("logprob_mismatch", "stop_mismatch", "mean |learner - engine| log-prob"),)
"""What every later step checks."""


def failure(
    metrics: dict[str, float | None], cfg: GatesConfig, *, step: int, first: bool, resumed: bool
) -> str | None:
    """The line that stops the run at RL step ``step``, or None when its figures pass.

    ``first``: the launch's first on-policy step (``resumed``: after a resume). A figure that
    was not measured (None: no loss token with the engine's log-probs) or a threshold of 0
    (off) passes.
    """
    for figure in FIRST_STEP if first else LATER_STEPS:
        value = metrics.get(figure.metric)
        limit = getattr(cfg, figure.option)
        if value is None or not limit or (abs(value) if figure.absolute else value) <= limit:
            continue
        if first:
            when = "the first after a resume" if resumed else "the first of a new run"
            why = (
                "the engines were just given the learner's weights, yet sample from another policy"
            )
        else:
            when, why = "a later step", "the mismatch ran away"
        others = "; ".join(
            f"{name} {v:.3g}"
            for name in ("logprob_mismatch", "logprob_mismatch_max", "rollout_kl")
            if name != figure.metric and (v := metrics.get(name)) is not None
        )
        return (
            f"on-policy gate: step {step} ({when}): train/{figure.metric} = {value:.3g} "
            f"({figure.what}; {others}) is above train.gates.{figure.option}={limit:g}: {why}. "
            f"Likely causes: {LIKELY_CAUSES}. Stopped before the optimizer step: this step "
            f"trained nothing, checkpoints and metrics so far are kept; "
            f"train.gates.{figure.option}=0 turns this gate off"
        )
    return None


def for_step(
    cfg: GatesConfig, *, step: int, first: bool, resumed: bool
) -> Callable[[dict[str, float | None]], None]:
    """The gate of RL step ``step`` (``train.step.optimizer_step``'s ``gate``): raises
    ``OffPolicyError`` with ``failure``'s line, on every rank alike (the metrics are)."""

    def gate(metrics: dict[str, float | None]) -> None:
        line = failure(metrics, cfg, step=step, first=first, resumed=resumed)
        if line is not None:
            raise OffPolicyError(line)

    return gate
