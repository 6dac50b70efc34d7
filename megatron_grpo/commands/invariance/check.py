"""Launch every layout, compare each case with the single-process reference, report."""

from __future__ import annotations

from typing import Any

import torch

from megatron_grpo.commands.invariance.cases import Layout, Variant, default_model, setup
from megatron_grpo.config import ModelConfig
from megatron_grpo.launch import run_workers

REFERENCE = "transformers"
"""The key, among the layouts of ``check``'s result, of the comparison with the gradient
computed outside megatron-core."""


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
    """One unit in the last place of each parameter, in its own dtype: two runs whose
    updates agree exactly can still store p - lr * g rounded half an ulp apart each way."""
    return {k: torch.finfo(v.dtype).eps * v.float().abs() for k, v in params.items()}


def _canonical(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    from megatron_grpo.convert.weights import canonical_megatron_name

    return {canonical_megatron_name(k): v for k, v in state.items()}


def compare(case: dict[str, Any], ref: dict[str, Any]) -> dict[str, float]:
    """One case against its reference case: gradient (when both hold one), SGD or Adam
    update, grad norm, and the disagreement between replicas within the case."""
    out = {}
    if case["grad"] is not None and ref["grad"] is not None:
        out["grad"] = max_relative_error(case["grad"], ref["grad"])
    rounding = parameter_ulp(case["params"])  # the case's own storage (bf16 rounds more)
    out["update"] = max_relative_error(case["update"], ref["update"], rounding)
    out["grad_norm"] = abs(case["grad_norm"] - ref["grad_norm"]) / max(ref["grad_norm"], 1e-30)
    if ref.get("moe_aux_loss"):  # the routers' balance loss is a term of J: its value too
        out["aux_loss"] = abs(case["moe_aux_loss"] - ref["moe_aux_loss"]) / ref["moe_aux_loss"]
    out["replicas"] = case["replicas"]
    return out


def _baseline_name(name: str, first: int) -> str:
    """The reference case of a case: the same mode and pass at 1x1x1, of the same global
    batch in its first variant (``first`` micro-batches, in order)."""
    mode, *variant, step = name.split("/")
    same_batch = Variant(first, global_batch=Variant.global_batch_of("/".join(variant)))
    return f"{mode}/{same_batch}/{step}"


def check(
    layouts: list[Layout],
    *,
    modes: list[str],
    micro_batch_counts: list[int],
    permute: bool = True,
    pack: bool = True,
    features: tuple[str, ...] = (),
    model_cfg: ModelConfig | None = None,
    timeout: float = 600.0,
    log=print,
    worker: str | None = None,
    worker_kwargs: dict[str, Any] | None = None,
) -> dict[str, dict[str, dict[str, float]]]:
    """errors[layout][case] = {grad, update, grad_norm, replicas}, each case against 1x1x1,
    and errors["transformers"][mode] = {grad}: the reference's first pass against the
    gradient computed outside megatron-core (of the fixed batch; under
    ``mode/sparse-groups``, of the sparse-groups batch).

    The reference of every case is the single-process run of the same mode and pass on the
    same global batch, with the first micro-batch count, in the original order, without
    the layout features. A 1x1x1 listed in ``layouts`` with features that apply to one
    process (bf16, recomputation) is a launch of its own with them, compared with that
    reference.
    ``worker`` ("module:function" taking run_layout's arguments and ``worker_kwargs``)
    replaces the worker body, e.g. to plant a bug and see the check catch it.
    """
    model_cfg = model_cfg or default_model()
    if any(x.cp > 1 for x in layouts) and "bf16" not in features:
        raise ValueError(
            "a context-parallel layout needs --features bf16: Transformer Engine splits attention "
            "over CP ranks only in 16-bit (its fused and flash backends)"
        )
    common = dict(
        model_cfg=model_cfg,
        modes=modes,
        micro_batch_counts=micro_batch_counts,
        permute=permute,
        pack=pack,
        features=features,
        **(worker_kwargs or {}),
    )
    target = worker or "megatron_grpo.commands.invariance.worker:run_layout"

    def launch(layout: Layout, reference: dict[str, Any] | None) -> dict[str, Any]:
        states = {"init_state": None, "ref_state": None}
        if reference is not None:
            states = {k: reference[k] for k in states}
        kwargs = {**common, "dp": layout.dp, "tp": layout.tp, "pp": layout.pp, **states}
        if layout.ep > 1:
            kwargs["ep"] = layout.ep
        if layout.cp > 1:
            kwargs["cp"] = layout.cp
        results = run_workers(target, layout.world_size, kwargs=kwargs, timeout=timeout)
        return next(r for r in results if r is not None)

    reference = launch(Layout(1, 1, 1), None)
    log(_exercised(reference["cases"]))

    def first_pass(key: str) -> dict[str, torch.Tensor]:
        """The reference run's first-pass gradient of ``mode`` or ``mode/batch``."""
        mode, _, batch = key.partition("/")
        first = Variant(micro_batch_counts[0], global_batch=Variant.global_batch_of(batch))
        return reference["cases"][f"{mode}/{first}/pass1"]["grad"]

    errors: dict[str, dict[str, dict[str, float]]] = {
        REFERENCE: {
            key: {"grad": max_relative_error(_canonical(first_pass(key)), g)}
            for key, g in reference["transformers"].items()
        }
    }
    log(_reference_line(errors[REFERENCE]))
    single = Layout(1, 1, 1)
    featured = single in layouts and tuple(
        setup(single, features, model_cfg, reference=False).active
    ) != tuple(reference["active"])
    for layout in [single] + [x for x in layouts if x != single]:
        cases = reference if layout == single and not featured else launch(layout, reference)
        errors[str(layout)] = {
            name: compare(case, reference["cases"][_baseline_name(name, micro_batch_counts[0])])
            for name, case in cases["cases"].items()
        }
        log(_summary(str(layout), errors[str(layout)], cases))
    return errors


def _exercised(cases: dict[str, dict[str, Any]]) -> str:
    """What the reference run exercised: clipping and KL in the off-policy pass."""
    off_policy = [c for name, c in cases.items() if not name.endswith("/pass1")]
    clip = max((c["clip_fraction"] for c in off_policy), default=0.0)
    kl = max((c["kl"] for c in cases.values()), default=0.0)
    return f"reference 1x1x1: clipped tokens up to {clip:.1%} (pass 2+), KL up to {kl:.2e}"


def _reference_line(errors: dict[str, dict[str, float]]) -> str:
    worst = max((e["grad"] for e in errors.values()), default=float("nan"))
    return (
        f"reference 1x1x1 vs transformers and the loss from its definition (first pass): "
        f"max |dg|/max|g| = {worst:.2e}"
    )


def _summary(layout: str, errors: dict[str, dict[str, float]], result: dict[str, Any]) -> str:
    names = ("grad", "update", "grad_norm", "aux_loss", "replicas")
    worst = {k: max((e[k] for e in errors.values() if k in e), default=None) for k in names}
    shown = ", ".join(f"{k.replace('_', ' ')} {v:.2e}" for k, v in worst.items() if v is not None)
    counts = sorted({tuple(c["micro_batches"]) for c in result["cases"].values()})
    features = ", ".join(result["active"]) or "none"
    return (
        f"layout {layout:>7} (features: {features}): {len(errors)} cases, max |delta|/max|g|: "
        f"{shown}; {_groups_held(result['cases'])}; "
        f"micro-batches per DP rank {', '.join('/'.join(map(str, c)) for c in counts)}"
    )


def _groups_held(cases: dict[str, dict[str, Any]]) -> str:
    """How many of the sparse-groups batch's prompt groups each DP rank held."""
    held = [
        (len(groups), len(set().union(*case["groups"])))
        for name, case in cases.items()
        if Variant.global_batch_of(name.split("/", 1)[1]) == "sparse-groups"
        for groups in case["groups"]
    ]
    if not held:
        return "no sparse-groups case"
    counts = sorted({h for h, _ in held})
    return f"sparse-groups: {counts[0]}-{counts[-1]} of {held[0][1]} prompt groups per DP rank"
