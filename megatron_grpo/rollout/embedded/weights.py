"""Weights into the embedded server: from a Hugging Face directory or from named tensors.

``/update_weights_from_tensor`` on the embedded server takes the tensors in one of two
ways, never as base64 in JSON:
- in shared memory, from a sender on the same machine: the sender copies the bucket into
  one file under ``/dev/shm`` (``shared_bucket``) and sends a small JSON body naming the
  file and each tensor's dtype, shape and offset (``{"shared_memory": ...}``); the server
  maps the file and copies each tensor straight into its parameter. One copy on each side.
- as the request body itself: one safetensors blob of ``{hf_name: tensor}`` (Content-Type
  ``application/octet-stream``), with ``weight_version`` and ``flush_cache`` as query
  parameters, from anywhere.
SGLang's own format (pickled ``MultiprocessingSerializer`` handles in JSON) is refused:
unpickling what a client sends is not something an HTTP server should do.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from megatron_grpo.config import ModelConfig
from megatron_grpo.convert.hf_config import hf_config_from_model_config

TENSOR_CONTENT_TYPE = "application/octet-stream"


@dataclass(frozen=True)
class TensorUpdate:
    """A ``/update_weights_from_tensor`` request for the embedded server (one TP rank)."""

    body: bytes
    """The tensors, one safetensors blob."""
    query: dict[str, str]
    """``weight_version`` and ``flush_cache``."""


def serialize_named_tensors(named_tensors: Mapping[str, torch.Tensor]) -> bytes:
    """Tensors to one safetensors blob. Only tensors that share memory with one already
    taken (tied embeddings) or are not contiguous are copied first."""
    plain: dict[str, torch.Tensor] = {}
    storages: set[int] = set()
    for name, t in named_tensors.items():
        t = t.detach().to("cpu")
        ptr = t.untyped_storage().data_ptr()
        if ptr in storages or not t.is_contiguous():
            t = t.contiguous().clone()
        storages.add(t.untyped_storage().data_ptr())
        plain[name] = t
    return safetensors.torch.save(plain)


def deserialize_named_tensors(blob: bytes) -> dict[str, torch.Tensor]:
    try:
        return safetensors.torch.load(blob)
    except Exception as err:  # safetensors raises several types
        raise ValueError(f"the request body is not a safetensors blob: {err}") from err


def tensor_update(
    named_tensors: Mapping[str, torch.Tensor], *, weight_version: str, flush_cache: bool = True
) -> TensorUpdate:
    """The request that loads ``named_tensors`` into the embedded server."""
    return TensorUpdate(
        body=serialize_named_tensors(named_tensors),
        query={"weight_version": weight_version, "flush_cache": str(flush_cache).lower()},
    )


SHM_DIR = Path("/dev/shm")
SHM_PREFIX = "mgrpo_weights_"
_ALIGN = 64


@dataclass
class SharedBucket:
    """A bucket of tensors in one shared-memory file; ``close()`` removes the file."""

    path: Path
    entries: list[dict[str, Any]]
    """Per tensor: name, dtype (``float32``), shape and byte offset in the file."""
    buffer: torch.Tensor

    def request(self, *, weight_version: str, flush_cache: bool = True) -> dict[str, Any]:
        """The JSON body of ``/update_weights_from_tensor`` that loads this bucket."""
        return {
            "shared_memory": {"path": str(self.path), "tensors": self.entries},
            "weight_version": weight_version,
            "flush_cache": flush_cache,
        }

    def close(self) -> None:
        self.path.unlink(missing_ok=True)


def shared_memory_available() -> bool:
    return SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK)


def shared_bucket(named_tensors: Mapping[str, torch.Tensor]) -> SharedBucket:
    """``named_tensors`` copied into a new file under ``/dev/shm``, each at an aligned offset."""
    entries, offset = [], 0
    for name, t in named_tensors.items():
        entries.append(
            {
                "name": name,
                "dtype": str(t.dtype).removeprefix("torch."),
                "shape": list(t.shape),
                "offset": offset,
            }
        )
        offset += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
    path = SHM_DIR / f"{SHM_PREFIX}{os.getpid()}_{uuid.uuid4().hex}"
    buffer = torch.from_file(str(path), shared=True, size=max(offset, 1), dtype=torch.uint8)
    bucket = SharedBucket(path, entries, buffer)
    try:
        for entry, t in zip(entries, named_tensors.values()):
            _view(buffer, entry).copy_(t.detach())
    except BaseException:
        bucket.close()
        raise
    return bucket


def _view(buffer: torch.Tensor, entry: Mapping[str, Any]) -> torch.Tensor:
    dtype = getattr(torch, str(entry["dtype"]), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{entry['name']}: unknown dtype {entry['dtype']!r}")
    shape = [int(n) for n in entry["shape"]]
    nbytes = dtype.itemsize * int(torch.Size(shape).numel())
    start = int(entry["offset"])
    if start < 0 or start % _ALIGN or start + nbytes > buffer.numel():
        raise ValueError(f"{entry['name']}: offset {start} and size {nbytes} lie outside the file")
    return buffer[start : start + nbytes].view(dtype).view(shape)


def load_shared(spec: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The tensors of a ``shared_memory`` request, as views of the mapped file (no copy).

    Only files this project's senders make are opened (``/dev/shm/mgrpo_weights_*``).
    """
    path = Path(str(spec.get("path", "")))
    if path.parent != SHM_DIR or not path.name.startswith(SHM_PREFIX):
        raise ValueError(f"shared_memory.path must be a {SHM_DIR}/{SHM_PREFIX}* file, got {path}")
    if not path.is_file():
        raise ValueError(f"shared_memory.path {path} does not exist (is the sender on this host?)")
    buffer = torch.from_file(str(path), shared=False, size=path.stat().st_size, dtype=torch.uint8)
    return {str(e["name"]): _view(buffer, e) for e in spec.get("tensors", [])}


