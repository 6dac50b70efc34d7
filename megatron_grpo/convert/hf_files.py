"""Hugging Face checkpoint directories, read and written a piece at a time.

Reading: ``HFCheckpoint`` lists a directory's tensors (one ``model.safetensors``
or shards with an index) with their shapes and dtypes from the file headers
alone, and reads named tensors lazily with ``safetensors.safe_open``.
``MegatronView`` presents it as the full megatron state dict (TP=1 names) that
``full_state.load_full_state`` reads, converting one decoder layer at a time
and keeping only that layer.

Writing: ``ShardedWriter`` plans the output files up front from names, shapes
and dtypes (huggingface_hub's splitter, as ``save_pretrained`` uses), takes
tensors in order and writes each file with ``safetensors`` as soon as it is
complete, so it holds about one file's worth; the index is written at the end
when there is more than one file. ``StreamingWriter`` needs no plan: it starts a
new file when the next tensors would overflow the current one (a pipeline stage
writing its own layers as they come). ``write_side_files`` adds ``config.json``,
``generation_config.json`` and the tokenizer files beside the weights.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from megatron_grpo.config import ModelConfig
from megatron_grpo.config.hf import check_hf_config, family_of, get_family, read_hf_config
from megatron_grpo.convert.weights import (
    HF_EMBEDDING,
    HF_FINAL_NORM,
    HF_OUTPUT,
    MEGATRON_EMBEDDING,
    MEGATRON_FINAL_NORM,
    MEGATRON_OUTPUT,
    hf_layer_keys,
    hf_layer_to_megatron,
    megatron_global_keys,
    megatron_key_layer,
    megatron_layer_keys,
)

HF_FILES_DIR = "hf"
"""The folder of a converted megatron checkpoint that keeps the source's config and
tokenizer files (``convert hf-to-megatron``)."""
SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
CONFIG_FILES = ("config.json", "generation_config.json")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)
_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
}
_GLOBAL_HF_NAMES = {
    MEGATRON_EMBEDDING: HF_EMBEDDING,
    MEGATRON_FINAL_NORM: HF_FINAL_NORM,
    MEGATRON_OUTPUT: HF_OUTPUT,
}


class HFCheckpoint:
    """The safetensors weights of an HF directory, read by name without loading the rest.

    Files are opened for each read and closed after it: safetensors maps
    them into memory, and a file kept open would keep every page read so far.
    """

    def __init__(self, hf_dir: str | Path):
        self.dir = Path(hf_dir)
        index, single = self.dir / SAFETENSORS_INDEX, self.dir / SAFETENSORS_FILE
        if index.is_file():
            self.weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        elif single.is_file():
            with self._open(single.name) as f:
                self.weight_map = dict.fromkeys(f.keys(), single.name)
        else:
            raise FileNotFoundError(
                f"{hf_dir} has neither {SAFETENSORS_INDEX} nor {SAFETENSORS_FILE} "
                "(only safetensors checkpoints are supported)"
            )

    def _open(self, filename: str) -> Any:
        from safetensors import safe_open

        return safe_open(str(self.dir / filename), framework="pt")

    def _by_file(self, names: Iterable[str]) -> dict[str, list[str]]:
        files: dict[str, list[str]] = {}
        for name in names:
            files.setdefault(self.weight_map[name], []).append(name)
        return files

    def meta(self) -> dict[str, Tensor]:
        """Every tensor as a meta tensor of its stored shape and dtype (headers only)."""
        out = {}
        for filename, names in self._by_file(self.weight_map).items():
            with self._open(filename) as f:
                for name in names:
                    piece = f.get_slice(name)
                    dtype = _DTYPES.get(piece.get_dtype())
                    if dtype is None:
                        raise ValueError(f"HF weight {name!r} has dtype {piece.get_dtype()}")
                    out[name] = torch.empty(piece.get_shape(), dtype=dtype, device="meta")
        return {name: out[name] for name in self.weight_map}

    def read(self, names: list[str]) -> dict[str, Tensor]:
        out: dict[str, Tensor] = {}
        for filename, in_file in self._by_file(names).items():
            with self._open(filename) as f:
                out |= {name: f.get_tensor(name) for name in in_file}
        return {name: out[name] for name in names}


class MegatronView(Mapping[str, Tensor]):
    """An HF checkpoint as full megatron tensors (TP=1 names), one decoder layer in memory.

    Embedding, final norm and head are read on demand with ``vocab_size``
    rows (``load_full_state`` pads them). ``on_layer`` is called after each
    decoder layer is read, e.g. to advance a progress bar.
    """

    def __init__(
        self, ckpt: HFCheckpoint, cfg: ModelConfig, on_layer: Callable[[], Any] | None = None
    ):
        self._ckpt, self._cfg, self._on_layer = ckpt, cfg, on_layer
        layers = [megatron_layer_keys(i, cfg) for i in range(cfg.num_layers)]
        self._keys = megatron_global_keys(cfg) + [k for keys in layers for k in keys]
        self._layer: int | None = None
        self._tensors: dict[str, Tensor] = {}

    def __getitem__(self, name: str) -> Tensor:
        layer = megatron_key_layer(name)
        if layer is None:
            hf_name = _GLOBAL_HF_NAMES[name]
            return self._ckpt.read([hf_name])[hf_name]
        if layer != self._layer:
            self._tensors = {}  # drop the previous layer before reading the next
            hf = self._ckpt.read(hf_layer_keys(layer, self._cfg))
            self._tensors, self._layer = hf_layer_to_megatron(layer, hf, self._cfg), layer
            if self._on_layer is not None:
                self._on_layer()
        return self._tensors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


class ShardedWriter:
    """Writes planned tensors into safetensors files as each file fills up.

    ``planned`` maps every output name, in writing order, to a tensor (a meta
    tensor will do) of the shape and dtype that will be written.
    """

    def __init__(self, out_dir: str | Path, planned: Mapping[str, Tensor], max_shard_size: str):
        from huggingface_hub import split_torch_state_dict_into_shards

        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self._planned = {k: (tuple(v.shape), v.dtype) for k, v in planned.items()}
        self._split = split_torch_state_dict_into_shards(
            dict(planned), max_shard_size=max_shard_size
        )
        self._pending: dict[str, dict[str, Tensor]] = {}
        self._written: list[str] = []

    def add(self, tensors: Mapping[str, Tensor]) -> None:
        from safetensors.torch import save_file

        for name, tensor in tensors.items():
            if (tuple(tensor.shape), tensor.dtype) != self._planned.get(name):
                raise RuntimeError(f"{name}: not planned as {tuple(tensor.shape)} {tensor.dtype}")
            filename = self._split.tensor_to_filename[name]
            shard = self._pending.setdefault(filename, {})
            shard[name] = tensor.contiguous()
            if len(shard) == len(self._split.filename_to_tensors[filename]):
                save_file(self._pending.pop(filename), self.out_dir / filename, {"format": "pt"})
                self._written.append(filename)

    def close(self) -> None:
        """Write the index (sharded output); raise if a planned tensor never came."""
        missing = sorted(set(self._split.filename_to_tensors) - set(self._written))
        if missing:
            raise RuntimeError(f"output files never completed: {missing}")
        if self._split.is_sharded:
            index = {"metadata": self._split.metadata, "weight_map": self._split.tensor_to_filename}
            (self.out_dir / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2) + "\n")


class StreamingWriter:
    """Writes tensors as they come into safetensors files of at most ``max_bytes`` each
    (a bigger tensor gets a file of its own), named ``<prefix>-<k>.safetensors``.

    Holds at most one file's tensors. ``close`` returns each file's name and tensor names,
    in writing order, for an index that whoever gathers the files writes.
    """

    def __init__(self, out_dir: str | Path, prefix: str, max_bytes: int):
        self.out_dir, self.prefix, self._max_bytes = Path(out_dir), prefix, max_bytes
        self._pending: dict[str, Tensor] = {}
        self._pending_bytes = 0
        self.files: list[tuple[str, list[str]]] = []

    def add(self, tensors: Mapping[str, Tensor]) -> None:
        for name, tensor in tensors.items():
            size = tensor.numel() * tensor.element_size()
            if self._pending and self._pending_bytes + size > self._max_bytes:
                self._flush()
            self._pending[name] = tensor.contiguous()
            self._pending_bytes += size

    def _flush(self) -> None:
        from safetensors.torch import save_file

        filename = f"{self.prefix}-{len(self.files):05d}.safetensors"
        save_file(self._pending, self.out_dir / filename, {"format": "pt"})
        self.files.append((filename, list(self._pending)))
        self._pending, self._pending_bytes = {}, 0

    def close(self) -> list[tuple[str, list[str]]]:
        if self._pending:
            self._flush()
        return self.files


def write_index(out_dir: Path, weight_map: Mapping[str, str], total_size: int) -> None:
    """``model.safetensors.index.json``: which file holds each tensor."""
    index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    (out_dir / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2) + "\n")


def check_output_dir(out_dir: Path) -> None:
    """Refuse to mix new weights with old ones in ``out_dir``."""
    old = sorted(p.name for p in out_dir.glob("*.safetensors*")) if out_dir.is_dir() else []
    if old:
        raise ValueError(f"{out_dir} already holds weights ({old[0]}); choose an empty directory")


def copy_files(src_dir: Path, out_dir: Path, names: tuple[str, ...]) -> list[str]:
    """Copy the files of ``names`` that ``src_dir`` has; the names copied."""
    copied = [name for name in names if (src_dir / name).is_file()]
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in copied:
        shutil.copyfile(src_dir / name, out_dir / name)
    return copied


def check_tokenizer_dir(src_dir: Path) -> None:
    if not any((src_dir / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(f"{src_dir} holds no tokenizer files ({', '.join(TOKENIZER_FILES)})")


def check_config_template(template_dir: Path, cfg: ModelConfig, family: str) -> None:
    """Raise a ValueError unless ``template_dir/config.json`` describes ``cfg`` as ``family``."""
    template = read_hf_config(template_dir)
    if family_of(template) != get_family(family):
        raise ValueError(
            f"{template_dir}/config.json is {family_of(template).architecture}, "
            f"not {get_family(family).architecture}"
        )
    try:
        check_hf_config(template, cfg)
    except ValueError as err:
        raise ValueError(f"{template_dir}/config.json: {err}") from None


def write_hf_config(
    out_dir: Path,
    cfg: ModelConfig,
    family: str,
    dtype: torch.dtype,
    template_dir: Path | None,
    tokenizer_dir: Path | None = None,
) -> list[str]:
    """``config.json`` and ``generation_config.json`` for the exported weights.

    With ``template_dir`` (the source model's files: kept by HF -> megatron conversion,
    or a run's ``train.init``) its config is written back after checking that it
    describes ``cfg`` and ``family``, so token ids and other fields that ``ModelConfig``
    does not hold survive the round trip, and so is its generation config. Without, the
    config is built from ``cfg``; a missing generation config is then made from the
    token ids of ``tokenizer_dir`` (none without a tokenizer: the ids are unknown).
    """
    from megatron_grpo.convert.hf_config import hf_config_from_model_config

    dtype_name = str(dtype).removeprefix("torch.")
    out_dir.mkdir(parents=True, exist_ok=True)
    token_ids = _token_ids(tokenizer_dir) if tokenizer_dir is not None else {}
    if template_dir is None or not (template_dir / "config.json").is_file():
        hf_config = hf_config_from_model_config(cfg, family)
        hf_config.dtype = dtype_name
        for key, value in token_ids.items():
            setattr(hf_config, key, value)
        hf_config.save_pretrained(out_dir)
        written = ["config.json"]
    else:
        check_config_template(template_dir, cfg, family)
        template = read_hf_config(template_dir)
        keys = [k for k in ("dtype", "torch_dtype") if k in template] or ["dtype"]
        template |= dict.fromkeys(keys, dtype_name)
        (out_dir / "config.json").write_text(json.dumps(template, indent=2) + "\n")
        written = ["config.json"]
        written += copy_files(template_dir, out_dir, ("generation_config.json",))
    if "generation_config.json" not in written and token_ids:
        from transformers import GenerationConfig

        GenerationConfig(**token_ids).save_pretrained(out_dir)
        written.append("generation_config.json")
    return written


def _token_ids(tokenizer_dir: Path) -> dict[str, int]:
    """The tokenizer's BOS, EOS and pad token ids, those it has."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    ids = {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    return {key: value for key, value in ids.items() if value is not None}


def write_side_files(
    out_dir: Path,
    cfg: ModelConfig,
    family: str,
    dtype: torch.dtype,
    template_dir: Path | None,
    tokenizer_dir: Path | None,
) -> list[str]:
    """Everything of an exported model but its weights: ``write_hf_config`` and the
    tokenizer files of ``tokenizer_dir``; the names written."""
    written = write_hf_config(out_dir, cfg, family, dtype, template_dir, tokenizer_dir)
    if tokenizer_dir is not None:
        written += copy_files(tokenizer_dir, out_dir, TOKENIZER_FILES)
    return written
