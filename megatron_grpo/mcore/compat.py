"""Every patch of megatron-core's internals, and the start-up check that they are still there.

The rest of the package uses megatron-core through its public API (builders, the schedule,
DDP, the optimizer, ``dist_checkpointing``). What that API does not offer is done here, each
piece with a comment saying what it replaces and why, and each attribute it touches declared
in ``MEGATRON_CORE`` (``internals.Target``):

- on CPU only (``install``): the RNG tracker's CUDA state functions, the recomputation
  backward, the MoE dispatcher's host copy and Transformer Engine's router GEMM;
- everywhere: small checkpoints written without helper processes (``writes_in_process``),
  gradients finalized without megatron-core's token-count division (``FinalizeGrads``), a
  forced parameter gather that leaves the next one due (``force_param_sync``), the routers'
  forward output (``hook_routers``) and the aux-loss autoscaler, and the distributed
  optimizer's state allocation and Adam step counts around a checkpoint load.

``install`` runs first in every process that builds a model (``parallel.init_parallel``):
it checks torch's and megatron-core's releases against the tested ones (``internals.check``;
an upgrade that moved a target fails there, naming it) and installs the CPU patches.
"""

from __future__ import annotations

import contextlib
import queue
from collections.abc import Callable, Iterator
from typing import Any

import torch

from megatron_grpo.internals import Library, Target, check
from megatron_grpo.mcore import device

_RANDOM = "megatron.core.tensor_parallel.random"
_FS_ASYNC = "megatron.core.dist_checkpointing.strategies.filesystem_async"
_ROUTER = "megatron.core.transformer.moe.router"

MEGATRON_CORE = Library(
    distribution="megatron-core",
    tested="0.16.1",
    compat_module="megatron_grpo/mcore/compat.py",
    targets=(
        Target(_RANDOM, "_get_cuda_rng_state", "replaced on CPU: the CPU generator's state"),
        Target(
            _RANDOM,
            "_set_cuda_rng_state",
            "replaced on CPU: sets the CPU generator's state",
            params=("new_state",),
        ),
        Target(
            _RANDOM,
            "CheckpointFunction.backward",
            "wrapped on CPU: the recomputed forward runs inside the device layer's mode",
            params=("ctx",),
        ),
        Target(
            _RANDOM,
            "CheckpointWithoutOutputFunction.backward",
            "wrapped on CPU: the recomputed forward runs inside the device layer's mode",
            params=("ctx",),
        ),
        Target(
            "megatron.core.transformer.moe.token_dispatcher",
            "maybe_move_tensor_to_cpu",
            "replaced on CPU: split sizes as numpy, which gloo's all_to_all_single takes",
            params=("tensor", "as_numpy", "record_stream"),
        ),
        Target(
            "megatron.core.transformer.moe.moe_utils",
            "te_general_gemm",
            "set to None on CPU when Transformer Engine is absent: the router gate reads it",
            kind="global",
        ),
        Target(
            _FS_ASYNC,
            "_get_write_results_queue",
            "replaced during small saves: a plain queue, not a spawned Manager's",
        ),
        Target(
            _FS_ASYNC,
            "FileSystemWriterAsync.write_preloaded_data_multiproc",
            "replaced during small saves: the files written in this process, not forked ones",
            params=("transform_list", "use_msc", "rank", "write_buckets", "global_results_queue"),
        ),
        Target(
            _FS_ASYNC,
            "FileSystemWriterAsync.write_preloaded_data",
            "called by keyword during small saves, once per file",
            params=(
                "transform_list",
                "local_proc_idx",
                "write_bucket",
                "results_queue",
                "count_queue",
                "use_fsync",
            ),
        ),
        Target(
            "megatron.core.distributed",
            "finalize_model_grads",
            "called by FinalizeGrads without the token count",
            params=("model", "num_tokens", "pg_collection", "force_all_reduce"),
        ),
        Target(
            "megatron.core.model_parallel_config",
            "ModelParallelConfig.finalize_model_grads_func",
            "set to FinalizeGrads; the schedules call it as finalize_model_grads",
        ),
        Target(
            "megatron.core.distributed",
            "DistributedDataParallel.start_param_sync",
            "called by force_param_sync",
            params=("force_sync",),
        ),
        Target(
            "megatron.core.distributed",
            "DistributedDataParallel.bucket_groups",
            "read by force_param_sync",
            kind="instance",
        ),
        Target(
            "megatron.core.distributed.param_and_grad_buffer",
            "_ParamAndGradBucketGroup.param_gather_dispatched",
            "reset by force_param_sync: the next forward gathers again",
            kind="instance",
        ),
        Target(
            _ROUTER,
            "TopKRouter.forward",
            "hooked by hook_routers: called with the hidden states, returns (probs, routing_map)",
            params=("input",),
        ),
        Target(_ROUTER, "TopKRouter.gating", "called by router_logits", params=("input",)),
        Target(
            _ROUTER,
            "TopKRouter.router_replay",
            "set by set_router_replay: routing replay's top-k (mcore.routing_replay)",
            kind="instance",
        ),
        Target(
            "megatron.core.transformer.moe.moe_utils",
            "topk_routing_with_score_function",
            "calls router_replay.get_replay_topk(scores, topk, num_groups, group_topk, "
            "default_compute_topk) for the top-k when the router has one",
            params=("router_replay", "fused"),
        ),
        Target(
            "megatron.core.transformer.moe.router_replay",
            "RouterReplay.get_replay_topk",
            "the interface mcore.routing_replay.LayerReplay implements",
            params=("scores", "topk", "num_groups", "group_topk", "default_compute_topk"),
        ),
        Target(_ROUTER, "TopKRouter.layer_number", "read by router_layer", kind="instance"),
        Target(
            _ROUTER,
            "MoEAuxLossAutoScaler.forward",
            "applied by attach_aux_loss: the balance loss's gradient in the backward pass",
            params=("output", "aux_loss"),
        ),
        Target(
            "megatron.core.optimizer.distrib_optimizer",
            "DistributedOptimizer._init_optimizer_states_with_dummy_values",
            "called by allocate_optimizer_state before a load",
        ),
        Target(
            "megatron.core.optimizer.optimizer",
            "ChainedOptimizer.chained_optimizers",
            "read by allocate_optimizer_state and restore_adam_steps",
            kind="instance",
        ),
        Target(
            "megatron.core.optimizer.optimizer",
            "MegatronOptimizer.optimizer",
            "read by allocate_optimizer_state and restore_adam_steps: the torch optimizer",
            kind="instance",
        ),
    ),
)
"""megatron-core's internals that this module patches, wraps, calls or reads."""

