"""Weight sync: the learner's Megatron shards -> Hugging Face names -> rollout servers.

Every rank takes part in gathering the full tensors (``full_state``); global
rank 0 maps them to HF names (the same mapping as the conversion tools) and
sends them inside pause -> flush -> update -> continue, with
``weight_version`` set to the training step:
- ``tensor``: size-bounded buckets to ``/update_weights_from_tensor``, in
  the embedded server's safetensors serialization or, for a real SGLang
  server on the same machine, SGLang's own (``rollout.sglang_weights``);
- ``disk``: ``save_pretrained``-style safetensors in a directory, then
  ``/update_weights_from_disk``;
- ``distributed``: size-bounded buckets announced to
  ``/update_weights_from_distributed`` and broadcast over a process group
  shared with the servers (gloo on CPU, nccl on GPU), opened once with
  ``open_update_group`` and closed with ``close_update_group``.
"""

from __future__ import annotations

import asyncio
import tempfile
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch

from megatron_grpo.config import ModelConfig
from megatron_grpo.mcore.full_state import gather_full_state
from megatron_grpo.mcore.parallel import ParallelContext

if TYPE_CHECKING:
    from megatron_grpo.rollout.sglang_weights import UpdateGroup

SyncMethod = Literal["tensor", "disk", "distributed"]
TensorFormat = Literal["embedded", "sglang"]
"""``/update_weights_from_tensor`` serialization: the embedded server's, or SGLang's."""


def buckets(named: Mapping[str, torch.Tensor], max_bytes: int) -> Iterator[dict[str, torch.Tensor]]:
    """Consecutive groups of tensors of at most ``max_bytes`` each (a bigger tensor goes alone)."""
    bucket: dict[str, torch.Tensor] = {}
    size = 0
    for name, t in named.items():
        nbytes = t.numel() * t.element_size()
        if bucket and size + nbytes > max_bytes:
            yield bucket
            bucket, size = {}, 0
        bucket[name] = t
        size += nbytes
    if bucket:
        yield bucket


def hf_state(model: list, ctx: ParallelContext, cfg: ModelConfig, family: str) -> dict | None:
    """The policy's weights under HF names, on global rank 0 (None elsewhere). Collective."""
    from megatron_grpo.convert.weights import megatron_to_hf

    full = gather_full_state(model, ctx, vocab_size=cfg.vocab_size)
    if full is None:
        return None
    return megatron_to_hf(full, cfg, family)


async def push(
    client,
    named: Mapping[str, torch.Tensor],
    *,
    method: SyncMethod,
    weight_version: str,
    bucket_bytes: int = 512 << 20,
    model_cfg: ModelConfig | None = None,
    family: str | None = None,
    disk_dir: str | None = None,
    tensor_format: TensorFormat = "embedded",
    update_group: UpdateGroup | None = None,
) -> None:
    """Send HF-named weights to every server of ``client`` (an ``SGLangClient``).

    ``disk`` needs ``model_cfg`` and ``family``; ``distributed`` needs the
    ``update_group`` from ``open_update_group`` on the same client.
    """
    if method == "distributed" and update_group is None:
        raise ValueError("method=distributed needs update_group: open one with open_update_group")
    await client.pause_generation(mode="in_place")
    try:
        await client.flush_cache()
        if method == "tensor":
            await _push_tensors(client, named, weight_version, bucket_bytes, tensor_format)
        elif method == "disk":
            assert model_cfg is not None and family is not None
            path = Path(disk_dir or tempfile.mkdtemp(prefix="mgrpo_weights_"))
            save_hf_dir(named, model_cfg, family, path)
            await client.update_weights_from_disk(str(path), weight_version=weight_version)
        elif method == "distributed":
            assert update_group is not None
            await _push_broadcast(client, named, weight_version, bucket_bytes, update_group)
        else:
            raise ValueError(
                f"unknown weight sync method {method!r}; expected tensor, disk or distributed"
            )
    finally:
        await client.continue_generation()


