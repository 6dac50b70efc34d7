"""megatron-core distributed checkpoint (any TP/PP layout) -> HF safetensors checkpoint.

No model is built. The checkpoint's metadata gives every tensor's global
shape, which is checked against the model config before any process starts.
Then the reader ranks each request, in turn, one unit (the embedding, one
decoder layer, or the final norm and head) as full TP=1 tensors, and
dist_checkpointing reads just those slices from whatever layout was saved.
Rank 0 gathers the converted units in order and writes each safetensors file
as it fills (``hf_files.ShardedWriter``).

megatron-core cannot load part of a stacked tensor in a single process (it
places the other parts on "another rank", which is then itself), so reading
takes at least two ranks.

Memory: each rank holds one unit; rank 0 also one unit per rank and at most
about one output file (``max_shard_size``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from megatron_grpo.commands.convert.export_source import resolve_source
from megatron_grpo.commands.convert.hf_to_megatron import (
    progress_file,
    relayed_progress,
    under_torchrun,
)
from megatron_grpo.config import ModelConfig, ParallelDims
from megatron_grpo.config.hf import check_family, get_family
from megatron_grpo.convert.experts import split_stacked_experts
from megatron_grpo.convert.hf_config import infer_family
from megatron_grpo.convert.hf_files import (
    ShardedWriter,
    check_config_template,
    check_output_dir,
    write_side_files,
)
from megatron_grpo.convert.layout import resize_vocab
from megatron_grpo.convert.weights import (
    HF_EMBEDDING,
    HF_FINAL_NORM,
    HF_OUTPUT,
    MEGATRON_EMBEDDING,
    MEGATRON_FINAL_NORM,
    MEGATRON_OUTPUT,
    megatron_layer_to_hf,
    megatron_to_hf,
)
from megatron_grpo.mcore.model import DTYPES

_LAYERS = "decoder.layers."
Unit = int | str
"""A decoder layer index, ``"embedding"``, or ``"final"`` (final norm and head)."""


def _tensors_metadata(megatron_dir: str | Path) -> dict[str, Any]:
    """Global shape and dtype of the checkpoint's model tensors, by sharded key."""
    from megatron.core import dist_checkpointing

    if not Path(megatron_dir, "metadata.json").is_file():
        raise FileNotFoundError(f"{megatron_dir} is not a distributed checkpoint")
    model_keys = (_LAYERS, MEGATRON_EMBEDDING, MEGATRON_FINAL_NORM, MEGATRON_OUTPUT)
    metadata = dist_checkpointing.load_tensors_metadata(str(megatron_dir))
    return {k: v for k, v in metadata.items() if k.startswith(model_keys)}


def _units(cfg: ModelConfig) -> list[Unit]:
    """What one rank reads at a time, in HF file order: embedding, layers, norm and head."""
    return ["embedding", *range(cfg.num_layers), "final"]


def _unit_request(
    unit: Unit, metadata: Mapping[str, Any], like: Callable[..., Any]
) -> dict[str, Any]:
    """The full (TP=1) tensors of ``unit``, under per-layer names, as ``like`` makes them.

    ``like(key, shape, dtype, layer)`` returns a tensor (meta, for planning)
    or a ShardedTensor (one layer of a stacked key when ``layer`` is set).
    """
    if isinstance(unit, int):
        return {
            f"{_LAYERS}{unit}.{key[len(_LAYERS) :]}": like(key, md.global_shape, md.dtype, unit)
            for key, md in metadata.items()
            if key.startswith(_LAYERS)
        }
    keys = [MEGATRON_EMBEDDING] if unit == "embedding" else [MEGATRON_FINAL_NORM, MEGATRON_OUTPUT]
    return {
        k: like(k, metadata[k].global_shape, metadata[k].dtype, None) for k in keys if k in metadata
    }


def _unit_to_hf(
    unit: Unit, tensors: Mapping[str, Tensor], cfg: ModelConfig, dtype: torch.dtype | None
) -> dict[str, Tensor]:
    """HF tensors of one unit (vocab padding dropped), cast to ``dtype`` if given."""
    if isinstance(unit, int):
        out = megatron_layer_to_hf(unit, split_stacked_experts(tensors), cfg)
    elif unit == "embedding":
        out = {HF_EMBEDDING: resize_vocab(tensors[MEGATRON_EMBEDDING], cfg.vocab_size)}
    else:
        out = {HF_FINAL_NORM: tensors[MEGATRON_FINAL_NORM]}
        if not cfg.tie_embeddings:
            out[HF_OUTPUT] = resize_vocab(tensors[MEGATRON_OUTPUT], cfg.vocab_size)
    return {k: v.to(dtype or v.dtype) for k, v in out.items()}


