"""Hugging Face models written during training: ``<output_dir>/hf/step_<N>`` every
``train.save_hf_interval`` steps and at the last step.

Every pipeline stage writes its own layers: ``mcore.hf_export.stage_hf_layers`` gathers
them over TP (and the experts over EP) onto the stage's sender a decoder layer at a time,
and the sender writes them into safetensors files of its own, at most ``MAX_SHARD_BYTES``
each. No rank holds more than its shard, one layer's full tensors and one file. Global
rank 0 then names the files as ``save_pretrained`` does (``model-00001-of-0000N``), writes
the index, ``config.json``, ``generation_config.json`` and the tokenizer files (those
``convert megatron-to-hf`` writes for the run: ``run_hf_files``), and renames
``step_<N>.partial`` into place, so a crash leaves only a ``.partial`` folder, which the
next start of the run removes (``state.remove_partial_saves``).

The weights are the step's, in ``model.params_dtype``, as its checkpoint (when one is
saved) holds them: the export of that checkpoint holds the same tensors, bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

from megatron_grpo.config import Config, ModelConfig, TrainConfig
from megatron_grpo.convert.hf_config import infer_family
from megatron_grpo.convert.hf_files import (
    HF_FILES_DIR,
    SAFETENSORS_FILE,
    StreamingWriter,
    write_index,
    write_side_files,
)
from megatron_grpo.mcore.checkpoint import atomic_dir
from megatron_grpo.mcore.hf_export import is_stage_sender, stage_hf_layers, takes_part
from megatron_grpo.mcore.model import DTYPES
from megatron_grpo.mcore.parallel import ParallelContext

MAX_SHARD_BYTES = 5 * 10**9
"""The largest safetensors file a stage writes (``save_pretrained``'s default, 5GB)."""

StageFiles = list[tuple[str, list[str]]]
"""A stage's files in writing order, each with the names of its tensors."""


def hf_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / "hf"


def hf_dir(output_dir: str | Path, step: int) -> Path:
    """Where the model of step ``step`` goes (named as its checkpoint is)."""
    return hf_root(output_dir) / f"step_{step:08d}"


def due(train: TrainConfig, step: int) -> bool:
    """Whether step ``step`` writes a Hugging Face model."""
    interval = train.save_hf_interval
    if not interval:
        return False
    return step % interval == 0 or step == train.total_steps


def run_hf_files(cfg: Config) -> tuple[Path | None, Path | None]:
    """(config template, tokenizer) of a run's Hugging Face models, as the run names them.

    The template (its ``config.json`` and ``generation_config.json`` are written back) is
    ``train.init`` when that is a Hugging Face directory, or the ``hf/`` folder of a
    converted megatron checkpoint; the tokenizer is the run's ``tokenizer``, else the
    template's folder. The paths are not checked: a run names paths that existed where it
    ran.
    """
    template = None
    if cfg.train.init is not None:
        init = Path(cfg.train.init)
        template = init
        if (init / "metadata.json").exists():
            sidecar = init / HF_FILES_DIR
            template = sidecar if (sidecar / "config.json").is_file() else None
    tokenizer = Path(cfg.tokenizer) if cfg.tokenizer is not None else template
    return template, tokenizer


def save_hf(model: list, cfg: Config, ctx: ParallelContext, step: int) -> Path:
    """Write the policy as a Hugging Face model under ``hf_dir``. Collective; the
    parameters must be up to date (``model.sync_params``)."""
    final = hf_dir(cfg.output_dir, step)
    template, tokenizer = run_hf_files(cfg)
    with atomic_dir(final, ctx) as partial:
        write_hf_model(model, cfg.model, ctx, partial, template, tokenizer)
    return final


def write_hf_model(
    model: list,
    model_cfg: ModelConfig,
    ctx: ParallelContext,
    out_dir: Path,
    template: Path | None,
    tokenizer: Path | None,
    max_bytes: int = MAX_SHARD_BYTES,
) -> None:
    """The model as a Hugging Face directory in ``out_dir`` (which exists): every stage's
    files, then on global rank 0 their names, the index and ``write_side_files``. Collective."""
    files = write_stage_files(model, model_cfg, ctx, out_dir, max_bytes)
    gathered: list[tuple[int, StageFiles]] = [(0, [])] * ctx.world_size
    dist.gather_object((ctx.pp_rank, files), gathered if ctx.is_main else None, dst=0)
    if ctx.is_main:
        name_files(out_dir, [files for _, files in sorted(g for g in gathered if g[1])])
        family, dtype = infer_family(model_cfg), DTYPES[model_cfg.params_dtype]
        write_side_files(out_dir, model_cfg, family, dtype, template, tokenizer)


def write_stage_files(
    model: list, model_cfg: ModelConfig, ctx: ParallelContext, out_dir: Path, max_bytes: int
) -> StageFiles:
    """This stage's weights under HF names, in ``model.params_dtype``, into files
    ``stage<pp>-<k>.safetensors`` in ``out_dir``; the files on the stage's sender, [] on
    the other ranks. Collective over the ranks that take part (``hf_export.takes_part``)."""
    if not takes_part(ctx):
        return []
    dtype = DTYPES[model_cfg.params_dtype]
    writer = None
    if is_stage_sender(ctx):
        writer = StreamingWriter(out_dir, f"stage{ctx.pp_rank:05d}", max_bytes)
    for tensors in stage_hf_layers(model, model_cfg, ctx):  # the other ranks get nothing
        assert writer is not None
        writer.add({name: t.to("cpu", dtype) for name, t in tensors.items()})
    return writer.close() if writer is not None else []


def name_files(out_dir: Path, stages: list[StageFiles]) -> None:
    """Rename the stages' files, in stage order, as ``save_pretrained`` names its shards
    and write the index (one file: ``model.safetensors``, no index)."""
    files = [f for stage in stages for f in stage]
    if len(files) == 1:
        (out_dir / files[0][0]).rename(out_dir / SAFETENSORS_FILE)
        return
    weight_map: dict[str, str] = {}
    total_size = 0
    for i, (filename, names) in enumerate(files):
        new_name = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
        (out_dir / filename).rename(out_dir / new_name)
        weight_map |= dict.fromkeys(names, new_name)
        total_size += _data_bytes(out_dir / new_name)
    write_index(out_dir, weight_map, total_size)


def _data_bytes(path: Path) -> int:
    """The bytes of a safetensors file's tensors (its size less the header)."""
    with path.open("rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
    return path.stat().st_size - 8 - header_len