_cpu_installed = False


def install() -> None:
    """Check torch and megatron-core against the tested releases; on a machine without CUDA,
    install the device layer (``device.install``) and megatron-core's CPU patches.
    Idempotent; on a GPU only the check runs."""
    global _cpu_installed
    check(device.TORCH)
    check(MEGATRON_CORE)
    if _cpu_installed or device.cuda_available():
        return
    device.install()
    _install_cpu_patches()
    _cpu_installed = True


def _install_cpu_patches() -> None:
    from megatron.core.tensor_parallel import random as mcore_random
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    # The model-parallel RNG tracker reads and sets the CUDA generator through these private
    # functions (not torch.cuda's), with CUDA-only arguments: the CPU generator stands in.
    mcore_random._get_cuda_rng_state = device.cpu_rng_state
    mcore_random._set_cuda_rng_state = device.set_cpu_rng_state
    # Activation recomputation reruns the forward inside autograd's backward, which torch
    # runs outside the function mode: the recomputed forward needs the mode too.
    for fn in (mcore_random.CheckpointFunction, mcore_random.CheckpointWithoutOutputFunction):
        fn.backward = staticmethod(device.in_cpu_mode(fn.backward))  # type: ignore[method-assign]
    # The alltoall dispatcher turns its split sizes into the numpy arrays all_to_all_single
    # takes only for GPU tensors; gloo refuses CPU tensors there.
    token_dispatcher.maybe_move_tensor_to_cpu = _host_split_sizes  # type: ignore[attr-defined]
    # The router gate reads Transformer Engine's GEMM, imported only when TE is: None makes
    # it take its torch path.
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None  # type: ignore[attr-defined]