def _meta_like(key: str, shape, dtype: torch.dtype, layer: int | None) -> Tensor:
    return torch.empty(shape[1:] if layer is not None else shape, dtype=dtype, device="meta")


def plan_megatron_export(
    megatron_dir: str | Path, cfg: ModelConfig, family: str, dtype: torch.dtype | None = None
) -> list[dict[str, Tensor]]:
    """The HF tensors of each unit, in file order, as meta tensors; ValueError on a mismatch.

    Checks the checkpoint's tensor names and shapes against ``cfg`` from its
    metadata alone (no tensor is read).
    """
    check_family(cfg, get_family(family))
    metadata = _tensors_metadata(megatron_dir)
    layer_counts = {md.global_shape[0] for k, md in metadata.items() if k.startswith(_LAYERS)}
    if layer_counts != {cfg.num_layers}:
        raise ValueError(
            f"the checkpoint's decoder has {sorted(layer_counts)} layers "
            f"but model.num_layers={cfg.num_layers}"
        )
    rows = metadata[MEGATRON_EMBEDDING].global_shape[0] if MEGATRON_EMBEDDING in metadata else 0
    if rows < cfg.vocab_size:
        raise ValueError(
            f"the checkpoint embedding has {rows} rows but model.vocab_size={cfg.vocab_size}"
        )
    if cfg.tie_embeddings and MEGATRON_OUTPUT in metadata:
        raise ValueError(
            f"the checkpoint has its own {MEGATRON_OUTPUT} but model.tie_embeddings=True"
        )
    full: dict[str, Tensor] = {}
    for unit in _units(cfg):
        full |= _unit_request(unit, metadata, _meta_like)
    megatron_to_hf(split_stacked_experts(full), cfg, family)  # every name and shape, on meta
    return [
        _unit_to_hf(unit, _unit_request(unit, metadata, _meta_like), cfg, dtype)
        for unit in _units(cfg)
    ]


