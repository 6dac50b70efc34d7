"""One step's rollout on the main rank: prompts -> generations -> rewards -> advantages.

Dynamic sampling keeps only groups with reward spread and asks for more
prompts until ``prompts_per_step`` groups are kept, at most
``max_sampling_rounds`` rounds; if the cap is hit, the batch is completed
with flat groups (advantage 0: they add KL/entropy terms only) and the
shortfall is reported. ``dump_dir`` writes each step's training samples as
jsonl; ``replay_dir`` reads them back instead of generating.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megatron_grpo.algo.advantages import fill_batch, group_advantages, has_spread
from megatron_grpo.algo.batch import Sample, SampleColumns, make_samples
from megatron_grpo.config import AdvantageConfig, RolloutConfig
from megatron_grpo.rewards import ScoreResult
from megatron_grpo.rollout import hook as rollout_hook
from megatron_grpo.rollout.scoring import GroupScoring


@dataclass
class RolloutBatch:
    samples: list[Sample]
    stats: dict[str, float]

    def __reduce__(self):
        """Pickled with its samples as columns: a few torch calls for the whole batch (it
        crosses processes: the rollout producer's pipe, ``broadcast_object`` to the other
        ranks)."""
        try:
            return _batch_from_columns, (SampleColumns.of(self.samples), self.stats)
        except ValueError:  # samples with and without rollout log-probs
            return RolloutBatch, (self.samples, self.stats)


def _batch_from_columns(columns: SampleColumns, stats: dict[str, float]) -> RolloutBatch:
    return RolloutBatch(columns.samples(), stats)


def stop_token_ids(tokenizer, extra: list[int]) -> list[int]:
    """The configured stop tokens plus the tokenizer's end of sequence."""
    eos = tokenizer.eos_token_id
    return list(extra) + ([eos] if isinstance(eos, int) and eos not in extra else [])


def _to_samples(
    generations: list[list[Any]],
    rewards: torch.Tensor,
    advantages: torch.Tensor,
    mask_truncated: bool,
) -> list[Sample]:
    advantage_GN = advantages.tolist()  # one call, not two tensor ops a sample
    gens = [gen for group in generations for gen in group]
    tokens, masks = [], []
    for gen in gens:
        prompt, output = list(gen.prompt_ids), list(gen.output_ids)
        mask = [0.0] * len(prompt) + [1.0] * len(output)
        if isinstance(gen, rollout_hook.Episode):  # tool output and the like: mask 0
            mask = [0.0] * len(prompt) + list(gen.loss_mask)
        if mask_truncated and gen.finish_reason.type == "length":
            mask = [0.0] * len(mask)
        tokens.append(prompt + output)
        masks.append(mask)
    return make_samples(
        tokens,
        masks,
        advantages=[a for row in advantage_GN for a in row],
        groups=[g for g, group in enumerate(generations) for _ in group],
        rollout_logprobs=[[0.0] * len(gen.prompt_ids) + list(gen.rollout_logprobs) for gen in gens],
        routes=sample_routes(gens, [len(t) for t in tokens]),
    )


def sample_routes(gens: list[Any], lengths: list[int]) -> list[torch.Tensor] | None:
    """Each sample's routes [S, L, K] int16 from its engine's ``routed_experts`` (the
    positions it routed: all but the last token, or fewer), -1 on the positions after them;
    None when no sample has them. A sample without them next to others with them gets -1
    everywhere (its routers then choose for it)."""
    arrays = [getattr(gen, "routed_experts", None) for gen in gens]
    shapes = {a.shape[1:] for a in arrays if a is not None}
    if not shapes:
        return None
    if len(shapes) > 1:
        raise ValueError(f"the engines routed over different (layers, top-k): {sorted(shapes)}")
    shape = shapes.pop()
    out = []
    for array, length in zip(arrays, lengths):
        routes = torch.full((length, *shape), -1, dtype=torch.int16)
        if array is not None:
            if len(array) > length:
                raise ValueError(f"routes for {len(array)} positions of a {length}-token sample")
            routes[: len(array)] = torch.from_numpy(array.astype("int16", copy=False))
        out.append(routes)
    return out


def response_stats(rewards: list[float], lengths: list[int], truncated: int) -> dict[str, float]:
    """Reward and length of every response sampled this step (dropped groups too)."""
    r = torch.tensor(rewards)
    return {
        "reward_mean": float(r.mean()),
        "reward_std": float(r.std()) if len(r) > 1 else 0.0,
        "response_length_mean": sum(lengths) / len(lengths),
        "response_length_max": float(max(lengths)),
        "truncated_fraction": truncated / len(lengths),
    }


