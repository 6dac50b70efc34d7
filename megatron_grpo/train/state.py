"""Training checkpoints: model, optimizer, LR schedule, data cursor, RNG and step.

One megatron distributed checkpoint per saved step, under
``<output_dir>/checkpoints/step_<N>``, written atomically (see
``checkpoint.save``), then ``latest`` is rewritten atomically to name it.
A crash mid-save leaves ``latest`` on the previous, complete checkpoint.
Only the newest ``keep_last`` checkpoints are kept. Loading works at any
layout: the distributed checkpoint reshards on load.
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path
from typing import Any

import torch

from megatron_grpo.mcore import checkpoint, compat
from megatron_grpo.mcore.model import sync_params
from megatron_grpo.mcore.parallel import ParallelContext
from megatron_grpo.train.save_hf import hf_root


def checkpoints_dir(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def remove_partial_saves(output_dir: str | Path) -> list[Path]:
    """Delete the ``.partial`` folders that saves cut short left behind (checkpoints and
    Hugging Face models, ``save_hf``); the ones removed.

    Only for the run that holds the output directory (see ``run_lock``): no other process
    can be writing them.
    """
    partial = sorted(checkpoints_dir(output_dir).glob("*.partial"))
    partial += sorted(hf_root(output_dir).glob("*.partial"))
    for path in partial:
        shutil.rmtree(path, ignore_errors=True)
    return partial


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The checkpoint ``latest`` points at, or None when there is none."""
    pointer = checkpoints_dir(output_dir) / "latest"
    if not pointer.exists():
        return None
    path = checkpoints_dir(output_dir) / pointer.read_text().strip()
    if not (path / "metadata.json").exists():
        raise FileNotFoundError(f"{pointer} names {path.name}, which is not a complete checkpoint")
    return path


def _sharded_state(
    model: list, optimizer, ctx: ParallelContext, *, is_loading: bool, with_rng: bool = True
) -> dict[str, Any]:
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    state = checkpoint.model_sharded_state_dict(model)
    # The distributed optimizer's state is saved in the canonical per-parameter form, so that
    # a checkpoint loads at any layout (as the model's does), not only at its own DP size.
    state["optimizer"] = optimizer.sharded_state_dict(
        state, is_loading=is_loading, metadata={"distrib_optim_sharding_type": "dp_reshardable"}
    )
    if with_rng:  # one RNG state per rank: ranks draw different streams
        rng = {"torch": torch.get_rng_state(), "python": random.getstate()}
        state["rng"] = ShardedObject("rng_state", rng, (ctx.world_size,), (ctx.rank,), replica_id=0)
    return state


def save(
    output_dir: str | Path,
    step: int,
    *,
    model: list,
    optimizer,
    scheduler,
    ctx: ParallelContext,
    extra: dict[str, Any],
    keep_last: int,
) -> Path:
    """Save everything needed to resume after ``step``; prune old checkpoints."""
    sync_params(model)  # the saved model weights are the updated ones
    state = _sharded_state(model, optimizer, ctx, is_loading=False)
    state["scheduler"] = scheduler.state_dict()
    state["step"] = step
    state["world_size"] = ctx.world_size
    state["extra"] = extra
    root = checkpoints_dir(output_dir)
    path = checkpoint.save(state, root / f"step_{step:08d}", ctx)
    if ctx.is_main:
        tmp = root / "latest.tmp"
        tmp.write_text(path.name)
        os.replace(tmp, root / "latest")
        saved = sorted(p for p in root.glob("step_*") if not p.name.endswith(".partial"))
        for old in saved[:-keep_last] if keep_last > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    torch.distributed.barrier()
    return path


def load(
    path: str | Path, *, model: list, optimizer, scheduler, ctx: ParallelContext
) -> tuple[int, dict[str, Any]]:
    """Restore model, optimizer, scheduler and RNG from ``path``; return (step, extra).

    The per-rank RNG states come back only at the world size they were saved
    at; at another layout every rank keeps its own seeded state.
    """
    from megatron.core.dist_checkpointing import load_common_state_dict

    same_world = load_common_state_dict(str(path)).get("world_size") == ctx.world_size
    compat.allocate_optimizer_state(optimizer)
    # Entries that are not sharded (scheduler, step, extra) come back from the
    # checkpoint's common part on their own.
    state = _sharded_state(model, optimizer, ctx, is_loading=True, with_rng=same_world)
    loaded = checkpoint.load(state, path)
    checkpoint.load_model_state(model, loaded)
    with torch.no_grad():  # megatron-core copies into its fp32 master weights in place
        optimizer.load_state_dict(loaded["optimizer"])
    compat.restore_adam_steps(optimizer)
    scheduler.load_state_dict(loaded["scheduler"])
    if same_world:
        torch.set_rng_state(loaded["rng"]["torch"])
        random.setstate(loaded["rng"]["python"])
    return int(loaded["step"]), loaded["extra"]
