"""One pipeline stage's sender: streams its HF-named weights to every rollout engine.

The main rank opens a push (pause -> flush -> begin, ``weight_sync.engines.begin_push``)
and hands every stage's sender a ``SyncPlan``; each sender then streams its own stage, a
bucket of at most ``plan.bucket_bytes`` at a time, while the next bucket is being
gathered (``weight_sync.stream``), and answers with a ``StageReport``; the main rank
closes the push (``finish_push``). Per method:
- ``tensor``: one ``/update_weights_from_tensor`` request per bucket and engine
  (``weight_sync.tensor``);
- ``disk``: one safetensors file per bucket in ``plan.disk_dir``; the main rank adds the
  index and config and calls ``/update_weights_from_disk`` once every stage has written
  (``weight_sync.disk``);
- ``distributed``: the sender is rank 0 of its own broadcast group with the engines
  (one group per stage, kept open across pushes); each bucket is announced to
  ``/update_weights_from_distributed`` and broadcast (``weight_sync.distributed``).

Peak extra memory of a sender during a push: the full tensors of two units (a decoder
layer, or the embedding or head: the one being gathered, ``mcore.hf_export``, and the one
whose bucket is in flight) plus two buckets (the copy being made ready and the one in
flight; a bucket holds at least one tensor, so it may be the largest tensor); buckets being
filled hold views. ``distributed`` sends from the tensors themselves. The dry run prints
the figure (``commands.memory_model.weight_push_bytes``). With ``rollout.sync.delta`` the
sender also keeps, between pushes, a host copy of the bytes it last sent: its stage's full
weights (``weight_sync.delta``; ``memory_model.delta_copy_bytes``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import uuid
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from torch import Tensor

from megatron_grpo.embedded.checksum import tensor_checksum
from megatron_grpo.sglang_api.update_group import dtype_name
from megatron_grpo.weight_sync.check import (
    check_ways,
    compare_checksums,
    first_rows,
    read_back,
)
from megatron_grpo.weight_sync.delta import DeltaState
from megatron_grpo.weight_sync.disk import disk_method
from megatron_grpo.weight_sync.distributed import (
    close_update_group,
    distributed_method,
    host_address,
    open_update_group,
)
from megatron_grpo.weight_sync.plan import CheckMode, StageReport, SyncPlan
from megatron_grpo.weight_sync.stream import buckets, drain, pipelined
from megatron_grpo.weight_sync.tensor import tensor_method

logger = logging.getLogger(__name__)


class ProducerError(RuntimeError):
    """Gathering or converting the stage's weights failed (not the engines)."""


