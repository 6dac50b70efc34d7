"""``rollout.sync.method=distributed``: a stage's sender is rank 0 of a weight-broadcast group
with every engine's TP ranks (one group per stage, kept open across pushes by the sender).

- ``open_update_group`` / ``close_update_group``: the group, joined by the engines through
  ``/init_weights_update_group`` while this side joins (``sglang_api.update_group``);
- ``distributed_method``: each bucket announced to ``/update_weights_from_distributed`` and
  broadcast.
"""

from __future__ import annotations

import asyncio
import socket
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torch import Tensor

from megatron_grpo.weight_sync.plan import SyncPlan
from megatron_grpo.weight_sync.server_kinds import server_kinds

if TYPE_CHECKING:
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


def distributed_method(
    client: Any, group: UpdateGroup, plan: SyncPlan
) -> tuple[Callable, Callable]:
    """``(prepare, deliver)``: a bucket goes as it is, announced and broadcast over ``group``."""
    from megatron_grpo.sglang_api.update_group import dtype_name

    async def deliver(bucket: dict[str, Tensor]) -> None:
        # Each engine answers once it has received and loaded the whole bucket.
        announce = client.update_weights_from_distributed(
            names=list(bucket),
            dtypes=[dtype_name(t.dtype) for t in bucket.values()],
            shapes=[list(t.shape) for t in bucket.values()],
            group_name=group.name,
            weight_version=plan.weight_version,
        )
        send = asyncio.to_thread(group.broadcast, list(bucket.values()))
        for outcome in await asyncio.gather(announce, send, return_exceptions=True):
            if isinstance(outcome, BaseException):
                # What was sent may sit unread on the other side: the group is out of
                # step and is opened anew at the next push.
                group.broken = True
                raise outcome

    return (lambda bucket: bucket), deliver


def host_address() -> str:
    """This host's address, for engines to reach a sender away from the main rank's host."""
    return socket.gethostbyname(socket.gethostname())
