"""``rollout.sync.check``: after a push, what the engines hold compared with what was sent.

Each sender keeps the first rows of every weight it sends and reads them back from every
engine (``/get_weights_by_name``); the main rank gathers what differs and stops the run,
naming the weights (``raise_on_problems``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from megatron_grpo.weight_sync.plan import SyncPlan

logger = logging.getLogger(__name__)

CHECK_ROWS = 4
"""Leading rows of each weight compared by ``rollout.sync.check``."""
_READ = (
    "SGLang 0.5.23 reads weights back (/get_weights_by_name) for llama-family models "
    "only; for others turn rollout.sync.check off"
)


async def read_back(client: Any, urls: tuple[str, ...], samples: Mapping[str, Tensor]) -> list[str]:
    """The weights of ``samples`` (name -> the learner's first rows) that some engine at
    ``urls`` holds differently."""
    from megatron_grpo.sglang_api.errors import RolloutHTTPError

    problems = []
    for url in urls:
        for name, ours in samples.items():
            try:
                got = await client.get_weights_by_name(name, truncate_size=CHECK_ROWS, url=url)
            except RolloutHTTPError as err:
                problems.append(f"{url}: {name}: the engine did not return it ({err}); {_READ}")
                break  # the engine reads no weight of this model back
            if problem := compare_sample(name, ours, torch.tensor(got, dtype=torch.float32)):
                problems.append(f"{url}: {problem}")
    return problems


def compare_sample(name: str, ours: Tensor, theirs: Tensor) -> str | None:
    """Why an engine's first rows of ``name`` differ from the learner's, or None.

    Equal within bf16 rounding (an engine may hold the weights in bf16). An engine with
    tensor parallelism may return only its own columns of a row-parallel weight: the
    leading columns are compared.
    """
    if theirs.dim() != ours.dim() or theirs.shape[0] != ours.shape[0]:
        return f"{name}: shape {tuple(theirs.shape)}, the learner's first rows {tuple(ours.shape)}"
    if ours.dim() > 1:
        ours = ours[..., : theirs.shape[-1]]
    scale = float(ours.abs().max()) if ours.numel() else 0.0
    diff = float((ours - theirs).abs().max()) if ours.numel() else 0.0
    if diff > 2**-7 * scale + 1e-6:
        return f"{name}: differs by up to {diff:.3g} (largest value {scale:.3g})"
    return None


def raise_on_problems(plan: SyncPlan, problems: list[str]) -> None:
    """Fail, naming the weights, if an engine differs (every stage's problems, on the main
    rank); else log that the push was checked."""
    if problems:
        shown = "\n  ".join(problems[:20])
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        raise RuntimeError(
            f"rollout.sync.check: after pushing weight version {plan.weight_version} "
            f"the engines hold different weights:\n  {shown}{more}"
        )
    logger.info("weight version %s checked on %d engine(s)", plan.weight_version, len(plan.urls))