def length_by_advantage(generations: list[list[Any]], advantages: torch.Tensor) -> dict[str, float]:
    """Mean response length of the trained samples better and worse than their group.

    The loss modes differ in how they weigh long responses with a negative advantage (the
    length bias of seq-mean-token-mean), so their lengths are worth a curve of their own.
    A side with no sample (all groups flat) is left out.
    """
    out: dict[str, float] = {}
    advantage_GN = advantages.tolist()
    for name, sign in (("pos", 1), ("neg", -1)):
        picked = [
            len(gen.output_ids)
            for g, group in enumerate(generations)
            for k, gen in enumerate(group)
            if advantage_GN[g][k] * sign > 0
        ]
        if picked:
            out[f"response_length_{name}_adv_mean"] = sum(picked) / len(picked)
    return out


def staleness_stats(generations: list[list[Any]], step: int) -> dict[str, float]:
    """How many weight versions each trained sample's oldest token is behind the policy that
    trains on it (version step - 1), and the fraction a weight update split into spans."""
    ages, split = [], 0
    for group in generations:
        for gen in group:
            versions = [v for v, _ in gen.version_spans] or [gen.weight_version]
            try:
                oldest = min(int(v) for v in versions)
            except (TypeError, ValueError):
                raise RuntimeError(
                    f"step {step}: a sample's weight versions {versions} are not step numbers "
                    "(an engine that never got the learner's weights?)"
                ) from None
            ages.append(step - 1 - oldest)
            split += len(gen.version_spans) > 1
    return {
        "staleness_mean": sum(ages) / len(ages),
        "staleness_max": float(max(ages)),
        "partial_fraction": split / len(ages),
    }


def _generate_and_score(
    items: list[Any],
    runtime,
    scorer,
    tokenizer,
    cfg: RolloutConfig,
    *,
    seed: int,
    stop_token_ids: list[int],
    hook: rollout_hook.HookRunner | None,
) -> tuple[list[list[Any]], ScoreResult]:
    """The groups of ``items``' prompts (with ``hook``, its episodes) and their rewards: each
    group scored as soon as it is generated when the reward runs outside this thread (and
    no hook runs), else all after generation."""
    prompts = [it.prompt_ids for it in items]
    if hook is None and scorer.runs_elsewhere:
        labels, metas = [it.label for it in items], [it.metadata for it in items]
        texts_of_prompts = [it.prompt_text for it in items]
        with GroupScoring(scorer, tokenizer, labels, metas, texts_of_prompts) as scoring:
            groups = runtime.generate_groups(
                prompts, cfg, seed=seed, stop_token_ids=stop_token_ids, on_group=scoring.submit
            )
            return groups, scoring.result(cfg.samples_per_prompt)
    if hook is None:
        groups = runtime.generate_groups(prompts, cfg, seed=seed, stop_token_ids=stop_token_ids)
    else:
        groups = hook.generate_groups(items, runtime, cfg, seed=seed, stop_token_ids=stop_token_ids)
    texts = [rollout_hook.response_text(s, tokenizer) for grp in groups for s in grp]
    labels = [it.label for it in items for _ in range(cfg.samples_per_prompt)]
    metas = [
        rollout_hook.reward_metadata(s, it.metadata) for it, grp in zip(items, groups) for s in grp
    ]
    texts_of_prompts = [it.prompt_text for it in items for _ in range(cfg.samples_per_prompt)]
    ids = [list(s.output_ids) for grp in groups for s in grp]
    return groups, scorer.score(texts, labels, metas, prompts=texts_of_prompts, completion_ids=ids)


def _complete(kept_gens, kept_rewards, flat_gens, flat_rewards, size: int) -> int:
    """Where the round cap was hit short of ``size`` groups, complete the batch with flat
    ones; how many were added."""
    shortfall = max(size - len(kept_gens), 0)
    kept_gens += flat_gens[:shortfall]
    kept_rewards += flat_rewards[:shortfall]
    return min(shortfall, len(flat_gens))


