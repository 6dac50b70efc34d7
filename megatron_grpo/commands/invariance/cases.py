"""What check-invariance trains: the layouts, the features switched on, the fixed global
batch and the ways it is laid out on the ranks."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Literal

import torch

from megatron_grpo.algo.batch import Sample
from megatron_grpo.commands.invariance.features import FEATURES
from megatron_grpo.config import LossConfig, ModelConfig, OptimConfig, ParallelDims, TrainConfig

GROUP_SIZES = (4, 3, 3, 2)
"""Uneven prompt groups: 12 sequences, 4 groups."""
SPARSE_GROUP_SIZES = (5, 4, 3, 2, 1, 1)
"""The sparse-groups batch: 16 sequences, 6 groups, scattered over the DP ranks."""
SPARSE_GROUPS_SEED = 26
"""Chosen so that the planner lays the batch out as ``sparse_groups_batch`` says."""
MAX_COMPLETION = 10
NUM_ITERATIONS = 2
"""Optimizer passes over the batch: the second runs on moved weights (ratios != 1)."""
REF_NOISE = 0.02
"""The reference model is the initial policy plus this much Gaussian noise (KL != 0)."""
SGD_LR = 0.1
ADAM_LR, ADAM_EPS = 1e3, 1e4
"""With the distributed optimizer every layout runs Adam whose eps dwarfs |g|: its update,
-lr m / (sqrt(v) + eps), stays proportional to the gradient (about -0.1 g on the first
step), so a scale error shows in the update as it would under SGD."""


@dataclass(frozen=True)
class Layout:
    """DP x TP x PP (x CP) ranks, and the expert-parallel size (taken from the DP x TP ranks)."""

    dp: int
    tp: int
    pp: int
    ep: int = 1
    cp: int = 1
    """Context-parallel size: each sequence split over ``cp`` ranks (Transformer Engine only)."""

    @classmethod
    def parse(cls, text: str) -> Layout:
        """``DPxTPxPP``, ``DPxTPxPPxEP`` or ``DPxTPxPPxEPxCP`` (missing fields are 1)."""
        try:
            sizes = [int(x) for x in text.lower().split("x")]
        except ValueError:
            sizes = []
        if len(sizes) not in (3, 4, 5):
            raise ValueError(
                f"layout {text!r} is not of the form DPxTPxPP, DPxTPxPPxEP or DPxTPxPPxEPxCP, "
                "e.g. 2x1x2x2 or 1x1x1x1x2"
            )
        if min(sizes) < 1:
            raise ValueError(f"layout {text!r}: sizes must be >= 1")
        return cls(*sizes)

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    def __str__(self) -> str:
        if self.cp > 1:
            return f"{self.dp}x{self.tp}x{self.pp}x{self.ep}x{self.cp}"
        ep = f"x{self.ep}" if self.ep > 1 else ""
        return f"{self.dp}x{self.tp}x{self.pp}{ep}"


def parse_features(text: str) -> tuple[str, ...]:
    names = tuple(x.strip() for x in text.split(",") if x.strip())
    unknown = [x for x in names if x not in FEATURES]
    if unknown:
        raise ValueError(
            f"unknown feature {unknown[0]!r} for --features; expected some of {', '.join(FEATURES)}"
        )
    return names


@dataclass(frozen=True)
class Setup:
    """The configs one launch trains with, and which of the features are active in it."""

    model: ModelConfig
    dims: ParallelDims
    optim: OptimConfig
    train: TrainConfig
    active: tuple[str, ...]

    @property
    def compares_grads(self) -> bool:
        """Raw gradients are whole on every rank (not with the distributed optimizer)."""
        return "distopt" not in self.active


def setup(
    layout: Layout, features: tuple[str, ...], model: ModelConfig, *, reference: bool
) -> Setup:
    """The configs for ``layout`` with ``features``; the single-process reference takes only
    what every layout must share (Adam for distopt, the 4-layer model for vpp)."""
    if "vpp" in features:
        model = dataclasses.replace(model, num_layers=max(model.num_layers, 4))
    optim = OptimConfig(optimizer="sgd", lr=SGD_LR, clip_grad=0.0, overlap_grad_reduce=False)
    if "distopt" in features:
        optim = OptimConfig(optimizer="adam", lr=ADAM_LR, adam_eps=ADAM_EPS, clip_grad=0.0)
    replay = [f for f in features if f in REPLAY_FEATURES]
    if replay and not model.is_moe:
        raise ValueError(f"--features {replay[0]} needs a mixture-of-experts model (--model moe)")
    if len(replay) > 1:
        raise ValueError("--features takes one of r2 and r3")
    # what is trained, not how it is laid out: the reference replays too
    wanted = tuple(replay) if reference else features
    applies = {
        "distopt": layout.dp * layout.cp > 1,
        "sp": layout.tp > 1,
        "vpp": layout.pp > 1 and layout.cp == 1,
        "recompute": True,
        "selective": True,
        "bf16": True,
        "r2": True,
        "r3": True,
    }
    active = tuple(f for f in wanted if applies[f])
    if "distopt" not in active:
        optim = dataclasses.replace(optim, use_distributed_optimizer=False)
    if "bf16" in active:
        model = dataclasses.replace(model, params_dtype="bfloat16")
    recompute: Literal["full", "selective"] | None = None
    if "recompute" in active:
        recompute = "full"
    if "selective" in active:
        recompute = "selective"
    return Setup(
        model=model,
        dims=ParallelDims(
            tp=layout.tp,
            pp=layout.pp,
            ep=layout.ep,
            cp=layout.cp,
            vpp=2 if "vpp" in active else None,
            # megatron-core's MoE layer trains at TP > 1 only under sequence parallelism
            sequence_parallel="sp" in active or (model.is_moe and layout.tp > 1),
        ),
        optim=optim,
        train=TrainConfig(
            recompute_granularity=recompute,
            routing_replay="r3" if "r3" in active else "r2" if "r2" in active else "off",
        ),
        active=active,
    )


REPLAY_FEATURES = ("r2", "r3")
"""The routing replay features: what the model trains on, so the reference has them too."""


def with_routes(samples: list[Sample], model: ModelConfig, seed: int = 7) -> list[Sample]:
    """The samples with an engine's routes (R3): a random top-k set of distinct experts for
    every token and layer, none (-1) on the last token (the engine never routes it), drawn
    per sample id so that every layout replays the same."""
    assert model.num_experts is not None
    out = []
    for s in samples:
        g = torch.Generator().manual_seed(seed * 100_003 + s.sample_id)
        draws = torch.rand(len(s), model.num_layers, model.num_experts, generator=g)
        routes = draws.topk(model.moe_router_topk, dim=-1).indices.to(torch.int16)
        routes[-1] = -1
        out.append(dataclasses.replace(s, routes=routes))
    return out


def default_model() -> ModelConfig:
    return ModelConfig(
        num_layers=2,
        hidden_size=64,
        ffn_hidden_size=96,
        num_attention_heads=4,
        num_query_groups=2,
        vocab_size=100,
        make_vocab_size_divisible_by=8,
        max_position_embeddings=64,
        hf_family="llama",
    )


def default_moe_model() -> ModelConfig:
    """A tiny Qwen3-MoE: 4 experts, top-2, narrower than the dense width, q/k norm, and the
    routers' balance loss on with a coefficient large enough to move the gradient."""
    return dataclasses.replace(
        default_model(),
        head_dim=32,
        qk_layernorm=True,
        hf_family="qwen3_moe",
        num_experts=4,
        moe_router_topk=2,
        moe_ffn_hidden_size=32,
        moe_aux_loss_coeff=0.05,
    )


