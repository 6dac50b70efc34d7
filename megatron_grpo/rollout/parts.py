"""What a step's rollout is made with besides the engines: the tokenizer, the prompt sampler,
the reward scorer, the stop tokens and the rollout hook; and the step's rollout made with them.

The main rank builds them (``train/loop.py``), and so does the rollout producer's process
(``rollout/producer.py``), which makes the steps' rollouts there when ``max_staleness`` >= 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron_grpo.config import AdvantageConfig, Config, DataConfig, RewardConfig, RolloutConfig
from megatron_grpo.rollout import stage as rollout_stage


@dataclass(frozen=True)
class RolloutSettings:
    """The config sections a rollout is made with, and the run's seed: what the rollout
    parts, the producer's process and evaluation are handed (not the learner's sections,
    nor the output paths)."""

    rollout: RolloutConfig
    data: DataConfig
    reward: RewardConfig
    advantages: AdvantageConfig
    seed: int
    routed_layers: int | None = None
    """The policy's layer count, when the engines return routed experts (their routes'
    second dimension)."""

    @classmethod
    def of(cls, cfg: Config) -> RolloutSettings:
        layers = cfg.model.num_layers if cfg.rollout.return_routed_experts else None
        return cls(cfg.rollout, cfg.data, cfg.reward, cfg.advantages, cfg.seed, layers)


@dataclass
class RolloutParts:
    settings: RolloutSettings
    tokenizer: Any
    sampler: Any
    scorer: Any
    stop: list[int]
    hook: Any

    @classmethod
    def build(
        cls, cfg: RolloutSettings, tokenizer_path: str, sampler_state: dict | None
    ) -> RolloutParts:
        """The parts of ``cfg``; the sampler goes on from ``sampler_state`` when given."""
        from transformers import AutoTokenizer

        from megatron_grpo.data import PromptDataset, PromptSampler
        from megatron_grpo.rewards import RewardScorer
        from megatron_grpo.rollout.hook import load_hook

        tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
        sampler = PromptSampler.from_config(PromptDataset(cfg.data, tokenizer))
        if sampler_state is not None:
            sampler.load_state_dict(sampler_state)
        return cls(
            settings=cfg,
            tokenizer=tokenizer,
            sampler=sampler,
            scorer=RewardScorer(cfg.reward, label_key=cfg.data.label_key),
            stop=rollout_stage.stop_token_ids(tokenizer, cfg.rollout.sampling.stop_token_ids),
            hook=load_hook(cfg.rollout, tokenizer),
        )

    def collect(self, step: int, runtime: Any) -> rollout_stage.RolloutBatch:
        """Step ``step``'s rollout with the engines of ``runtime`` (dumped when asked)."""
        batch = rollout_stage.collect(
            step,
            sampler=self.sampler,
            runtime=runtime,
            scorer=self.scorer,
            tokenizer=self.tokenizer,
            cfg=self.settings.rollout,
            adv_cfg=self.settings.advantages,
            seed=self.settings.seed,
            stop_token_ids=self.stop,
            hook=self.hook,
        )
        if self.settings.rollout.dump_dir:
            rollout_stage.dump(batch, self.settings.rollout.dump_dir, step)
        return batch

    def close(self) -> None:
        self.scorer.close()  # its worker processes, if any
