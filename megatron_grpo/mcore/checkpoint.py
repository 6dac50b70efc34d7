"""megatron-core distributed checkpoints: save at one layout, load at any other.

Saves are atomic: every rank writes into ``<dir>.partial``; once all ranks
are done, rank 0 renames it to ``<dir>``. A crash mid-save leaves only a
``.partial`` folder behind and the previous checkpoint untouched. A rank with under
``IN_PROCESS_BYTES`` to write writes it itself (``compat.writes_in_process``), without
megatron-core's helper processes.
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_grpo.mcore.compat import writes_in_process
from megatron_grpo.mcore.parallel import ParallelContext
from megatron_grpo.mcore.wrappers import unwrap

IN_PROCESS_BYTES = 1 << 30
"""A rank writes its checkpoint files itself below this many bytes of tensors."""


def local_bytes(state: Any) -> int:
    """Bytes of the tensors a sharded state dict holds on this rank."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    total = 0
    for value in nested_values(state):
        data = getattr(value, "data", value)
        if isinstance(data, torch.Tensor):
            total += data.numel() * data.element_size()
    return total


def _model_keys(model: list) -> list[str]:
    """The state-dict entry of each chunk: ``model``, or ``model0``, ``model1``, ... with VPP."""
    return ["model"] if len(model) == 1 else [f"model{i}" for i in range(len(model))]


def model_sharded_state_dict(model: list) -> dict[str, Any]:
    """The model's sharded state dict; one entry per virtual pipeline chunk."""
    return {key: unwrap(c).sharded_state_dict() for key, c in zip(_model_keys(model), model)}


def load_model_state(model: list, loaded: dict[str, Any]) -> None:
    """Copy the chunks' entries of a loaded state dict into the model."""
    for key, chunk in zip(_model_keys(model), model):
        unwrap(chunk).load_state_dict(loaded[key])


@contextlib.contextmanager
def atomic_dir(path: str | Path, ctx: ParallelContext) -> Iterator[Path]:
    """A folder every rank writes and that appears whole: the block writes
    ``<path>.partial`` (all a crash can leave), which is renamed to ``path`` once every
    rank is done. Collective."""
    final = Path(path)
    partial = final.with_name(final.name + ".partial")
    if ctx.is_main:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    dist.barrier()
    yield partial
    dist.barrier()
    if ctx.is_main:
        if final.exists():
            shutil.rmtree(final)
        partial.rename(final)
    dist.barrier()


def save(state: dict[str, Any], path: str | Path, ctx: ParallelContext) -> Path:
    """Save a sharded state dict (model, optimizer, ...) atomically to ``path``."""
    from megatron.core import dist_checkpointing

    small = local_bytes(state) < IN_PROCESS_BYTES
    with atomic_dir(path, ctx) as partial:
        with writes_in_process() if small else contextlib.nullcontext():
            dist_checkpointing.save(state, str(partial))
    return Path(path)


def load(state: dict[str, Any], path: str | Path) -> dict[str, Any]:
    """Load ``path`` into the shapes and shards described by ``state``."""
    from megatron.core import dist_checkpointing

    if not Path(path, "metadata.json").exists():
        raise FileNotFoundError(f"{path} is not a distributed checkpoint (no metadata.json)")
    return dist_checkpointing.load(state, str(path))


def save_model(model: list, path: str | Path, ctx: ParallelContext) -> Path:
    return save(model_sharded_state_dict(model), path, ctx)


def load_model(model: list, path: str | Path) -> None:
    load_model_state(model, load(model_sharded_state_dict(model), path))