def _read_unit(
    megatron_dir: str, metadata: Mapping[str, Any], unit: Unit | None
) -> dict[str, Tensor]:
    """Collective over all ranks: this rank's unit (None: nothing) as full TP=1 tensors."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    def sharded(key: str, shape, dtype: torch.dtype, layer: int | None) -> ShardedTensor:
        if layer is None:
            return ShardedTensor.from_rank_offsets(key, torch.empty(shape, dtype=dtype))
        layer_offset = (0, layer, shape[0])
        data = torch.empty(shape[1:], dtype=dtype)
        return ShardedTensor.from_rank_offsets(key, data, layer_offset, prepend_axis_num=1)

    request = {} if unit is None else _unit_request(unit, metadata, sharded)
    # Each rank asks for a different slice: the union covers nothing in particular.
    loaded = dist_checkpointing.load(request, megatron_dir, validate_access_integrity=False)
    # The load adds the checkpoint's common entries: a training checkpoint's run state
    # (optimizer groups, scheduler, step, 'extra') is not the model's.
    return {key: loaded[key] for key in request}


def export_on_ranks(
    ctx: Any,
    megatron_dir: str | Path,
    out_dir: str | Path,
    cfg: ModelConfig,
    family: str,
    dtype: torch.dtype | None = None,
    max_shard_size: str = "5GB",
    progress: str | None = None,
) -> None:
    """Worker body: ranks read units round-robin; rank 0 receives them in order and writes.

    Tensors travel point to point, into buffers rank 0 allocates from the
    plan (no pickling), over a gloo group (the export runs on the CPU).
    ``progress``: the file rank 0 draws its bar into (see ``relayed_progress``).
    """
    import torch.distributed as dist
    from tqdm import tqdm

    plan = plan_megatron_export(megatron_dir, cfg, family, dtype)
    metadata = _tensors_metadata(megatron_dir)
    group = dist.new_group(backend="gloo")
    units = _units(cfg)
    writer = None
    if ctx.is_main:
        writer = ShardedWriter(out_dir, {k: v for p in plan for k, v in p.items()}, max_shard_size)
    bar_file = progress_file(progress, ctx.is_main)
    with tqdm(total=len(units), desc="units", file=bar_file, disable=not bar_file) as bar:
        for start in range(0, len(units), ctx.world_size):
            step = units[start : start + ctx.world_size]
            mine = step[ctx.rank] if ctx.rank < len(step) else None
            loaded = _read_unit(str(megatron_dir), metadata, mine)
            converted = {} if mine is None else _unit_to_hf(mine, loaded, cfg, dtype)
            del loaded
            if writer is None:
                for name in plan[start + ctx.rank] if converted else []:
                    dist.send(converted[name].contiguous(), dst=0, group=group)
                continue
            writer.add(converted)  # rank 0's unit comes first in the step
            del converted
            for src in range(1, len(step)):
                received = {
                    k: torch.empty(v.shape, dtype=v.dtype) for k, v in plan[start + src].items()
                }
                for tensor in received.values():
                    dist.recv(tensor, src=src, group=group)
                writer.add(received)
            bar.update(len(step))
    if writer is not None:
        writer.close()
    dist.barrier(group=group)


def _export_worker(
    megatron_dir: str, out_dir: str, cfg: ModelConfig, family: str, dtype, size: str, progress: str
) -> int:
    from megatron_grpo.mcore.parallel import init_parallel

    ctx = init_parallel(ParallelDims())
    export_on_ranks(ctx, megatron_dir, out_dir, cfg, family, dtype, size, progress)
    return ctx.rank


def convert_megatron_to_hf(
    megatron_dir: str | Path,
    out_dir: str | Path,
    *,
    family: str = "auto",
    model_config: str | Path | None = None,
    hf_config_dir: str | Path | None = None,
    tokenizer_dir: str | Path | None = None,
    dtype: str | None = None,
    max_shard_size: str = "5GB",
    num_procs: int = 2,
    timeout: float = 6 * 3600.0,
) -> Path:
    """Export a distributed checkpoint (any layout) as an HF directory; returns the
    checkpoint read.

    ``megatron_dir`` is a training run (its latest checkpoint), a training checkpoint, or
    a converted checkpoint; the model config, config template and tokenizer default to
    what it names (``export_source.resolve_source``). ``dtype`` is that of the written
    weights (default: the model config's ``params_dtype``; megatron keeps norms in fp32).
    Starts ``num_procs`` reader processes, or, under torchrun with that world size, runs
    as one of them.
    """
    from megatron_grpo.launch import run_workers

    if num_procs < 2:
        raise ValueError(f"num_procs={num_procs}: reading slices takes at least 2 processes")
    source = resolve_source(
        megatron_dir,
        model_config=model_config,
        hf_config_dir=hf_config_dir,
        tokenizer_dir=tokenizer_dir,
    )
    ckpt, cfg = source.checkpoint, source.model
    family = infer_family(cfg) if family == "auto" else family
    torch_dtype = DTYPES[dtype or cfg.params_dtype]  # megatron keeps norms in fp32
    plan = plan_megatron_export(ckpt, cfg, family, torch_dtype)
    if source.template is not None:
        check_config_template(source.template, cfg, family)
    out = Path(out_dir)
    check_output_dir(out)
    out.mkdir(parents=True, exist_ok=True)

    def write_side() -> None:
        dtype = next(iter(plan[0].values())).dtype
        write_side_files(out, cfg, family, dtype, source.template, source.tokenizer)

    if under_torchrun(num_procs):
        from megatron_grpo.mcore.parallel import init_parallel

        ctx = init_parallel(ParallelDims())
        export_on_ranks(ctx, ckpt, out, cfg, family, torch_dtype, max_shard_size)
        if ctx.is_main:
            write_side()
        return ckpt
    with relayed_progress() as progress:
        kwargs = dict(megatron_dir=str(ckpt), out_dir=str(out), cfg=cfg, family=family)
        kwargs |= dict(dtype=torch_dtype, size=max_shard_size, progress=progress)
        target = f"{__name__}:_export_worker"
        run_workers(target, num_procs, kwargs=kwargs, timeout=timeout)
    write_side()
    return ckpt
