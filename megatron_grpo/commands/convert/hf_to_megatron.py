"""HF safetensors checkpoint -> megatron-core distributed checkpoint, and what both ways share.

``convert_hf_to_megatron``: the HF config is translated (and checked against
a given model config), and the weights' names and shapes are checked from the
safetensors headers, before any process starts. Then each of the TP x PP
ranks builds its model chunk, reads only its own layers from the safetensors
files, one layer at a time, keeps its TP shard (``full_state.load_full_state``)
and takes part in one distributed save (``checkpoint.save_model``). The
resolved ``ModelConfig`` goes into ``model.yaml`` and the source's config,
generation config and tokenizer files into ``hf/``, both inside the
checkpoint directory, for training and for the way back (``megatron_to_hf``).

Memory: each rank holds its model shard plus one full decoder layer (or one
vocab matrix) of the HF checkpoint.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

import yaml

from megatron_grpo.config import ModelConfig, ParallelDims, dump_config, from_dict
from megatron_grpo.config.hf import (
    check_hf_config,
    family_of,
    get_family,
    model_config_from_hf,
    read_hf_config,
)
from megatron_grpo.config.init_model import MODEL_CONFIG_FILE
from megatron_grpo.convert.hf_files import (
    CONFIG_FILES,
    HF_FILES_DIR,
    TOKENIZER_FILES,
    HFCheckpoint,
    MegatronView,
    copy_files,
)
from megatron_grpo.convert.sharding import chunk_layer_range, shard_for_rank
from megatron_grpo.convert.weights import hf_to_megatron
from megatron_grpo.mcore.model import DTYPES


def load_model_config(path: str | Path) -> ModelConfig:
    """A ``ModelConfig`` from YAML: its fields, or a run config with a ``model:`` section."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"no model config at {path} (a converted checkpoint has one)")
    raw = yaml.safe_load(Path(path).read_text()) or {}
    if isinstance(raw, dict) and isinstance(raw.get("model"), dict):
        raw = raw["model"]
    return from_dict(ModelConfig, raw, prefix="model.")


def under_torchrun(num_procs: int) -> bool:
    """True when this process is one of ``num_procs`` started by torchrun.

    Keyed on torchrun's own variable: cluster schedulers set WORLD_SIZE too.
    """
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return False
    if int(os.environ["WORLD_SIZE"]) != num_procs:
        raise ValueError(
            f"running under torchrun with WORLD_SIZE={os.environ['WORLD_SIZE']}, "
            f"but this conversion needs {num_procs} processes"
        )
    return True


@contextlib.contextmanager
def relayed_progress() -> Iterator[str]:
    """A file for rank 0's progress bar, copied to this process's stderr while it lives.

    Worker processes write into log files; this lets the user see the bar.
    """
    stop = threading.Event()
    with tempfile.TemporaryDirectory(prefix="mgrpo_progress_") as tmp:
        path = os.path.join(tmp, "progress")
        open(path, "w").close()

        def relay() -> None:
            with open(path, "rb") as src:
                while True:
                    chunk = src.read()
                    if chunk:
                        sys.stderr.buffer.write(chunk)
                        sys.stderr.flush()
                    elif stop.is_set():
                        return
                    else:
                        stop.wait(0.2)

        thread = threading.Thread(target=relay, daemon=True)
        thread.start()
        try:
            yield path
        finally:
            stop.set()
            thread.join()


def progress_file(path: str | None, is_main: bool) -> TextIO | None:
    """Where rank 0 draws its progress bar: the relayed file, else this process's stderr."""
    if not is_main:
        return None
    return open(path, "a") if path else sys.stderr


# --------------------------------------------------------------------------- HF -> megatron


def resolve_hf_model(
    hf_dir: str | Path,
    *,
    family: str = "auto",
    model_config: str | Path | None = None,
    dtype: str | None = None,
) -> ModelConfig:
    """The ``ModelConfig`` to convert ``hf_dir`` into; raises ValueError naming any mismatch.

    ``dtype`` (params_dtype) defaults to the model config's when one is
    given, else to the HF config's ``dtype`` / ``torch_dtype``, else float32.
    """
    hf_config = read_hf_config(hf_dir)
    found = family_of(hf_config)
    if family != "auto" and get_family(family) != found:
        raise ValueError(f"{hf_dir} holds {found.architecture}, not --family {family}")
    if model_config is None:
        cfg = model_config_from_hf(hf_config)
        dtype = dtype or hf_config.get("dtype") or hf_config.get("torch_dtype")
    else:
        cfg = load_model_config(model_config)
        check_hf_config(hf_config, cfg)
    if dtype is not None:
        params_dtype: Any = dtype if dtype in DTYPES else "float32"  # e.g. an fp64 HF model
        cfg = dataclasses.replace(cfg, params_dtype=params_dtype)
    return cfg