def collect(
    step: int,
    *,
    sampler,
    runtime,
    scorer,
    tokenizer,
    cfg: RolloutConfig,
    adv_cfg: AdvantageConfig,
    seed: int,
    stop_token_ids: list[int],
    hook: rollout_hook.HookRunner | None = None,
) -> RolloutBatch:
    """Generate (with ``hook``, one episode per sample), score and turn into training
    samples (main rank only)."""
    start = time.perf_counter()
    kept_gens: list[list[Any]] = []
    kept_rewards: list[torch.Tensor] = []
    flat_gens: list[list[Any]] = []
    flat_rewards: list[torch.Tensor] = []
    reward_errors = dropped = rounds = 0
    all_rewards: list[float] = []
    lengths: list[int] = []
    truncated = 0
    episode_metrics: list[dict[str, float]] = []
    while len(kept_gens) < cfg.prompts_per_step and rounds < adv_cfg.max_sampling_rounds:
        need = cfg.prompts_per_step - len(kept_gens)
        items = sampler.next_batch(need if adv_cfg.dynamic_sampling else cfg.prompts_per_step)
        round_seed = seed + 1_000_003 * step + 10_007 * rounds
        groups, scored = _generate_and_score(
            items,
            runtime,
            scorer,
            tokenizer,
            cfg,
            seed=round_seed,
            stop_token_ids=stop_token_ids,
            hook=hook,
        )
        if hook is not None:
            episode_metrics += [s.metrics for grp in groups for s in grp]
        reward_errors += scored.num_errors
        rewards = torch.tensor(scored.rewards, dtype=torch.float64).view(len(items), -1)
        all_rewards += scored.rewards
        lengths += [len(s.output_ids) for grp in groups for s in grp]
        truncated += sum(s.finish_reason.type == "length" for grp in groups for s in grp)
        rounds += 1
        if not adv_cfg.dynamic_sampling:
            kept_gens, kept_rewards = groups, list(rewards)
            break
        spread = has_spread(rewards).tolist()
        filled = fill_batch(spread, need)
        dropped += filled.num_dropped
        kept_gens += [groups[i] for i in filled.kept]
        kept_rewards += [rewards[i] for i in filled.kept]
        flat_gens += [groups[i] for i, ok in enumerate(spread) if not ok]
        flat_rewards += [rewards[i] for i, ok in enumerate(spread) if not ok]
    flat_kept = _complete(kept_gens, kept_rewards, flat_gens, flat_rewards, cfg.prompts_per_step)
    if len(kept_gens) < cfg.prompts_per_step:
        raise RuntimeError(
            f"step {step}: only {len(kept_gens)} of {cfg.prompts_per_step} prompt groups after "
            f"{rounds} sampling rounds"
        )
    rewards_GN = torch.stack(kept_rewards)
    advantages = group_advantages(rewards_GN, adv_cfg)
    samples = _to_samples(kept_gens, rewards_GN, advantages, cfg.mask_truncated)
    elapsed = time.perf_counter() - start
    stats = {
        **response_stats(all_rewards, lengths, truncated),
        **length_by_advantage(kept_gens, advantages),
        "reward_errors": float(reward_errors),
        "groups_dropped": float(dropped),
        "groups_flat_kept": float(flat_kept),
        "sampling_rounds": float(rounds),
        "generated_tokens_per_s": sum(lengths) / max(elapsed, 1e-9),
        **(rollout_hook.episode_stats(episode_metrics) if episode_metrics else {}),
    }
    if cfg.max_staleness:
        stats |= staleness_stats(kept_gens, step)
    return RolloutBatch(samples, stats)


# --------------------------------------------------------------------------- dump / replay


def dump(batch: RolloutBatch, dump_dir: str | Path, step: int) -> Path:
    path = Path(dump_dir) / f"step_{step:08d}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        f.write(json.dumps({"stats": batch.stats}) + "\n")
        for s in batch.samples:
            f.write(
                json.dumps(
                    {
                        "tokens": s.tokens.tolist(),
                        "loss_mask": s.loss_mask.tolist(),
                        "advantage": s.advantage,
                        "group": s.group,
                        "sample_id": s.sample_id,
                        "rollout_logprobs": None
                        if s.rollout_logprobs is None
                        else s.rollout_logprobs.tolist(),
                        "routes": None if s.routes is None else s.routes.tolist(),
                    }
                )
                + "\n"
            )
    return path


def replay(replay_dir: str | Path, step: int) -> RolloutBatch:
    path = Path(replay_dir) / f"step_{step:08d}.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"rollout.replay_dir has no dump for step {step}: {path}")
    lines = path.read_text().splitlines()
    stats = json.loads(lines[0])["stats"]
    samples = []
    for line in lines[1:]:
        row = json.loads(line)
        samples.append(
            Sample(
                tokens=torch.tensor(row["tokens"], dtype=torch.long),
                loss_mask=torch.tensor(row["loss_mask"]),
                advantage=row["advantage"],
                group=row["group"],
                sample_id=row["sample_id"],
                rollout_logprobs=None
                if row["rollout_logprobs"] is None
                else torch.tensor(row["rollout_logprobs"]),
                routes=None
                if row.get("routes") is None
                else torch.tensor(row["routes"], dtype=torch.int16),
            )
        )
    return RolloutBatch(samples, stats)