def _host_split_sizes(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
    """megatron-core's ``maybe_move_tensor_to_cpu`` for tensors already on the host: the
    numpy array that ``all_to_all_single`` takes as split sizes, as the GPU path gives."""
    if as_numpy and torch.is_tensor(tensor):
        return tensor.numpy()
    return tensor


# --------------------------------------------------------------------------- checkpoint writes


@contextlib.contextmanager
def writes_in_process() -> Iterator[None]:
    """While active, megatron-core's ``torch_dist`` saves write from this process.

    Its save strategy (the only one for sharded saves in 0.16.1, ``TorchDistSaveShardedStrategy``)
    always writes through ``FileSystemWriterAsync``: each rank's files from forked processes
    (one per file), their results collected through a queue served by a ``spawn``-ed
    ``multiprocessing`` Manager, which then lives as long as the trainer (a second Python
    process per rank, ~270 MB, for checkpoints of a few MB), even when the save is
    synchronous. No option of the strategy or of ``dist_checkpointing.save`` avoids either:
    the Manager is started while the plan is made, before the writing function could be
    chosen. So, for the duration, the Manager's queue is replaced by a plain one and the
    forking writer by ``_write_buckets``; the files and metadata are the same.
    """
    from megatron.core.dist_checkpointing.strategies import filesystem_async as fsa

    writer = fsa.FileSystemWriterAsync
    saved = fsa._get_write_results_queue, writer.__dict__["write_preloaded_data_multiproc"]
    fsa._get_write_results_queue = queue.Queue  # type: ignore[assignment]
    writer.write_preloaded_data_multiproc = staticmethod(_write_buckets)  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        fsa._get_write_results_queue = saved[0]
        writer.write_preloaded_data_multiproc = saved[1]  # type: ignore[method-assign]


def _write_buckets(
    transform_list: list, use_msc: bool, rank: int, write_buckets: list, global_results_queue: Any
) -> None:
    """``write_preloaded_data_multiproc`` without the processes: each bucket's file in turn;
    the results (or the first error) into ``global_results_queue``, as megatron-core reads
    them back (``retrieve_write_results``)."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import (
        FileSystemWriterAsync,
    )

    done: dict[int, Any] = {}
    local: queue.Queue = queue.Queue()
    count: queue.Queue = queue.Queue()
    extra = {"use_msc": True} if use_msc else {}
    for index, bucket in enumerate(write_buckets):
        count.put(index)
        FileSystemWriterAsync.write_preloaded_data(
            transform_list=transform_list,
            local_proc_idx=index,
            write_bucket=bucket,
            results_queue=local,
            count_queue=count,
            use_fsync=True,
            **extra,
        )
        _, written = local.get()
        if isinstance(written, Exception):
            global_results_queue.put(written)
            return
        done[index] = written
    global_results_queue.put(done)


# --------------------------------------------------------------------------- gradients


def finalize_grads(model, num_tokens=None, pg_collection=None, force_all_reduce=False, *, pg):
    """megatron-core's ``finalize_model_grads`` without its division by the token count.

    The schedule passes the summed per-micro-batch token counts when
    ``calculate_per_token_loss`` is set; our loss is already scaled by the
    global denominator, so that count is not applied (see ``algo.loss``).
    """
    from megatron.core.distributed import finalize_model_grads

    finalize_model_grads(
        model, num_tokens=None, pg_collection=pg, force_all_reduce=force_all_reduce
    )


class FinalizeGrads:
    """``finalize_grads`` bound to the layout's process groups: the model config's
    ``finalize_model_grads_func``, which the schedules call as they would megatron-core's
    ``finalize_model_grads``: ``(model, num_tokens, pg_collection=, force_all_reduce=)``.

    Not a ``functools.partial``: megatron-core deep-copies the TransformerConfig that holds
    it (SequentialMLP does, for experts narrower than the dense MLP) and process groups
    cannot be copied; a copy of this is this same object.
    """

    def __init__(self, pg) -> None:
        self.pg = pg

    def __call__(self, model, num_tokens=None, pg_collection=None, force_all_reduce=False):
        finalize_grads(model, num_tokens, pg_collection, force_all_reduce, pg=self.pg)

    def __deepcopy__(self, memo) -> FinalizeGrads:
        return self


def force_param_sync(chunk) -> None:
    """Gather a DDP chunk's parameters now (distributed optimizer, overlapped gather).

    megatron-core's forced gather marks this iteration's gather as dispatched; its flag is
    reset so that the next forward still gathers whatever a later optimizer step writes
    (megatron-core resets it only when a gradient sync finishes).
    """
    chunk.start_param_sync(force_sync=True)
    for group in chunk.bucket_groups:
        group.param_gather_dispatched = False


# --------------------------------------------------------------------------- MoE routers


def hook_routers(
    model: list, on_route: Callable[[Any, torch.Tensor, torch.Tensor, torch.Tensor], Any]
) -> None:
    """After every ``TopKRouter`` forward of ``model``, ``on_route(router, hidden, probs,
    routing_map)``; a tensor it returns replaces the router's ``probs``."""
    from megatron.core.transformer.moe.router import TopKRouter

    def hook(router, args, output):
        probs, routing_map = output
        new_probs = on_route(router, args[0], probs, routing_map)
        return None if new_probs is None else (new_probs, routing_map)

    for chunk in model:
        for module in chunk.modules():
            if isinstance(module, TopKRouter):
                module.register_forward_hook(hook)


def set_router_replay(model: list, make: Callable[[int], Any]) -> None:
    """Give every ``TopKRouter`` of ``model`` the ``router_replay`` ``make(layer number)``:
    megatron-core's routing then takes its top-k from it (unfused routing only)."""
    from megatron.core.transformer.moe.router import TopKRouter

    for chunk in model:
        for module in chunk.modules():
            if isinstance(module, TopKRouter):
                if module.config.moe_router_fusion:
                    raise ValueError("routing replay needs unfused routing (moe_router_fusion)")
                module.router_replay = make(module.layer_number)


def router_logits(router, hidden: torch.Tensor) -> torch.Tensor:
    """The router's gate logits for ``hidden`` (what its forward routes from)."""
    return router.gating(hidden)


def router_layer(router) -> int:
    """The 1-based number of the layer ``router`` belongs to."""
    return router.layer_number


def attach_aux_loss(probs: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
    """``probs`` unchanged, carrying ``loss``: its gradient (scaled by megatron-core's aux-loss
    scale, which the schedule sets) enters the backward pass through them."""
    from megatron.core.transformer.moe.router import MoEAuxLossAutoScaler

    return MoEAuxLossAutoScaler.apply(probs, loss)


# --------------------------------------------------------------------------- optimizer state


def inner_optimizers(optimizer) -> list:
    """The megatron-core optimizers a (chained) optimizer is made of."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def allocate_optimizer_state(optimizer) -> None:
    """Give a fresh distributed optimizer its (Adam) state tensors, which a load then fills.

    Its sharded state dict reads the state it is loaded into, and before a first step there
    is none: megatron-core's own initializer does a zero-gradient step on the fp32 master
    shards; weights and master copies come from the checkpoint afterwards.
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for inner in inner_optimizers(optimizer):
        if isinstance(inner, DistributedOptimizer) and not inner.optimizer.state:
            inner._init_optimizer_states_with_dummy_values()


def restore_adam_steps(optimizer) -> None:
    """Give every parameter its own Adam step count, the one saved.

    Without Apex or Transformer Engine (on CPU), megatron-core's distributed optimizer
    loads the saved step into its param groups and one shared step tensor into the state
    of every parameter, and then overwrites that tensor with the step of the state it was
    loaded into (the zero-gradient step that allocated it). torch's Adam would go on from
    there, adding 1 to the shared tensor once per parameter, and every later bias
    correction would be off. With Apex or Transformer Engine the step lives in the param
    groups alone and this does nothing.
    """
    for inner in inner_optimizers(optimizer):
        torch_optimizer = getattr(inner, "optimizer", None)
        for group in getattr(torch_optimizer, "param_groups", []):
            if "step" not in group:
                continue
            for param in group["params"]:
                state = torch_optimizer.state.get(param, {})  # type: ignore[union-attr]
                if isinstance(state.get("step"), torch.Tensor):
                    state["step"] = torch.tensor(float(group["step"]), dtype=state["step"].dtype)
