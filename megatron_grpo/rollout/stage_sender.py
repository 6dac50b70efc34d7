"""One pipeline stage's sender: streams its HF-named weights to every rollout engine.

The main rank opens a push (pause -> flush -> begin, ``RolloutRuntime.begin_push``) and
hands every stage's sender a ``SyncPlan``; each sender then streams its own stage, a
bucket of at most ``plan.bucket_bytes`` at a time, while the next bucket is being
gathered, and answers with a ``StageReport``; the main rank closes the push
(``finish_push``). Per method:
- ``tensor``: one ``/update_weights_from_tensor`` request per bucket and engine (the
  embedded server's safetensors body, or SGLang's handles, whichever the engine's
  ``/server_info`` says it is: CUDA IPC handles to copies on this GPU for SGLang on a GPU,
  shared-memory ones otherwise);
- ``disk``: one safetensors file per bucket in ``plan.disk_dir``; the main rank adds the
  index and config and calls ``/update_weights_from_disk`` once every stage has written;
- ``distributed``: the sender is rank 0 of its own broadcast group with the engines
  (one group per stage, kept open across pushes); each bucket is announced to
  ``/update_weights_from_distributed`` and broadcast.

Peak extra memory of a sender during a push: the full tensors of two units (a decoder
layer, or the embedding or head: the one being gathered, ``mcore.hf_export``, and the one
whose bucket is in flight) plus two buckets (the copy being made ready and the one in
flight; a bucket holds at least one tensor, so it may be the largest tensor); buckets being
filled hold views. ``distributed`` sends from the tensors themselves. The dry run prints
the figure (``commands.memory_model.weight_push_bytes``).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import uuid
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor

from megatron_grpo.rollout.server_kinds import ServerKind, server_kinds

SyncMethod = Literal["tensor", "disk", "distributed"]

CHECK_ROWS = 4
"""Leading rows of each weight compared by ``rollout.sync.check``."""
_READ = (
    "SGLang 0.5.23 reads weights back (/get_weights_by_name) for llama-family models "
    "only; for others turn rollout.sync.check off"
)
_END = object()


@dataclass(frozen=True)
class SyncPlan:
    """What every stage's sender needs for one push; made by the main rank."""

    urls: tuple[str, ...]
    method: SyncMethod
    weight_version: str
    bucket_bytes: int
    disk_dir: str | None = None
    main_host: str = ""
    """The main rank's host name."""
    master_address: str = "127.0.0.1"
    """``distributed``: the address engines reach senders on the main rank's host at."""
    check: bool = False


@dataclass
class StageReport:
    """What a stage's sender did, for the main rank."""

    stage: int
    error: str | None = None
    rollout_error: bool = False
    """The error came from an engine (it may have died), not from the learner."""
    files: dict[str, list[str]] = field(default_factory=dict)
    """``disk``: file name -> the weights it holds."""
    nbytes: int = 0


class ProducerError(RuntimeError):
    """Gathering or converting the stage's weights failed (not the engines)."""


def buckets(
    named: Mapping[str, Tensor] | Iterable[tuple[str, Tensor]], max_bytes: int
) -> Iterator[dict[str, Tensor]]:
    """Consecutive groups of tensors of at most ``max_bytes`` each (a bigger tensor goes alone)."""
    pairs = named.items() if isinstance(named, Mapping) else named
    bucket: dict[str, Tensor] = {}
    size = 0
    for name, t in pairs:
        nbytes = t.numel() * t.element_size()
        if bucket and size + nbytes > max_bytes:
            yield bucket
            bucket, size = {}, 0
        bucket[name] = t
        size += nbytes
    if bucket:
        yield bucket


async def pipelined(items: Iterator[Any], deliver: Callable[[Any], Awaitable[None]]) -> None:
    """``deliver`` each item in order, producing the next one (on a worker thread) while the
    previous one is being delivered."""
    pending: asyncio.Future[None] | None = None
    try:
        while True:
            item = await asyncio.to_thread(next, items, _END)
            if pending is not None:
                try:
                    await pending
                except BaseException:
                    _discard(item)
                    raise
                pending = None
            if item is _END:
                return
            pending = asyncio.ensure_future(deliver(item))
    finally:
        if pending is not None and not pending.done():
            pending.cancel()
            with contextlib.suppress(BaseException):
                await pending


