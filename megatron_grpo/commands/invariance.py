"""``check-invariance``: the gradient of one global batch must not depend on the layout.

One fixed global batch (varied lengths, a fully masked sequence, a masked
tool-output span, uneven prompt groups, rollout log-probs off the policy's) is
trained at each layout (DP x TP x PP, run as real multi-process gloo or nccl) by
the trainer's own step function, ``train.step.train_on_rollout``: its planner
splits the batch over DP ranks and into micro-batches under a token budget, the
behaviour and reference log-probs are frozen, the loss weights come from one DP
all-reduce, and two optimizer passes run over the batch (mu = 2, so the second
pass is off-policy: ratios differ from 1 and clip). Each layout runs with token
budgets that give 1 and several micro-batches per rank, in the given order and
under a permutation of the samples, and packed. For each pass, the full
gradient, the parameter update of a plain SGD step (Adam's first step is nearly
sign(g) and would hide a scale error; differences within one fp32 ulp of the
parameter are storage rounding and not counted) and the global gradient norm are
compared with the single-process run: max |delta| / max |g| must stay under the
tolerance.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass
from typing import Any

import torch

from megatron_grpo.algo.batch import Sample
from megatron_grpo.config import LossConfig, ModelConfig, OptimConfig
from megatron_grpo.launch import run_workers

GROUP_SIZES = (4, 3, 3, 2)
"""Uneven prompt groups: 12 sequences, 4 groups."""
MAX_COMPLETION = 10
NUM_ITERATIONS = 2
"""Optimizer passes over the batch: the second runs on moved weights (ratios != 1)."""
REF_NOISE = 0.02
"""The reference model is the initial policy plus this much Gaussian noise (KL != 0)."""


@dataclass(frozen=True)
class Layout:
    dp: int
    tp: int
    pp: int

    @classmethod
    def parse(cls, text: str) -> Layout:
        try:
            dp, tp, pp = (int(x) for x in text.lower().split("x"))
        except ValueError:
            raise ValueError(f"layout {text!r} is not of the form DPxTPxPP, e.g. 2x1x2") from None
        if min(dp, tp, pp) < 1:
            raise ValueError(f"layout {text!r}: sizes must be >= 1")
        return cls(dp, tp, pp)

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    def __str__(self) -> str:
        return f"{self.dp}x{self.tp}x{self.pp}"


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
    )


def default_loss(mode: str) -> LossConfig:
    """Every term switched on, so that each one is checked under the mode's weights.

    Two of the modes use the sequence-level options (GSPO ratio, sequence-level
    masked importance sampling) so that those paths are checked too.
    """
    sequence_level = mode in ("seq-mean-token-mean", "group-token-mean")
    return LossConfig(
        mode=mode,  # type: ignore[arg-type]  # checked by LossConfig
        eps_clip_low=0.2,
        eps_clip_high=0.28,
        dual_clip=3.0,
        ratio_level="sequence" if sequence_level else "token",
        kl_coef=0.1,
        kl_estimator="k3",
        entropy_coef=0.01,
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
    g = torch.Generator().manual_seed(seed)
    samples = []
    sample_id = 0
    for group, size in enumerate(GROUP_SIZES):
        prompt = torch.randint(
            1, vocab_size, (int(torch.randint(3, 7, (1,), generator=g)),), generator=g
        )
        for _ in range(size):
            n = int(torch.randint(1, MAX_COMPLETION + 1, (1,), generator=g))
            completion = torch.randint(1, vocab_size, (n,), generator=g)
            mask = torch.cat([torch.zeros(len(prompt)), torch.ones(n)])
            if sample_id == 5:  # fully masked (e.g. truncated and filtered)
                mask.zero_()
            if sample_id == 2 and n >= 4:  # a tool-output span inside the completion
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


def permutation(num_samples: int, seed: int = 1) -> list[int]:
    return torch.randperm(num_samples, generator=torch.Generator().manual_seed(seed)).tolist()


@dataclass(frozen=True)
class Variant:
    """How the global batch is laid out: micro-batches per rank, order, packing."""

    num_micro_batches: int
    """Target micro-batches per rank: sets the token budget the planner splits under."""
    permuted: bool = False
    packed: bool = False

    def __str__(self) -> str:
        order = "perm" if self.permuted else "orig"
        return f"mb{self.num_micro_batches}/{order}" + ("/packed" if self.packed else "")

    def token_budget(self, lengths: list[int], dp_size: int) -> int:
        """The micro-batch token budget that gives about ``num_micro_batches`` per rank.

        Budgets count padded positions: unpacked rows are as wide as the longest.
        """
        positions = sum(lengths) if self.packed else max(lengths) * len(lengths)
        return max(max(lengths), math.ceil(positions / (dp_size * self.num_micro_batches)))


def variants(micro_batch_counts: list[int], permute: bool, pack: bool) -> list[Variant]:
    """Each micro-batch count in order; then permuted; then permuted and packed."""
    out = [Variant(n) for n in micro_batch_counts]
    if permute:
        out += [Variant(n, permuted=True) for n in micro_batch_counts]
    if pack:
        out.append(Variant(micro_batch_counts[-1], permuted=permute, packed=True))
    return out


def _reference_state(init_state: dict[str, torch.Tensor], seed: int = 2):
    g = torch.Generator().manual_seed(seed)
    return {k: v + REF_NOISE * torch.randn(v.shape, generator=g) for k, v in init_state.items()}


def _capture(model: list, ctx, vocab_size: int, into: list) -> None:
    """Gradients and parameters before an optimizer step, full, on rank 0. Collective."""
    from megatron_grpo.mcore.full_state import gather_full_state

    grads = gather_full_state(model, ctx, vocab_size=vocab_size, grads=True)
    params = gather_full_state(model, ctx, vocab_size=vocab_size)
    into.append({"grad": grads, "params": params} if ctx.is_main else None)


def run_layout(
    *,
    tp: int,
    pp: int,
    model_cfg: ModelConfig,
    modes: list[str],
    micro_batch_counts: list[int],
    permute: bool,
    pack: bool = True,
    init_state: dict[str, torch.Tensor] | None,
    ref_state: dict[str, torch.Tensor] | None = None,
    lr: float = 0.1,
) -> dict[str, Any] | None:
    """Worker body: every case at one layout, through the trainer's step; results on rank 0."""
    from megatron_grpo.config import ParallelDims
    from megatron_grpo.mcore.full_state import gather_full_state, load_full_state
    from megatron_grpo.mcore.model import build_model
    from megatron_grpo.mcore.optim import build_optimizer
    from megatron_grpo.mcore.parallel import broadcast_object, init_parallel
    from megatron_grpo.train.plan import plan
    from megatron_grpo.train.step import StepSettings, train_on_rollout

    ctx = init_parallel(ParallelDims(tp=tp, pp=pp))
    model = build_model(model_cfg, ctx)
    optimizer, scheduler = build_optimizer(
        OptimConfig(optimizer="sgd", lr=lr, clip_grad=0.0), model_cfg, model, ctx
    )
    vocab = model_cfg.vocab_size
    if init_state is None:
        init_state = broadcast_object(gather_full_state(model, ctx, vocab_size=vocab), ctx)
        ref_state = _reference_state(init_state)
    assert ref_state is not None
    ref_model = build_model(model_cfg, ctx, wrap_ddp=False)
    load_full_state(ref_model, ref_state, model_cfg, ctx)
    samples = fixed_batch(vocab)
    results: dict[str, Any] = {"init_state": init_state, "ref_state": ref_state, "cases": {}}
    for mode, variant in itertools.product(modes, variants(micro_batch_counts, permute, pack)):
        load_full_state(model, init_state, model_cfg, ctx)
        order = permutation(len(samples)) if variant.permuted else range(len(samples))
        batch = [samples[i] for i in order]
        lengths = [len(s) for s in batch]
        settings = StepSettings(
            global_batch_size=len(batch),
            num_iterations=NUM_ITERATIONS,
            max_tokens_per_micro_batch=variant.token_budget(lengths, ctx.dp_size),
            pack=variant.packed,
            vocab_size=vocab,
            max_len=MAX_COMPLETION,
        )
        before: list[dict[str, Any] | None] = []
        history = train_on_rollout(
            model,
            optimizer,
            scheduler,
            ctx,
            batch,
            default_loss(mode),
            settings,
            ref_model=ref_model,
            on_gradients=functools.partial(_capture, model, ctx, vocab, before),
        )
        final = gather_full_state(model, ctx, vocab_size=vocab)
        if ctx.is_main:
            budget = settings.max_tokens_per_micro_batch
            split = plan(lengths, dp_size=ctx.dp_size, max_tokens=budget, packed=variant.packed)
            after = [b["params"] for b in before[1:]] + [final]  # type: ignore[index]
            for k, (b, params, metrics) in enumerate(zip(before, after, history), start=1):
                assert b is not None and params is not None
                results["cases"][f"{mode}/{variant}/pass{k}"] = {
                    "grad": b["grad"],
                    "update": {name: params[name] - b["params"][name] for name in params},
                    "params": params,
                    "grad_norm": metrics["grad_norm"],
                    "clip_fraction": metrics["clip_fraction"],
                    "kl": metrics["kl"],
                    "micro_batches": [len(rank) for rank in split.ranks],
                }
    return results if ctx.is_main else None


