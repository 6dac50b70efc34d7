"""The learner's memory on the host while colocated engines generate (``rollout.colocate``).

Three parts can leave the device, each freed in place so that every view of it (the model's
parameters, DDP's buckets, the optimizer's references) stays valid and needs no rebinding:

- ``"optimizer"``: the optimizer's own tensors, those that are not the model's parameters:
  the Adam moments (``exp_avg``, ``exp_avg_sq``) and, for bf16 parameters, the fp32 master
  copies (the distributed optimizer's per-shard ones included). With fp32 parameters and
  the distributed optimizer the master shards are views of DDP's parameter buffer: they
  go with ``"params"``.
- ``"grads"``: DDP's gradient buffers, by megatron-core's own ``offload_grad_buffers``. They
  are not copied: a step zeroes them before its first backward, so what they hold after an
  optimizer step is never read again, and they come back as zeros.
- ``"params"``: the model's parameter storages (DDP's parameter buffer under the
  distributed optimizer, each parameter's own storage otherwise).

Offload copies each storage, whole and byte for byte, into a host tensor (pinned on CUDA,
allocated once and reused every step; on a CPU allocated at each offload and freed at each
reload, so that the part is never held twice between steps) and frees the device storage
(``untyped_storage().resize_(0)``); reload allocates it again and copies back. A tensor
whose storage is freed must not be read (torch reads freed memory without checking), so
while the parameters are away a forward raises :class:`ParamsOffloaded`, and so does
``require_resident``, which the weight export calls first.

megatron-core's ``MegatronOptimizer.offload_to_cpu`` is not used: it rebinds ``p.data`` and
the state entries to new tensors, which on restore cuts the fp32 master shards of the
distributed optimizer off the parameter buffer they view, and on a CPU it moves nothing.
Nor is the parameter half of its buffer offload: on a CPU its host copy is the buffer
itself, freed with it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from megatron_grpo.mcore.compat import inner_optimizers

PARTS = ("optimizer", "grads", "params")
"""What ``rollout.colocate.offload`` can name, in the order an offload moves them."""

MOMENTS_PER_PARAM = {"adam": 2, "sgd": 0}
"""State tensors of a master parameter's size that each optimizer keeps (SGD without
momentum, as ``mcore.optim`` builds it, keeps none)."""


class ParamsOffloaded(RuntimeError):
    """The learner's parameters were read while they were offloaded to host memory."""


def require_resident(model: list, reading: str) -> None:
    """Raise :class:`ParamsOffloaded` naming ``reading`` if any parameter of ``model`` has
    its storage freed by an offload."""
    for chunk in model:
        for param in chunk.parameters():
            if param.numel() and param.untyped_storage().nbytes() == 0:
                raise ParamsOffloaded(
                    f"{reading} reads the learner's parameters, which are offloaded to host "
                    "memory (rollout.colocate.offload has 'params'): push the weights before "
                    "the parameters are offloaded, and reload the learner before it trains"
                )