def _discard(item: Any) -> None:
    """Free what an item that will not be delivered holds (shared memory)."""
    close = getattr(item, "close", None)
    if close is not None:
        close()


def drain(items: Iterator[Any]) -> None:
    """Run a producer to its end (its TP peers wait in its gathers)."""
    for _ in items:
        pass


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
        self._samples: dict[str, Tensor] = {}

    # ---- one push ----

    def send(self, layers: Iterator[Mapping[str, Tensor]], plan: SyncPlan) -> StageReport:
        """Stream ``layers`` (HF-named tensors) to the engines of ``plan``; never raises for
        an engine's failure (the report says it), and always runs ``layers`` to its end."""
        from megatron_grpo.sglang_api.errors import RolloutError

        report = StageReport(stage=self.stage)
        self._samples = {}
        named = self._named(layers, plan, report)
        try:
            self.loop.run_until_complete(self._send(named, plan, report))
        except ProducerError:
            raise
        except Exception as err:  # noqa: BLE001 - reported to the main rank, which decides
            report.error = f"stage {self.stage}: {type(err).__name__}: {err}"
            report.rollout_error = isinstance(err, RolloutError)
            drain(named)
        return report

    def _named(
        self, layers: Iterator[Mapping[str, Tensor]], plan: SyncPlan, report: StageReport
    ) -> Iterator[tuple[str, Tensor]]:
        try:
            for layer in layers:
                for name, tensor in layer.items():
                    report.nbytes += tensor.numel() * tensor.element_size()
                    if plan.check:
                        self._samples[name] = tensor.detach()[:CHECK_ROWS].float().cpu().clone()
                    yield name, tensor
        except Exception as err:
            raise ProducerError(f"stage {self.stage}: gathering the weights failed: {err}") from err

    async def _send(
        self, named: Iterator[tuple[str, Tensor]], plan: SyncPlan, report: StageReport
    ) -> None:
        client = await self._client(plan.urls)
        if plan.method == "tensor":
            prepare, deliver = await self._tensor_method(client, plan)
        elif plan.method == "disk":
            prepare, deliver = self._disk_method(plan, report)
        elif plan.method == "distributed":
            prepare, deliver = await self._distributed_method(client, plan)
        else:
            raise ValueError(f"unknown weight sync method {plan.method!r}")
        await pipelined((prepare(b) for b in buckets(named, plan.bucket_bytes)), deliver)

    async def _tensor_method(self, client: Any, plan: SyncPlan) -> tuple[Callable, Callable]:
        """Per engine, the fastest request it takes: an embedded server on this host, the
        bucket in shared memory; elsewhere, a safetensors body; SGLang, its CUDA IPC handles
        (on a GPU) or shared-memory handles (one pickle per TP rank)."""
        kinds = await server_kinds(client)
        by_way: dict[str, list[str]] = {"shm": [], "body": [], "sglang": [], "sglang_cuda": []}
        for url in plan.urls:
            by_way[kinds[url].tensor_way()].append(url)
        bucket_maker = _TensorBuckets(by_way, plan.weight_version)

        async def deliver(prepared: _Prepared) -> None:
            try:
                await asyncio.gather(
                    *(
                        client.update_weights_from_tensor(payload, url=url)
                        for url, payload in prepared.payloads(by_way, kinds)
                    )
                )
            finally:
                prepared.close()

        return bucket_maker, deliver

    def _disk_method(self, plan: SyncPlan, report: StageReport) -> tuple[Callable, Callable]:
        from megatron_grpo.embedded.weights import serialize_named_tensors

        assert plan.disk_dir is not None
        directory = Path(plan.disk_dir)
        count = iter(range(1 << 30))

        def prepare(bucket: dict[str, Tensor]) -> tuple[str, list[str]]:
            name = f"model-stage{self.stage:03d}-{next(count):05d}.safetensors"
            (directory / name).write_bytes(serialize_named_tensors(bucket))
            return name, list(bucket)

        async def deliver(written: tuple[str, list[str]]) -> None:
            report.files[written[0]] = written[1]

        return prepare, deliver

    async def _distributed_method(self, client: Any, plan: SyncPlan) -> tuple[Callable, Callable]:
        from megatron_grpo.sglang_api.update_group import dtype_name

        group = await self._group(client, plan)

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
        from megatron_grpo.rollout.weight_sync import close_update_group, open_update_group

        if self.group is not None and (self.group.broken or self._group_urls != plan.urls):
            with contextlib.suppress(Exception):  # engines that died cannot leave it
                await close_update_group(client, self.group)
            self.group = None
        if self.group is None:
            same_host = socket.gethostname() == plan.main_host
            self.group = await open_update_group(
                client,
                master_address=plan.master_address if same_host else _host_address(),
                backend=self.backend,
                timeout_s=client.config.weight_update_timeout_s,
                name=f"mgrpo_weights_stage{self.stage}_{uuid.uuid4().hex[:8]}",
            )
            self._group_urls = plan.urls
        return self.group

    # ---- after a push ----

    def check(self, plan: SyncPlan) -> list[str]:
        """The weights this stage sent that some engine holds differently (first rows)."""
        return self.loop.run_until_complete(self._check(plan))

    async def _check(self, plan: SyncPlan) -> list[str]:
        from megatron_grpo.sglang_api.errors import RolloutHTTPError

        client = await self._client(plan.urls)
        problems = []
        for url in plan.urls:
            for name, ours in self._samples.items():
                try:
                    got = await client.get_weights_by_name(name, truncate_size=CHECK_ROWS, url=url)
                except RolloutHTTPError as err:
                    problems.append(f"{url}: {name}: the engine did not return it ({err}); {_READ}")
                    break  # the engine reads no weight of this model back
                if problem := compare_sample(name, ours, torch.tensor(got, dtype=torch.float32)):
                    problems.append(f"{url}: {problem}")
        return problems

    def close(self) -> None:
        async def close() -> None:
            from megatron_grpo.rollout.weight_sync import close_update_group

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