def default_loss(mode: str) -> LossConfig:
    """Every term switched on, so that each one is checked under the mode's weights.

    Two of the modes use the sequence-level options (GSPO ratio, sequence-level
    masked importance sampling) and one takes its ratio against the rollout's log-probs
    (``old_logprobs=rollout``, no importance sampling then) so that those paths are
    checked too.
    """
    every_term = LossConfig(
        mode=mode,  # type: ignore[arg-type]  # checked by LossConfig
        eps_clip_low=0.2,
        eps_clip_high=0.28,
        dual_clip=3.0,
        kl_coef=0.1,
        kl_estimator="k3",
        entropy_coef=0.01,
    )
    if mode == "seq-mean-token-sum-norm":
        return dataclasses.replace(every_term, old_logprobs="rollout")
    sequence_level = mode in ("seq-mean-token-mean", "group-token-mean")
    return dataclasses.replace(
        every_term,
        ratio_level="sequence" if sequence_level else "token",
        tis_level="sequence" if sequence_level else "token",
        tis_mode="mask" if sequence_level else "truncate",
        tis_upper=4.0 if sequence_level else 1.5,
        tis_lower=0.25 if sequence_level else None,
    )


def fixed_batch(vocab_size: int, seed: int = 0) -> list[Sample]:
    """The global batch: uneven groups, varied lengths, masked spans, rollout log-probs.

    The rollout log-probs are what a random model of this vocabulary gives
    (-log V) plus noise, so importance weights spread around 1 and some truncate.
    """
    return _grouped_batch(GROUP_SIZES, vocab_size, seed, fully_masked=5, tool_span=2)