class StageSender:
    """The sender of one pipeline stage: its own client to the engines and, for
    ``distributed``, its own broadcast group with them."""

    def __init__(
        self, client_config: Callable[[tuple[str, ...]], Any], stage: int, *, backend: str
    ) -> None:
        """``client_config(urls)`` gives the ``ClientConfig`` for the engines at ``urls``."""
        self.client_config = client_config
        self.stage = stage
        self.backend = backend
        self.loop = asyncio.new_event_loop()
        self.client: Any = None
        self.group: Any = None
        self._group_urls: tuple[str, ...] = ()
        self._ways: dict[str, CheckMode] = {}
        """``rollout.sync.check``: how each engine of the last push is checked."""
        self._samples: dict[str, Tensor] = {}
        """``rows``: the first rows of each weight sent."""
        self._sums: dict[str, tuple[str, str]] = {}
        """``checksum``: the dtype and checksum of each weight sent."""
        self._warned: set[str] = set()
        self.delta = DeltaState()
        """``rollout.sync.delta``: the bytes and version of the last push."""

    # ---- one push ----

    def send(self, layers: Iterator[Mapping[str, Tensor]], plan: SyncPlan) -> StageReport:
        """Stream ``layers`` (HF-named tensors) to the engines of ``plan``; never raises for
        an engine's failure (the report says it), and always runs ``layers`` to its end."""
        from megatron_grpo.sglang_api.errors import RolloutError

        report = StageReport(stage=self.stage)
        self._ways, self._samples, self._sums = {}, {}, {}
        named = self._named(layers, report)
        self.delta.start()
        try:
            self.loop.run_until_complete(self._send(named, plan, report))
        except ProducerError:
            self.delta.finish(self.stage, None)
            raise
        except Exception as err:  # noqa: BLE001 - reported to the main rank, which decides
            report.error = f"stage {self.stage}: {type(err).__name__}: {err}"
            report.rollout_error = isinstance(err, RolloutError)
            drain(named)
        if plan.delta:
            self.delta.finish(self.stage, None if report.error else plan.weight_version)
            report.sent_bytes = self.delta.sent_bytes
        return report

    def _named(
        self, layers: Iterator[Mapping[str, Tensor]], report: StageReport
    ) -> Iterator[tuple[str, Tensor]]:
        # Runs once _send has chosen the checks (the first bucket is asked for after that).
        keep_rows, keep_sums = "rows" in self._ways.values(), "checksum" in self._ways.values()
        try:
            for layer in layers:
                for name, tensor in layer.items():
                    report.nbytes += tensor.numel() * tensor.element_size()
                    if keep_rows:
                        self._samples[name] = first_rows(tensor)
                    if keep_sums:
                        self._sums[name] = (dtype_name(tensor.dtype), tensor_checksum(tensor))
                    yield name, tensor
        except Exception as err:
            raise ProducerError(f"stage {self.stage}: gathering the weights failed: {err}") from err

    async def _send(
        self, named: Iterator[tuple[str, Tensor]], plan: SyncPlan, report: StageReport
    ) -> None:
        client = await self._client(plan.urls)
        if plan.check:
            self._ways = await self._check_ways(client, plan.urls, plan.check)
        if plan.method == "tensor":
            prepare, deliver = await tensor_method(client, plan, self.delta if plan.delta else None)
        elif plan.method == "disk":
            prepare, deliver = disk_method(plan, report, self.stage)
        elif plan.method == "distributed":
            prepare, deliver = distributed_method(client, await self._group(client, plan), plan)
        else:
            raise ValueError(f"unknown weight sync method {plan.method!r}")
        await pipelined((prepare(b) for b in buckets(named, plan.bucket_bytes)), deliver)

    # ---- engines and groups ----

    async def _client(self, urls: tuple[str, ...]) -> Any:
        from megatron_grpo.rollout.client import SGLangClient

        if self.client is None or tuple(self.client.all_urls) != urls:
            if self.client is not None:
                await self.client.close()
            self.client = SGLangClient(self.client_config(urls))
            await self.client.__aenter__()
        return self.client

    async def _group(self, client: Any, plan: SyncPlan) -> Any:
        """This stage's broadcast group with the engines of ``plan``, opened when there is
        none yet, it broke, or the engines changed."""
        if self.group is not None and (self.group.broken or self._group_urls != plan.urls):
            with contextlib.suppress(Exception):  # engines that died cannot leave it
                await close_update_group(client, self.group)
            self.group = None
        if self.group is None:
            same_host = socket.gethostname() == plan.main_host
            self.group = await open_update_group(
                client,
                master_address=plan.master_address if same_host else host_address(),
                backend=self.backend,
                timeout_s=client.config.weight_update_timeout_s,
                name=f"mgrpo_weights_stage{self.stage}_{uuid.uuid4().hex[:8]}",
            )
            self._group_urls = plan.urls
        return self.group

    # ---- after a push ----

    async def _check_ways(
        self, client: Any, urls: tuple[str, ...], mode: CheckMode
    ) -> dict[str, CheckMode]:
        from megatron_grpo.weight_sync.server_kinds import server_kinds

        if mode == "rows":  # every engine answers it: no need to ask what each is
            return dict.fromkeys(urls, mode)
        ways = check_ways(mode, await server_kinds(client))
        fallen_back = sorted(u for u, way in ways.items() if way != mode and u not in self._warned)
        if fallen_back:
            logger.warning(
                "rollout.sync.check=checksum: SGLang engine(s) %s answer no checksum of the "
                "weights as sent; their first rows are compared instead",
                ", ".join(fallen_back),
            )
            self._warned.update(fallen_back)
        return ways

    def check(self, plan: SyncPlan) -> list[str]:
        """The weights this stage sent that some engine holds differently (first rows, or
        checksums: ``weight_sync.check``), first mismatch first."""
        return self.loop.run_until_complete(self._check(plan))

    async def _check(self, plan: SyncPlan) -> list[str]:
        client = await self._client(plan.urls)
        problems = []
        for url in plan.urls:
            if self._ways.get(url) == "checksum":
                problems += await compare_checksums(client, url, self._sums)
            else:
                problems += await read_back(client, (url,), self._samples)
        return problems

    def close(self) -> None:
        async def close() -> None:
            if self.group is not None:
                with contextlib.suppress(Exception):
                    await close_update_group(self.client, self.group)
            if self.client is not None:
                await self.client.close()

        try:
            self.loop.run_until_complete(close())
        finally:
            self.group = self.client = None
            self.loop.close()
