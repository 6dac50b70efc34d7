"""Evaluation during training: held-out prompts through the trainer's engines and scorer.

Runs on the main rank only, between RL steps, with the rollout runtime that
generates the training samples (so with the current policy's weights) and the
same ``RewardScorer``. Each set's prompts are read once, in file order (no
shuffle). The sampling seed is a function of the run's seed, the step and the
set, so a resumed run repeats an evaluation exactly.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from megatron_grpo.config import DataConfig, EvalConfig, EvalDatasetConfig
from megatron_grpo.eval.pass_at_k import mean_pass_at_k
from megatron_grpo.rollout.hook import response_text, reward_metadata
from megatron_grpo.rollout.parts import RolloutSettings


def dataset_config(data: DataConfig, spec: EvalDatasetConfig) -> DataConfig:
    """The ``DataConfig`` of a held-out set: the ``data`` section with the set's fields."""
    overrides: dict[str, Any] = {"path": spec.path, "shuffle": False, "require_label": True}
    for name in ("prompt_key", "label_key", "split", "system_prompt"):
        if getattr(spec, name) is not None:
            overrides[name] = getattr(spec, name)
    return dataclasses.replace(data, **overrides)


def group_metrics(
    rewards: list[list[float]], lengths: list[int], *, ks: list[int], threshold: float
) -> dict[str, float]:
    """pass@k, mean reward and mean length of one set's groups (one list per prompt)."""
    n = len(rewards[0])
    num_correct = [sum(r >= threshold for r in group) for group in rewards]
    flat = [r for group in rewards for r in group]
    out = {f"pass@{k}": mean_pass_at_k(num_correct, n, k) for k in ks}
    out["reward_mean"] = sum(flat) / len(flat)
    out["response_length_mean"] = sum(lengths) / len(lengths)
    return out


class Evaluator:
    """``run(step)``: the eval metrics (``<set>/<metric>``) of the current policy."""

    def __init__(
        self,
        cfg: EvalConfig,
        settings: RolloutSettings,
        *,
        runtime,
        scorer,
        tokenizer,
        stop_token_ids: list[int],
        hook=None,
    ):
        """``settings``: the run's rollout sections, which the held-out sets' sampling and
        data reading start from; ``hook``: the run's rollout hook (a ``HookRunner``), which
        then makes each completion as it makes the training samples (e.g. the tool loop)."""
        from megatron_grpo.data import PromptDataset

        self.cfg = cfg
        self.seed = settings.seed
        self.runtime, self.scorer, self.tokenizer = runtime, scorer, tokenizer
        self.stop_token_ids = stop_token_ids
        self.hook = hook
        rollout = settings.rollout
        self.sampling = dataclasses.replace(
            rollout,
            samples_per_prompt=cfg.samples_per_prompt,
            sampling=dataclasses.replace(
                rollout.sampling, temperature=cfg.temperature, top_p=cfg.top_p
            ),
            max_new_tokens=cfg.max_new_tokens or rollout.max_new_tokens,
        )
        self.sets = []
        for spec in self.cfg.datasets:
            items = PromptDataset(dataset_config(settings.data, spec), tokenizer).items
            self.sets.append((spec.name, items[: spec.max_prompts]))

    def run(self, step: int) -> dict[str, float]:
        start = time.perf_counter()
        out: dict[str, float] = {}
        for index, (name, items) in enumerate(self.sets):
            metrics = self._run_set(items, seed=self.seed + 7_000_003 * (step + 1) + 101 * index)
            out.update({f"{name}/{k}": v for k, v in metrics.items()})
        out["time_s"] = time.perf_counter() - start
        return out

    def _run_set(self, items: list, *, seed: int) -> dict[str, float]:
        if self.hook is None:
            groups = self.runtime.generate_groups(
                [it.prompt_ids for it in items],
                self.sampling,
                seed=seed,
                stop_token_ids=self.stop_token_ids,
            )
        else:
            groups = self.hook.generate_groups(
                items, self.runtime, self.sampling, seed=seed, stop_token_ids=self.stop_token_ids
            )
        n = self.cfg.samples_per_prompt
        texts = [response_text(s, self.tokenizer) for group in groups for s in group]
        labels = [it.label for it in items for _ in range(n)]
        metas = [reward_metadata(s, it.metadata) for it, group in zip(items, groups) for s in group]
        prompts = [it.prompt_text for it in items for _ in range(n)]
        ids = [list(s.output_ids) for group in groups for s in group]
        scored = self.scorer.score(texts, labels, metas, prompts=prompts, completion_ids=ids)
        rewards = [scored.rewards[i * n : (i + 1) * n] for i in range(len(items))]
        lengths = [len(s.output_ids) for group in groups for s in group]
        metrics = group_metrics(
            rewards, lengths, ks=self.cfg.k, threshold=self.cfg.correct_threshold
        )
        metrics["reward_errors"] = float(scored.num_errors)
        return metrics


def build(cfg: EvalConfig, settings: RolloutSettings, rollout, ctx) -> Evaluator | None:
    """The evaluator of a run, on the main rank when ``eval.datasets`` is set; else None.

    ``rollout`` is the loop's rollout side: its runtime and its parts (scorer, tokenizer,
    stop tokens, rollout hook), which exist on the main rank only."""
    if not cfg.enabled or rollout is None or not ctx.is_main:
        return None
    return Evaluator(
        cfg,
        settings,
        runtime=rollout.runtime,
        scorer=rollout.parts.scorer,
        tokenizer=rollout.parts.tokenizer,
        stop_token_ids=rollout.parts.stop,
        hook=rollout.parts.hook,
    )


def maybe_run(
    evaluator: Evaluator | None, cfg: EvalConfig, step: int, total_steps: int
) -> dict[str, float]:
    """The eval metrics of ``step`` when an evaluation is due there (main rank); else {}."""
    if evaluator is None or not cfg.due(step, last_step=total_steps):
        return {}
    return evaluator.run(step)