def sparse_groups_batch(vocab_size: int, seed: int = SPARSE_GROUPS_SEED) -> list[Sample]:
    """A global batch whose prompt groups the planner scatters as it does at scale, where
    a group's samples land on a few of many DP ranks: at DP2 and DP4 every rank lacks
    some groups and no two ranks hold the same ones, a group lies whole on one rank, others
    are split unevenly over ranks and (3 micro-batches a rank) over micro-batches, and the
    last group's only sample is fully masked (a group P does not count, on one rank).

    Group ids that were numbered per rank (each rank's groups 0, 1, ...) would then name
    different groups on different ranks in the DP all-reduce of the counts.
    ``tests/unit/test_plan.py`` holds the trainer's planner to this layout.
    """
    last = sum(SPARSE_GROUP_SIZES) - 1
    return _grouped_batch(SPARSE_GROUP_SIZES, vocab_size, seed, fully_masked=last, tool_span=1)


def _grouped_batch(
    group_sizes: tuple[int, ...],
    vocab_size: int,
    seed: int,
    *,
    fully_masked: int,
    tool_span: int,
) -> list[Sample]:
    """Groups of samples of one prompt each, in group order, random lengths; sample
    ``fully_masked`` has no loss token and ``tool_span`` (if 4 tokens long or more) a
    masked tool-output span inside its completion."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    sample_id = 0
    for group, size in enumerate(group_sizes):
        prompt = torch.randint(
            1, vocab_size, (int(torch.randint(3, 7, (1,), generator=g)),), generator=g
        )
        for _ in range(size):
            n = int(torch.randint(1, MAX_COMPLETION + 1, (1,), generator=g))
            completion = torch.randint(1, vocab_size, (n,), generator=g)
            mask = torch.cat([torch.zeros(len(prompt)), torch.ones(n)])
            if sample_id == fully_masked:  # e.g. truncated and filtered
                mask.zero_()
            if sample_id == tool_span and n >= 4:
                mask[len(prompt) + 1 : len(prompt) + 3] = 0
            reward = float(torch.randint(0, 2, (1,), generator=g))
            noise = 0.3 * torch.randn(n, generator=g)
            rollout = torch.cat([torch.zeros(len(prompt)), noise - math.log(vocab_size)])
            samples.append(
                Sample(
                    tokens=torch.cat([prompt, completion]),
                    loss_mask=mask,
                    advantage=reward - 0.5 + 0.1 * group,
                    group=group,
                    sample_id=sample_id,
                    rollout_logprobs=rollout,
                )
            )
            sample_id += 1
    return samples


def empty_rank_batch(vocab_size: int, seed: int = 3) -> list[Sample]:
    """A global batch that the planner lays out, at DP2, with one rank holding no loss token
    and the ranks holding different numbers of micro-batches.

    One fully masked 60-token sample outweighs the four others together (38 tokens), so
    the balancer gives it a rank of its own; under a 60-token budget the other rank splits
    its rows of 14 and 5 tokens into two micro-batches (less padding than one).
    """
    g = torch.Generator().manual_seed(seed)
    shapes = [(0, 6, 54, False), (0, 4, 10, True), (1, 5, 9, True), (1, 3, 2, True)]
    shapes.append((1, 3, 2, True))
    samples = []
    for i, (group, prompt_len, n, trained) in enumerate(shapes):
        tokens = torch.randint(1, vocab_size, (prompt_len + n,), generator=g)
        mask = torch.cat([torch.zeros(prompt_len), torch.full((n,), float(trained))])
        noise = 0.3 * torch.randn(n, generator=g)
        rollout = torch.cat([torch.zeros(prompt_len), noise - math.log(vocab_size)])
        samples.append(
            Sample(
                tokens=tokens,
                loss_mask=mask,
                advantage=0.7 if i % 2 else -0.4,
                group=group,
                sample_id=i,
                rollout_logprobs=rollout * mask,
            )
        )
    return samples


def permutation(num_samples: int, seed: int = 1) -> list[int]:
    return torch.randperm(num_samples, generator=torch.Generator().manual_seed(seed)).tolist()


GlobalBatch = Literal["fixed", "empty-rank", "sparse-groups"]
"""Which global batch a case trains: ``fixed_batch``, ``empty_rank_batch`` or
``sparse_groups_batch``."""
_BATCHES = {
    "fixed": fixed_batch,
    "empty-rank": empty_rank_batch,
    "sparse-groups": sparse_groups_batch,
}


@dataclass(frozen=True)
class Variant:
    """How a global batch is laid out: micro-batches per rank, order, packing."""

    num_micro_batches: int
    """Target micro-batches per rank: sets the token budget the planner splits under."""
    permuted: bool = False
    packed: bool = False
    global_batch: GlobalBatch = "fixed"
    """``empty-rank`` runs under the budget of its longest sample (one DP rank without loss
    tokens at DP2), whatever ``num_micro_batches``."""

    def __str__(self) -> str:
        if self.global_batch == "empty-rank":
            return "empty-rank"
        order = "perm" if self.permuted else "orig"
        layout = f"mb{self.num_micro_batches}/{order}" + ("/packed" if self.packed else "")
        return layout if self.global_batch == "fixed" else f"{self.global_batch}/{layout}"

    @staticmethod
    def global_batch_of(name: str) -> GlobalBatch:
        """The global batch of a variant, from its name (``str``)."""
        named: dict[str, GlobalBatch] = {
            "empty-rank": "empty-rank",
            "sparse-groups": "sparse-groups",
        }
        return named.get(name.split("/")[0], "fixed")

    def batch(self, vocab_size: int) -> list[Sample]:
        return _BATCHES[self.global_batch](vocab_size)

    def token_budget(self, lengths: list[int], dp_size: int) -> int:
        """The micro-batch token budget that gives about ``num_micro_batches`` per rank.

        Budgets count padded positions: unpacked rows are as wide as the longest.
        """
        if self.global_batch == "empty-rank":
            return max(lengths)
        positions = sum(lengths) if self.packed else max(lengths) * len(lengths)
        return max(max(lengths), math.ceil(positions / (dp_size * self.num_micro_batches)))


def variants(
    micro_batch_counts: list[int], permute: bool, pack: bool, *, empty_rank: bool = True
) -> list[Variant]:
    """Each micro-batch count in order; then permuted; then permuted and packed; then the
    batch with an empty rank (not under VPP: a rank of one sample cannot make PP
    micro-batches); then the batch with sparse groups, each micro-batch count in order."""
    out = [Variant(n) for n in micro_batch_counts]
    if permute:
        out += [Variant(n, permuted=True) for n in micro_batch_counts]
    if pack:
        out.append(Variant(micro_batch_counts[-1], permuted=permute, packed=True))
    if empty_rank:
        out.append(Variant(1, global_batch="empty-rank"))
    return out + [Variant(n, global_batch="sparse-groups") for n in micro_batch_counts]