def max_relative_error(
    got: dict[str, torch.Tensor],
    ref: dict[str, torch.Tensor],
    rounding: dict[str, torch.Tensor] | None = None,
) -> float:
    """max over tensors of |got - ref|, divided by max over tensors of |ref|.

    ``rounding`` (per element, same names) is subtracted from |got - ref| first:
    the part of a difference that storage rounding alone explains.
    """
    if set(got) != set(ref):
        raise AssertionError(f"tensor names differ: {sorted(set(got) ^ set(ref))}")
    scale = max(float(t.abs().max()) for t in ref.values())

    def excess(k: str) -> float:
        delta = (got[k] - ref[k]).abs()
        if rounding is not None:
            delta = (delta - rounding[k]).clamp(min=0)
        return float(delta.max())

    delta = max(excess(k) for k in ref)
    return delta / scale if scale > 0 else delta


def parameter_ulp(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One unit in the last place of each parameter: two runs whose updates agree exactly
    can still store p - lr * g rounded half an ulp apart each way."""
    return {k: torch.finfo(v.dtype).eps * v.abs() for k, v in params.items()}


def compare(case: dict[str, Any], ref: dict[str, Any]) -> dict[str, float]:
    return {
        "grad": max_relative_error(case["grad"], ref["grad"]),
        "update": max_relative_error(case["update"], ref["update"], parameter_ulp(ref["params"])),
        "grad_norm": abs(case["grad_norm"] - ref["grad_norm"]) / max(ref["grad_norm"], 1e-30),
    }


def _baseline_name(name: str, first: Variant) -> str:
    """The reference case of a case: the same mode and pass, first variant, 1x1x1."""
    mode, *_, step = name.split("/")
    return f"{mode}/{first}/{step}"


def check(
    layouts: list[Layout],
    *,
    modes: list[str],
    micro_batch_counts: list[int],
    permute: bool = True,
    pack: bool = True,
    model_cfg: ModelConfig | None = None,
    timeout: float = 600.0,
    log=print,
    worker: str | None = None,
    worker_kwargs: dict[str, Any] | None = None,
) -> dict[str, dict[str, dict[str, float]]]:
    """errors[layout][case] = {grad, update, grad_norm}, each case against 1x1x1.

    The reference of every case is the single-process run of the same mode
    and pass with the first micro-batch count, in the original order. ``worker``
    ("module:function" taking run_layout's arguments and ``worker_kwargs``)
    replaces the worker body, e.g. to plant a bug and see the check catch it.
    """
    model_cfg = model_cfg or default_model()
    common = dict(
        model_cfg=model_cfg,
        modes=modes,
        micro_batch_counts=micro_batch_counts,
        permute=permute,
        pack=pack,
        **(worker_kwargs or {}),
    )
    target = worker or f"{__name__}:run_layout"

    def launch(layout: Layout, reference: dict[str, Any] | None) -> dict[str, Any]:
        states = {"init_state": None, "ref_state": None}
        if reference is not None:
            states = {k: reference[k] for k in states}
        kwargs = {**common, "tp": layout.tp, "pp": layout.pp, **states}
        results = run_workers(target, layout.world_size, kwargs=kwargs, timeout=timeout)
        return next(r for r in results if r is not None)

    reference = launch(Layout(1, 1, 1), None)
    log(_exercised(reference["cases"]))
    first = Variant(micro_batch_counts[0])
    errors: dict[str, dict[str, dict[str, float]]] = {}
    for layout in [Layout(1, 1, 1)] + [x for x in layouts if x != Layout(1, 1, 1)]:
        cases = reference if layout == Layout(1, 1, 1) else launch(layout, reference)
        errors[str(layout)] = {
            name: compare(case, reference["cases"][_baseline_name(name, first)])
            for name, case in cases["cases"].items()
        }
        log(_summary(str(layout), errors[str(layout)], cases["cases"]))
    return errors


def _exercised(cases: dict[str, dict[str, Any]]) -> str:
    """What the reference run exercised: clipping and KL in the off-policy pass."""
    off_policy = [c for name, c in cases.items() if not name.endswith("/pass1")]
    clip = max((c["clip_fraction"] for c in off_policy), default=0.0)
    kl = max((c["kl"] for c in cases.values()), default=0.0)
    return f"reference 1x1x1: clipped tokens up to {clip:.1%} (pass 2+), KL up to {kl:.2e}"


def _summary(
    layout: str, errors: dict[str, dict[str, float]], cases: dict[str, dict[str, Any]]
) -> str:
    worst = {k: max(e[k] for e in errors.values()) for k in ("grad", "update", "grad_norm")}
    counts = sorted({tuple(c["micro_batches"]) for c in cases.values()})
    return (
        f"layout {layout:>7}: {len(errors)} cases, max |dg|/max|g| = {worst['grad']:.2e}, "
        f"update {worst['update']:.2e}, grad norm {worst['grad_norm']:.2e}; "
        f"micro-batches per DP rank {', '.join('/'.join(map(str, c)) for c in counts)}"
    )
