"""A push as the engines see it, on the main rank: opened on every engine in use (pause,
flush, begin) before the stages send, and closed once they have (end, continue).

Both work through the main rank's ``RolloutRuntime``, which owns the engines: it takes back
the engines that answer again before a push, and drops those that fail one and no longer
answer (the stages then push again to the others). Another process that generates with
the same engines (the rollout producer, ``runtime.holders``) is held for the push.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import socket
import tempfile
from typing import TYPE_CHECKING

from megatron_grpo.weight_sync.check import check_mode
from megatron_grpo.weight_sync.plan import StageReport, SyncPlan

if TYPE_CHECKING:
    from megatron_grpo.rollout.runtime import RolloutRuntime

logger = logging.getLogger(__name__)


def refuse_delta_to_sglang(runtime: RolloutRuntime) -> None:
    """``rollout.sync.delta`` at start: a ValueError when an engine answers (``/server_info``)
    that it is SGLang, which has no endpoint that applies a delta. ``engines.type: sglang``
    alone does not say it: embedded servers may be attached at ``urls``."""
    from megatron_grpo.weight_sync.delta import refuse_sglang
    from megatron_grpo.weight_sync.server_kinds import server_kinds

    refuse_sglang(runtime.io.run(server_kinds(runtime.weight_client)))


def begin_push(runtime: RolloutRuntime, weight_version: str) -> SyncPlan:
    """Open a push on every engine in use (pause, flush, begin) and say how the stage
    senders send; engines that answer again are taken back first."""
    from megatron_grpo.sglang_api.errors import RolloutError

    runtime.take_back_engines()
    client = runtime.weight_client
    for holder in runtime.holders:  # before the pause: what it aborts waits for the update
        holder.hold()
    sync = runtime.cfg.sync
    disk_dir = None
    if sync.method == "disk":
        disk_dir = tempfile.mkdtemp(prefix="mgrpo_weights_", dir=sync.disk_dir)

    async def begin(again: bool) -> None:
        if again and sync.method != "disk":
            # Some engines may have opened their update session before another failed.
            with contextlib.suppress(RolloutError):
                await client.end_weight_update()
        # Samples generating now are aborted with their tokens so far and sent again
        # once the update is done (SGLangClient.hold_generation): each token is
        # generated whole by one weight version.
        await runtime.client.hold_generation()
        await client.pause_generation(mode="abort")
        await client.flush_cache()
        if sync.method != "disk":
            await client.begin_weight_update()

    runtime.run_or_drop(begin, "opening a weight update")
    return SyncPlan(
        urls=client.urls,
        method=sync.method,
        weight_version=weight_version,
        bucket_bytes=sync.bucket_mb << 20,
        disk_dir=disk_dir,
        main_host=socket.gethostname(),
        master_address=sync.master_address,
        check=check_mode(sync.check),
        delta=sync.delta,
    )


def finish_push(runtime: RolloutRuntime, plan: SyncPlan, reports: list[StageReport]) -> bool:
    """Close the push that every stage has sent (True), or drop the engines that failed
    it and no longer answer (False: push again to the others). Raises on a learner-side
    failure, or when no engine is left."""
    from megatron_grpo.sglang_api.errors import RolloutError
    from megatron_grpo.weight_sync.disk import write_disk_index

    failed = [r for r in reports if r.error]
    client = runtime.weight_client

    async def finish() -> None:
        try:
            if not failed and plan.method == "disk":
                assert plan.disk_dir is not None and runtime.model_cfg is not None
                family = runtime.model_cfg.hf_family
                write_disk_index(plan.disk_dir, reports, runtime.model_cfg, family)
                await client.update_weights_from_disk(
                    plan.disk_dir, weight_version=plan.weight_version
                )
            if plan.method != "disk":
                await client.end_weight_update()
        finally:
            try:
                await client.continue_generation()
            finally:
                await runtime.client.release_generation()

    try:
        runtime.io.run(finish())
    except RolloutError as err:
        if failed:
            logger.warning("closing a failed weight update: %s", err)
        else:
            failed.append(StageReport(stage=-1, error=str(err), rollout_error=True))
    finally:
        if plan.disk_dir is not None:
            shutil.rmtree(plan.disk_dir, ignore_errors=True)
        for holder in runtime.holders:
            holder.release(client.urls)
    if not failed:
        return True
    why = "; ".join(r.error or "" for r in failed)
    if not all(r.rollout_error for r in failed):
        raise RuntimeError(f"weight sync failed: {why}")
    if not runtime.drop_silent_engines(f"weight update failed: {why}", wait=True):
        raise RolloutError(f"weight sync failed: {why}")
    return False
