"""``rollout.sync.delta``: a stage's sender sends the embedded engines that hold its last
push only what changed (``embedded.delta``), and the rest of them the full tensors.

A stage's ``DeltaState`` keeps, per tensor, the raw bytes it last sent (a host copy of the
stage's weights: ``commands.memory_model.weight_push_bytes`` counts it) and the weight
version of its last complete push. An engine whose ``/model_info`` version is that one (or
the version being pushed: another stage got there first) gets deltas; any other (first push,
a restarted engine, a push that failed half way) gets the full tensors. What an engine could
not apply (a checksum that differs, another base) is pushed in full from the kept bytes, and
one warning line names it. SGLang has no endpoint that applies a delta: a push with
delta on to an SGLang engine is refused (``refuse_sglang``) when the trainer starts, once its
engines answer what they are (``engines.refuse_delta_to_sglang``), and again by every push.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from megatron_grpo.embedded import delta as wire
from megatron_grpo.sglang_api.update_group import dtype_name
from megatron_grpo.weight_sync.server_kinds import ServerKind

logger = logging.getLogger(__name__)


@dataclass
class DeltaState:
    """One stage's sender's memory of its last push."""

    previous: dict[str, tuple[str, list[int], np.ndarray]] = field(default_factory=dict)
    """Name -> dtype, shape and bytes last sent (replaced as each tensor is sent)."""
    version: str | None = None
    """The weight version of the last push that completed; None: none, or one that failed."""
    repaired: dict[str, set[str]] = field(default_factory=dict)
    """This push: engine URL -> the names it could not apply, pushed in full."""
    sent_bytes: int = 0
    """This push: bytes of tensor data (compressed deltas, full tensors) sent to one engine."""

    def start(self) -> None:
        self.repaired, self.sent_bytes = {}, 0

    def finish(self, stage: int, weight_version: str | None) -> None:
        """Close the push: its version (None when it failed), and the one warning line."""
        self.version = weight_version
        if self.repaired:
            logger.warning(
                "rollout.sync.delta: stage %d: engine(s) could not apply the delta of %s; "
                "pushed in full",
                stage,
                "; ".join(f"{url}: {', '.join(sorted(n))}" for url, n in self.repaired.items()),
            )

    def encode(
        self, bucket: Mapping[str, Tensor], weight_version: str, *, deltas: bool
    ) -> tuple[wire.DeltaBucket | None, list[str]]:
        """Keep ``bucket``'s bytes; with ``deltas``, its delta bucket against the kept
        ones and the names that have none (to send in full)."""
        out = wire.DeltaBucket(base_version=self.version or "", weight_version=weight_version)
        no_base = []
        for name, tensor in bucket.items():
            new = wire.raw_bytes(tensor)
            dtype, shape = dtype_name(tensor.dtype), list(tensor.shape)
            old = self.previous.get(name)
            self.previous[name] = (dtype, shape, new)
            if not deltas:
                continue
            if old is None or old[0] != dtype or old[2].size != new.size:
                no_base.append(name)
                continue
            frame = wire.xor_frame(new, old[2])
            if frame is None:
                out.unchanged.append(name)
            else:
                out.add(name, dtype, shape, wire.checksum_of(new), frame)
        return (out if deltas else None), no_base

    def full(self, names: list[str]) -> dict[str, Tensor]:
        """The tensors ``names`` as last sent, from the kept bytes."""
        named = {}
        for name in names:
            dtype, shape, data = self.previous[name]
            named[name] = torch.from_numpy(data).view(getattr(torch, dtype)).reshape(shape)
        return named


def refuse_sglang(kinds: Mapping[str, ServerKind]) -> None:
    """A ValueError naming the SGLang engines among ``kinds`` (url -> what it is), which
    ``rollout.sync.delta`` cannot reach."""
    sglang = [url for url, kind in kinds.items() if not kind.embedded]
    if sglang:
        raise ValueError(
            f"rollout.sync.delta: {', '.join(sglang)} "
            f"{'is an SGLang engine' if len(sglang) == 1 else 'are SGLang engines'}, and "
            "SGLang's API has no endpoint that applies a delta; turn rollout.sync.delta off "
            "(full pushes)"
        )


async def delta_engines(
    client: Any, urls: tuple[str, ...], state: DeltaState, plan: Any
) -> list[str]:
    """The engines of ``urls`` that hold this sender's last push (or part of this one)."""
    if state.version is None:
        return []
    held = (state.version, plan.weight_version)
    return [u for u in urls if str((await client.model_info(u)).get("weight_version")) in held]


async def send_delta(
    client: Any,
    url: str,
    bucket: wire.DeltaBucket,
    no_base: list[str],
    state: DeltaState,
    *,
    first: bool,
) -> None:
    """One delta bucket to the engine at ``url``, then in full what it could not apply."""
    from megatron_grpo.embedded.weights import tensor_update

    body = bucket.body()
    failed = await client.update_weights_from_delta(body, url=url)
    full = state.full(sorted(set(failed) | set(no_base)))
    if failed:
        state.repaired.setdefault(url, set()).update(failed)
    if first:
        state.sent_bytes += len(body) + sum(t.numel() * t.element_size() for t in full.values())
    if full:
        payload = tensor_update(full, weight_version=bucket.weight_version)
        await client.update_weights_from_tensor(payload, url=url)
