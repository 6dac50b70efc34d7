"""``check-invariance``: the gradient of one global batch must not depend on the layout.

One fixed global batch (varied lengths, a fully masked sequence, a masked
tool-output span, uneven prompt groups, rollout log-probs off the policy's) is
trained at each layout (DP x TP x PP, and CP where Transformer Engine runs, as real
multi-process gloo or nccl) by
the trainer's own step function, ``train.step.train_on_rollout``: its planner
splits the batch over DP ranks and into micro-batches under a token budget, the
behaviour and reference log-probs are frozen, the loss weights come from one DP
all-reduce, and two optimizer passes run over the batch (mu = 2, so the second
pass is off-policy: ratios differ from 1 and clip). Each layout runs with token
budgets that give 1 and several micro-batches per rank, in the given order and
under a permutation of the samples, and packed. Two more batches are laid out by the
same planner: one leaves a DP rank without loss tokens, one scatters its prompt groups
over the DP ranks as at scale (each rank holds a few, no two the same). ``features``
switch on the distributed optimizer, sequence parallelism, recomputation, a virtual
pipeline or bf16 where the layout allows (``cases.FEATURES``).

For each pass, the full gradient, the parameter update (plain SGD, or Adam with
an eps that keeps it proportional to the gradient: Adam's usual first step is
nearly sign(g) and would hide a scale error; differences within one ulp of the
parameter are storage rounding) and the global gradient norm are compared with
the single-process run, and every copy of a replicated tensor (DP replicas,
TP-replicated norms) with the others: max |delta| / max |g| must stay under the
tolerance. The single-process run itself is compared with the gradient computed
outside megatron-core, by transformers and the loss written from its definition
(``reference.py``), so that an error every layout shares shows too.

Modules: ``cases`` (layouts, features, the batch), ``worker`` (one launch),
``reference`` (the gradient outside megatron-core), ``check`` (launch and compare).
"""

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from megatron_grpo.commands.invariance.cases import (
        GROUP_SIZES,
        MAX_COMPLETION,
        Layout,
        default_loss,
        default_model,
        fixed_batch,
        parse_features,
    )
    from megatron_grpo.commands.invariance.check import REFERENCE, check
    from megatron_grpo.commands.invariance.features import BF16_TOLERANCE, FEATURES, TF32_TOLERANCE

_WHERE = {
    "BF16_TOLERANCE": "features",
    "FEATURES": "features",
    "TF32_TOLERANCE": "features",
    "GROUP_SIZES": "cases",
    "MAX_COMPLETION": "cases",
    "Layout": "cases",
    "default_loss": "cases",
    "default_model": "cases",
    "fixed_batch": "cases",
    "parse_features": "cases",
    "REFERENCE": "check",
    "check": "check",
}


def __getattr__(name: str) -> Any:
    """The names below, imported on first use: the command line parser imports this
    package, and a run that does not check invariance should not import torch for it."""
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = importlib.import_module(f"{__name__}.{_WHERE[name]}")
    # Importing ``check`` made the package's ``check`` that module: the function wins.
    for other, where in _WHERE.items():
        if where == _WHERE[name]:
            globals()[other] = getattr(module, other)
    return globals()[name]


__all__ = [
    "BF16_TOLERANCE",
    "FEATURES",
    "GROUP_SIZES",
    "MAX_COMPLETION",
    "REFERENCE",
    "TF32_TOLERANCE",
    "Layout",
    "check",
    "default_loss",
    "default_model",
    "fixed_batch",
    "parse_features",
]
