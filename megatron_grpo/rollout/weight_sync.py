"""Weight sync helpers around the stage senders (``stage_sender``).

- ``open_update_group`` / ``close_update_group``: a weight-broadcast group of one sender
  (rank 0) and every engine's TP ranks, for ``rollout.sync.method=distributed``;
- ``write_disk_index``: after every stage has written its safetensors files for
  ``rollout.sync.method=disk``, the ``config.json`` and ``model.safetensors.index.json`` that make
  the directory a Hugging Face checkpoint the engines load.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from megatron_grpo.config import ModelConfig
from megatron_grpo.rollout.server_kinds import server_kinds

if TYPE_CHECKING:
    from megatron_grpo.rollout.stage_sender import StageReport
    from megatron_grpo.sglang_api.update_group import UpdateGroup


async def open_update_group(
    client,
    *,
    master_address: str,
    backend: str,
    timeout_s: float = 600.0,
    name: str | None = None,
) -> UpdateGroup:
    """A weight-broadcast group of this process (rank 0) and every server's TP ranks.

    ``master_address`` must be reachable from the servers; a free port on it
    is used for the group's store. The servers block in
    ``/init_weights_update_group`` until this side joins, so both are
    started together.
    """
    from megatron_grpo.launch import free_port
    from megatron_grpo.sglang_api import update_group as sglang_weights

    tp_sizes = {url: kind.tp_size for url, kind in (await server_kinds(client)).items()}
    world_size = 1 + sum(tp_sizes.values())
    offsets, next_rank = {}, 1
    for url in client.urls:
        offsets[url], next_rank = next_rank, next_rank + tp_sizes[url]
    name = name or f"mgrpo_weights_{uuid.uuid4().hex[:8]}"
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


def write_disk_index(
    path: str | Path, reports: Sequence[StageReport], cfg: ModelConfig, family: str
) -> None:
    """``config.json`` and the safetensors index for the files the stages wrote in ``path``."""
    from megatron_grpo.convert.hf_config import hf_config_from_model_config

    path = Path(path)
    hf_config_from_model_config(cfg, family).save_pretrained(path)
    weight_map = {name: file for r in reports for file, names in r.files.items() for name in names}
    index = {"metadata": {"total_size": sum(r.nbytes for r in reports)}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
