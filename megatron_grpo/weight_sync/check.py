"""``rollout.sync.check``: after a push, what the engines hold compared with what was sent.

Two ways, chosen per engine (``check_ways``):
- ``rows``: the sender keeps the first rows of every weight it sends and reads them back
  (``/get_weights_by_name``, which SGLang serves too); equal within bf16 rounding;
- ``checksum``: the sender keeps a checksum of every weight's bytes as sent
  (``embedded.checksum``) and asks the engine for its own (``/weights_checksum``); any
  changed byte is caught. Only the embedded server answers it. SGLang 0.5.23 has no such
  request for the weights as sent: its ``/weights_checker`` (action ``checksum``) hashes its
  own parameters, under its names (fused ``qkv_proj``, ``gate_up_proj``), as TP shards, in
  its dtype, which the learner's tensors match only through SGLang's loader; so an SGLang
  engine gets ``rows``.
The main rank gathers what every stage found and stops the run, naming the weights and
engines, first mismatch first (``raise_on_problems``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from megatron_grpo.weight_sync.plan import CheckMode, SyncPlan
from megatron_grpo.weight_sync.server_kinds import ServerKind

logger = logging.getLogger(__name__)

CHECK_ROWS = 4
"""Leading rows of each weight compared by ``rollout.sync.check``."""
_READ = (
    "SGLang 0.5.23 reads weights back (/get_weights_by_name) for llama-family models "
    "only; for others turn rollout.sync.check off"
)


def check_mode(setting: bool | str) -> CheckMode | None:
    """The check that ``rollout.sync.check`` asks for (``true`` is ``rows``)."""
    if setting is True or setting == "rows":
        return "rows"
    if setting == "checksum":
        return "checksum"
    if setting is False:
        return None
    raise ValueError(f"rollout.sync.check must be true, false, rows or checksum, got {setting!r}")


def check_ways(mode: CheckMode, kinds: Mapping[str, ServerKind]) -> dict[str, CheckMode]:
    """How each engine is checked: ``checksum`` where asked and the engine answers it (the
    embedded server), ``rows`` elsewhere."""
    return {
        url: "checksum" if mode == "checksum" and kind.embedded else "rows"
        for url, kind in kinds.items()
    }


def first_rows(tensor: Tensor) -> Tensor:
    """What ``rows`` keeps of a weight sent: its first rows, as fp32 on the CPU."""
    return tensor.detach()[:CHECK_ROWS].float().cpu().clone()


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


async def compare_checksums(
    client: Any, url: str, sums: Mapping[str, tuple[str, str]]
) -> list[str]:
    """The weights of ``sums`` (name -> the dtype it was sent in and its checksum) whose
    checksum the engine at ``url`` answers differently, in the order sent."""
    from megatron_grpo.sglang_api.errors import RolloutHTTPError

    if not sums:
        return []
    names = list(sums)
    try:
        theirs = await client.weights_checksum(names, [sums[n][0] for n in names], url=url)
    except RolloutHTTPError as err:
        return [f"{url}: the engine answered no checksums ({err})"]
    problems = []
    for name, got in zip(names, theirs, strict=True):
        dtype, sent = sums[name]
        if got != sent:
            problems.append(f"{url}: {name}: checksum {got}, the learner sent {sent} ({dtype})")
    return problems


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