async def _push_tensors(
    client, named: Mapping[str, torch.Tensor], weight_version: str, bucket_bytes: int, fmt: str
) -> None:
    from megatron_grpo.rollout import sglang_weights
    from megatron_grpo.rollout.embedded.weights import tensor_update

    tp_sizes = await server_tp_sizes(client) if fmt == "sglang" else {}
    await client.begin_weight_update()
    try:
        for bucket in buckets(named, bucket_bytes):
            if fmt == "sglang":
                # Kept referenced here until every server has answered (shared memory).
                shared = sglang_weights.shared_copies(bucket)
                payloads: dict[str, Any] = {
                    url: sglang_weights.sglang_tensor_payload(
                        shared, tp_size=tp_sizes[url], weight_version=weight_version
                    )
                    for url in client.urls
                }
            elif fmt == "embedded":
                update = tensor_update(bucket, weight_version=weight_version)
                payloads = dict.fromkeys(client.urls, update)
            else:
                raise ValueError(f"unknown tensor format {fmt!r}; expected embedded or sglang")
            await asyncio.gather(
                *(client.update_weights_from_tensor(p, url=u) for u, p in payloads.items())
            )
    finally:
        await client.end_weight_update()


async def _push_broadcast(
    client,
    named: Mapping[str, torch.Tensor],
    weight_version: str,
    bucket_bytes: int,
    group: UpdateGroup,
) -> None:
    from megatron_grpo.rollout.sglang_weights import dtype_name

    await client.begin_weight_update()
    try:
        for bucket in buckets(named, bucket_bytes):
            # Each server answers once it has received and loaded the whole bucket.
            announce = client.update_weights_from_distributed(
                names=list(bucket),
                dtypes=[dtype_name(t.dtype) for t in bucket.values()],
                shapes=[list(t.shape) for t in bucket.values()],
                group_name=group.name,
                weight_version=weight_version,
            )
            send = asyncio.to_thread(group.broadcast, list(bucket.values()))
            outcomes = await asyncio.gather(announce, send, return_exceptions=True)
            for outcome in outcomes:
                if isinstance(outcome, BaseException):
                    # What was sent may now sit unread on the other side: the group
                    # is out of step and must be closed, not reused.
                    group.broken = True
                    raise outcome
    finally:
        await client.end_weight_update()


async def server_tp_sizes(client) -> dict[str, int]:
    """Each server's tensor-parallel size, from its ``/server_info``."""
    infos = await asyncio.gather(*(client.server_info(url) for url in client.urls))
    return {url: int(info.get("tp_size", 1)) for url, info in zip(client.urls, infos)}


async def open_update_group(
    client, *, master_address: str, backend: str, timeout_s: float = 600.0
) -> UpdateGroup:
    """A weight-broadcast group of this process (rank 0) and every server's TP ranks.

    ``master_address`` must be reachable from the servers; a free port on it
    is used for the group's store. The servers block in
    ``/init_weights_update_group`` until this side joins, so both are
    started together.
    """
    from megatron_grpo.launch import free_port
    from megatron_grpo.rollout import sglang_weights

    tp_sizes = await server_tp_sizes(client)
    world_size = 1 + sum(tp_sizes.values())
    offsets, next_rank = {}, 1
    for url in client.urls:
        offsets[url], next_rank = next_rank, next_rank + tp_sizes[url]
    name = f"mgrpo_weights_{uuid.uuid4().hex[:8]}"
    port = free_port()
    joins = [
        client.init_weights_update_group(
            url=url,
            master_address=master_address,
            master_port=port,
            rank_offset=offsets[url],
            world_size=world_size,
            group_name=name,
            backend=backend,
        )
        for url in client.urls
    ]
    opened = asyncio.to_thread(
        sglang_weights.open_update_group,
        master_address=master_address,
        master_port=port,
        world_size=world_size,
        group_name=name,
        backend=backend,
        timeout_s=timeout_s,
    )
    *joined, group = await asyncio.gather(*joins, opened, return_exceptions=True)
    for outcome in (*joined, group):
        if isinstance(outcome, BaseException):
            raise outcome
    assert isinstance(group, sglang_weights.UpdateGroup)
    return group


async def close_update_group(client, group: UpdateGroup) -> None:
    """The servers leave the group, then this side drops it."""
    try:
        await client.destroy_weights_update_group(group.name)
    finally:
        group.close()


def save_hf_dir(
    named: Mapping[str, torch.Tensor], cfg: ModelConfig, family: str, path: Path
) -> None:
    """A Hugging Face model directory (config.json + model.safetensors) for ``named``."""
    import safetensors.torch

    from megatron_grpo.convert.hf_config import hf_config_from_model_config

    path.mkdir(parents=True, exist_ok=True)
    hf_config_from_model_config(cfg, family).save_pretrained(path)
    plain = {k: v.detach().contiguous().clone() for k, v in named.items()}
    safetensors.torch.save_file(plain, str(path / "model.safetensors"), metadata={"format": "pt"})