def load_hf_model(model_path: str) -> PreTrainedModel:
    """A causal LM from a Hugging Face directory, fp32, eval mode."""
    # Loaded in the checkpoint's dtype and then upcast (exact from bf16/fp16):
    # the dtype keyword changed name between transformers 4 and 5.
    return AutoModelForCausalLM.from_pretrained(model_path).float().eval()


def hf_model_from_config(cfg: ModelConfig) -> PreTrainedModel:
    """A transformers model of ``cfg``'s family and shape with random weights (the
    embedded engine's copy of the policy until the first push)."""
    hf_cfg = hf_config_from_model_config(cfg, cfg.hf_family)
    return AutoModelForCausalLM.from_config(hf_cfg).float().eval()


def hf_model_from_state(named: Mapping[str, torch.Tensor], cfg: ModelConfig) -> PreTrainedModel:
    """A transformers model holding ``named`` (the embedded engine's copy of the policy)."""
    hf_cfg = hf_config_from_model_config(cfg, cfg.hf_family)
    model = AutoModelForCausalLM.from_config(hf_cfg).float().eval()
    missing, unexpected = model.load_state_dict(named, strict=False)
    tied = {"lm_head.weight"} if cfg.tie_embeddings else set()
    if unexpected or set(missing) - tied:
        raise RuntimeError(f"HF model mismatch: missing {missing}, unexpected {unexpected}")
    return model


def hf_weights(model: PreTrainedModel) -> dict[str, torch.Tensor]:
    """The model's weights under the names of a saved checkpoint, as views of its
    parameters: a MoE model's fused in-memory experts (transformers 5) split per expert."""
    from megatron_grpo.convert.experts import split_hf_experts

    return split_hf_experts(model.state_dict(keep_vars=True))


def copy_into_model(
    model: PreTrainedModel, named_tensors: Mapping[str, torch.Tensor], *, require_all: bool
) -> None:
    """Copy tensors into the parameters and buffers of the same (HF) name.

    Raises ValueError, before changing anything, on an unknown name, a shape
    mismatch, or (with ``require_all``) a missing name.
    """
    targets = hf_weights(model)
    unknown = sorted(set(named_tensors) - set(targets))
    if unknown:
        raise ValueError(f"no such weights in the model: {unknown[:10]}")
    if require_all:
        missing = sorted(set(targets) - set(named_tensors))
        if missing:
            raise ValueError(f"weights missing from the update: {missing[:10]}")
    for name, tensor in named_tensors.items():
        if tuple(tensor.shape) != tuple(targets[name].shape):
            raise ValueError(
                f"{name}: shape {tuple(tensor.shape)} does not match the model's "
                f"{tuple(targets[name].shape)}"
            )
    with torch.no_grad():
        for name, tensor in named_tensors.items():
            targets[name].copy_(tensor)
