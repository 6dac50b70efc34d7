"""``rollout.sync.method=tensor``: one ``/update_weights_from_tensor`` request per bucket and
engine, in the fastest form each engine takes.

Per engine, as its ``/server_info`` says it is (``weight_sync.server_kinds``): an embedded
server on this host, the bucket in shared memory; an embedded server elsewhere, a
safetensors body (both ``embedded.weights``); with ``rollout.sync.delta``, an embedded
server that holds the sender's last push, a delta bucket (``weight_sync.delta``); SGLang,
its CUDA IPC handles to copies on this GPU (for SGLang on a GPU, from a process with a GPU)
or shared-memory handles otherwise, one pickle per TP rank (``weight_sync.sglang_tensor``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from megatron_grpo.weight_sync.delta import (
    DeltaState,
    delta_engines,
    refuse_sglang,
    send_delta,
)
from megatron_grpo.weight_sync.plan import SyncPlan
from megatron_grpo.weight_sync.server_kinds import ServerKind, server_kinds


async def tensor_method(
    client: Any, plan: SyncPlan, delta: DeltaState | None = None
) -> tuple[Callable, Callable]:
    """``(prepare, deliver)`` for a push to the engines of ``plan``: ``prepare(bucket)`` makes
    a bucket ready for the ways some engine needs (on the producer thread), ``deliver``
    sends it to every engine and frees it. ``delta``: the sender's state with
    ``rollout.sync.delta`` on."""
    kinds = await server_kinds(client)
    if delta is not None:  # an engine taken back may have come back as SGLang
        refuse_sglang({u: kinds[u] for u in plan.urls})
    by_delta = await delta_engines(client, plan.urls, delta, plan) if delta is not None else []
    by_way: dict[str, list[str]] = {"shm": [], "body": [], "sglang": [], "sglang_cuda": []}
    for url in plan.urls:
        if url not in by_delta:
            by_way[kinds[url].tensor_way()].append(url)
    bucket_maker = _TensorBuckets(by_way, plan.weight_version, delta, bool(by_delta))

    async def deliver(prepared: _Prepared) -> None:
        try:
            sends = [
                client.update_weights_from_tensor(payload, url=url)
                for url, payload in prepared.payloads(by_way, kinds)
            ]
            if delta is not None and prepared.delta is not None:
                bucket, no_base = prepared.delta
                sends += [
                    send_delta(client, url, bucket, no_base, delta, first=i == 0)
                    for i, url in enumerate(by_delta)
                ]
            elif delta is not None:
                delta.sent_bytes += prepared.nbytes
            await asyncio.gather(*sends)
        finally:
            prepared.close()

    return bucket_maker, deliver


@dataclass
class _Prepared:
    """A bucket made ready for every way it is sent; ``close()`` frees shared memory."""

    weight_version: str
    shm: Any = None
    body: Any = None
    sglang: Any = None
    sglang_cuda: Any = None
    delta: Any = None
    """``rollout.sync.delta``: the delta bucket and the names without a base."""
    nbytes: int = 0

    def payloads(
        self, by_way: Mapping[str, list[str]], kinds: Mapping[str, ServerKind]
    ) -> Iterator[tuple[str, Any]]:
        from megatron_grpo.weight_sync import sglang_tensor

        for url in by_way["shm"]:
            yield url, self.shm.request(weight_version=self.weight_version)
        for url in by_way["body"]:
            yield url, self.body
        for way in ("sglang", "sglang_cuda"):
            for url in by_way[way]:
                yield (
                    url,
                    sglang_tensor.sglang_tensor_payload(
                        getattr(self, way),
                        tp_size=kinds[url].tp_size,
                        weight_version=self.weight_version,
                    ),
                )

    def close(self) -> None:
        if self.shm is not None:
            self.shm.close()
        # SGLang's copies go with the last reference (each server drops its own): shared
        # memory files then, and for CUDA IPC the GPU blocks (torch frees a block a consumer
        # still maps once that consumer lets it go).


class _TensorBuckets:
    """Makes a bucket ready for the ways some engine needs (on the producer thread)."""

    def __init__(
        self,
        by_way: Mapping[str, list[str]],
        weight_version: str,
        delta: DeltaState | None = None,
        deltas: bool = False,
    ) -> None:
        self.by_way, self.weight_version = by_way, weight_version
        self.delta, self.deltas = delta, deltas

    def __call__(self, bucket: dict[str, Tensor]) -> _Prepared:
        from megatron_grpo.embedded.weights import shared_bucket, tensor_update
        from megatron_grpo.weight_sync import sglang_tensor

        ready = _Prepared(self.weight_version)
        ready.nbytes = sum(t.numel() * t.element_size() for t in bucket.values())
        if self.delta is not None:
            encoded, no_base = self.delta.encode(bucket, self.weight_version, deltas=self.deltas)
            if encoded is not None:
                ready.delta = (encoded, no_base)
        if self.by_way["shm"]:
            ready.shm = shared_bucket(bucket)
        if self.by_way["body"]:
            ready.body = tensor_update(bucket, weight_version=self.weight_version)
        if self.by_way["sglang"]:
            ready.sglang = sglang_tensor.shared_copies(bucket)
        if self.by_way["sglang_cuda"]:
            ready.sglang_cuda = sglang_tensor.cuda_copies(bucket)
        return ready