@dataclass
class _Prepared:
    """A bucket made ready for every way it is sent; ``close()`` frees shared memory."""

    weight_version: str
    shm: Any = None
    body: Any = None
    sglang: Any = None
    sglang_cuda: Any = None

    def payloads(
        self, by_way: Mapping[str, list[str]], kinds: Mapping[str, ServerKind]
    ) -> Iterator[tuple[str, Any]]:
        from megatron_grpo.sglang_api import update_group as sglang_weights

        for url in by_way["shm"]:
            yield url, self.shm.request(weight_version=self.weight_version)
        for url in by_way["body"]:
            yield url, self.body
        for way in ("sglang", "sglang_cuda"):
            for url in by_way[way]:
                yield (
                    url,
                    sglang_weights.sglang_tensor_payload(
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

    def __init__(self, by_way: Mapping[str, list[str]], weight_version: str) -> None:
        self.by_way, self.weight_version = by_way, weight_version

    def __call__(self, bucket: dict[str, Tensor]) -> _Prepared:
        from megatron_grpo.embedded.weights import shared_bucket, tensor_update
        from megatron_grpo.sglang_api import update_group as sglang_weights

        ready = _Prepared(self.weight_version)
        if self.by_way["shm"]:
            ready.shm = shared_bucket(bucket)
        if self.by_way["body"]:
            ready.body = tensor_update(bucket, weight_version=self.weight_version)
        if self.by_way["sglang"]:
            ready.sglang = sglang_weights.shared_copies(bucket)
        if self.by_way["sglang_cuda"]:
            ready.sglang_cuda = sglang_weights.cuda_copies(bucket)
        return ready


def _host_address() -> str:
    """This host's address, for engines to reach a sender away from the main rank's host."""
    return socket.gethostbyname(socket.gethostname())


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