def check_hf_weights(ckpt: HFCheckpoint, cfg: ModelConfig, dims: ParallelDims) -> None:
    """Check every HF tensor's name and shape, and that the layout divides them, from headers."""
    dims.validate_model(
        num_layers=cfg.num_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_query_groups or cfg.num_attention_heads,
        num_experts=cfg.num_experts,
    )
    full = hf_to_megatron(ckpt.meta(), cfg)  # meta tensors: checks, no data
    for name, tensor in full.items():
        shard_for_rank(name, tensor, 0, dims.tp, cfg)


def convert_hf_on_ranks(
    ctx: Any,
    hf_dir: str | Path,
    out_dir: str | Path,
    cfg: ModelConfig,
    progress: str | None = None,
) -> None:
    """Worker body: build this rank's chunks, stream its layers in, save collectively.

    ``progress``: the file rank 0 draws its bar into (see ``relayed_progress``).
    """
    from tqdm import tqdm

    from megatron_grpo.mcore import checkpoint
    from megatron_grpo.mcore.full_state import load_full_state
    from megatron_grpo.mcore.model import build_model

    model = build_model(cfg, ctx, wrap_ddp=False)
    stages = range(ctx.dims.vpp or 1)
    num_layers = sum(
        len(chunk_layer_range(cfg.num_layers, ctx.pp_rank, ctx.dims.pp, s, ctx.dims.vpp))
        for s in stages
    )
    bar_file = progress_file(progress, ctx.is_main)
    with tqdm(total=num_layers, desc="rank 0 layers", file=bar_file, disable=not bar_file) as bar:
        view = MegatronView(HFCheckpoint(hf_dir), cfg, on_layer=bar.update)
        load_full_state(model, view, cfg, ctx)
    checkpoint.save_model(model, out_dir, ctx)


def _hf_to_megatron_worker(
    hf_dir: str, out_dir: str, cfg: ModelConfig, tp: int, pp: int, progress: str
) -> int:
    from megatron_grpo.mcore.parallel import init_parallel

    ctx = init_parallel(ParallelDims(tp=tp, pp=pp))
    convert_hf_on_ranks(ctx, hf_dir, out_dir, cfg, progress)
    return ctx.rank


def write_megatron_sidecar(hf_dir: str | Path, out_dir: str | Path, cfg: ModelConfig) -> None:
    """``model.yaml`` and the source's config and tokenizer files (``hf/``) into ``out_dir``."""
    out = Path(out_dir)
    (out / MODEL_CONFIG_FILE).write_text(dump_config(cfg))
    copy_files(Path(hf_dir), out / HF_FILES_DIR, CONFIG_FILES + TOKENIZER_FILES)


def convert_hf_to_megatron(
    hf_dir: str | Path,
    out_dir: str | Path,
    *,
    tp: int = 1,
    pp: int = 1,
    family: str = "auto",
    model_config: str | Path | None = None,
    dtype: str | None = None,
    timeout: float = 6 * 3600.0,
) -> ModelConfig:
    """Convert an HF checkpoint directory into a distributed checkpoint at TP x PP.

    Starts the TP x PP processes itself, or, under torchrun with that world
    size, runs as one of them.
    """
    from megatron_grpo.launch import run_workers

    cfg = resolve_hf_model(hf_dir, family=family, model_config=model_config, dtype=dtype)
    dims = ParallelDims(tp=tp, pp=pp)
    check_hf_weights(HFCheckpoint(hf_dir), cfg, dims)
    out = Path(out_dir)
    if out.resolve() == Path(hf_dir).resolve() or (
        out.is_dir() and any(out.iterdir()) and not (out / "metadata.json").is_file()
    ):
        raise ValueError(f"refusing to replace {out}: it exists and is not a megatron checkpoint")
    if under_torchrun(tp * pp):
        from megatron_grpo.mcore.parallel import init_parallel

        ctx = init_parallel(dims)
        convert_hf_on_ranks(ctx, hf_dir, out, cfg)
        if ctx.is_main:
            write_megatron_sidecar(hf_dir, out, cfg)
        return cfg
    with relayed_progress() as progress:
        kwargs = dict(hf_dir=str(hf_dir), out_dir=str(out), cfg=cfg, tp=tp, pp=pp)
        kwargs["progress"] = progress
        target = f"{__name__}:_hf_to_megatron_worker"
        run_workers(target, tp * pp, kwargs=kwargs, timeout=timeout)
    write_megatron_sidecar(hf_dir, out, cfg)
    return cfg