class LearnerOffload:
    """Moves ``parts`` of a learner (``model``: its DDP-wrapped chunks; ``optimizer``: the
    megatron-core optimizer built for them) to host memory and back. Each call has finished
    on the device when it returns."""

    def __init__(self, model: list, optimizer, parts: Sequence[str]) -> None:
        unknown = [p for p in parts if p not in PARTS]
        if unknown:
            raise ValueError(f"offload parts are {', '.join(PARTS)}; got {unknown}")
        self.model = model
        self.optimizer = optimizer
        self.parts = tuple(p for p in PARTS if p in parts)
        self._moved: dict[str, list[Tensor]] = {}
        """Per offloaded part, a byte view of each storage it freed."""
        self._host: dict[str, list[Tensor]] = {}
        """Per part, the host copies: kept from one step to the next on CUDA (pinned memory
        is slow to allocate); on a CPU, where the learner's own memory is host memory too,
        freed on reload."""
        self._hooks: list = []
        self._host_bytes = self._count_host_bytes()

    @property
    def offloaded(self) -> tuple[str, ...]:
        return tuple(self._moved)

    def host_bytes(self) -> int:
        """Host memory the configured parts take on this rank once offloaded, counted while
        they are on the device (the Adam moments before the first step creates them too)."""
        return self._host_bytes

    @torch.no_grad()
    def offload(self, parts: Sequence[str]) -> None:
        """Move those of ``parts`` that are configured and still on the device."""
        for part in PARTS:
            if part not in parts or part not in self.parts or part in self._moved:
                continue
            if part == "grads":
                for chunk in self.model:
                    chunk.offload_grad_buffers(synchronize=True, empty_cache=False)
                self._moved[part] = []
                continue
            views = self._param_views() if part == "params" else self._optimizer_views()
            self._moved[part] = self._to_host(part, views)
            if part == "params":
                self._hooks = [c.register_forward_pre_hook(_refuse_forward) for c in self.model]
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the engines allocate outside torch's cache

    @torch.no_grad()
    def reload(self) -> None:
        """Bring back everything offloaded."""
        for part, views in self._moved.items():
            if part == "grads":
                for chunk in self.model:
                    chunk.restore_grad_buffers(synchronize=False)
            for view, host in zip(views, self._host.get(part, [])):
                view.untyped_storage().resize_(view.numel())
                view.copy_(host, non_blocking=view.is_cuda)
            if views and not views[0].is_cuda:
                self._host.pop(part, None)  # on a CPU the copy would hold the part twice
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self._moved = {}
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def _to_host(self, part: str, views: list[Tensor]) -> list[Tensor]:
        host = self._host.get(part, [])
        if [h.numel() for h in host] != [v.numel() for v in views]:
            host = [torch.empty(v.numel(), dtype=torch.uint8, pin_memory=v.is_cuda) for v in views]
            self._host[part] = host
        for view, copy in zip(views, host):
            copy.copy_(view, non_blocking=view.is_cuda)
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the copies are done before their source is freed
        for view in views:
            view.untyped_storage().resize_(0)
        return views

    def _param_views(self) -> list[Tensor]:
        return _unique_storages(p for chunk in self.model for p in chunk.parameters())

    def _optimizer_views(self) -> list[Tensor]:
        """The optimizer's master parameters and per-parameter states, less the storages the
        model's parameters own (the fp32 distributed optimizer's master shards)."""
        params = {v.data_ptr() for v in self._param_views()}
        return [
            v for v in _unique_storages(self._optimizer_tensors()) if v.data_ptr() not in params
        ]

    def _optimizer_tensors(self):
        for inner in inner_optimizers(self.optimizer):
            torch_optimizer = getattr(inner, "optimizer", None)  # None on a stub optimizer
            if torch_optimizer is None:
                continue
            for group in torch_optimizer.param_groups:
                for master in group["params"]:
                    yield master
                    for value in torch_optimizer.state.get(master, {}).values():
                        # The moments; not a scalar step count, which torch keeps on the host.
                        if isinstance(value, Tensor) and value.numel() == master.numel():
                            yield value

    def _count_host_bytes(self) -> int:
        total = 0
        if "params" in self.parts:
            total += sum(v.numel() for v in self._param_views())
        if "optimizer" in self.parts:
            total += sum(v.numel() for v in self._optimizer_views())
            for inner in inner_optimizers(self.optimizer):
                torch_optimizer = getattr(inner, "optimizer", None)
                if torch_optimizer is None:
                    continue
                moments = MOMENTS_PER_PARAM[inner.config.optimizer]
                for group in torch_optimizer.param_groups:
                    for master in group["params"]:
                        if not torch_optimizer.state.get(master):  # before the first step
                            total += moments * master.numel() * master.element_size()
        return total


def _unique_storages(tensors) -> list[Tensor]:
    """A byte view of each distinct, allocated storage behind ``tensors``, in first-seen
    order."""
    seen: dict[int, Tensor] = {}
    for t in tensors:
        storage = t.untyped_storage()
        if storage.nbytes() and storage.data_ptr() not in seen:
            view = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
            seen[storage.data_ptr()] = view
    return list(seen.values())


def _refuse_forward(module, args) -> None:
    require_resident([module], "a forward pass")
