"""Weights into the embedded server: from a Hugging Face directory or from named tensors.

``/update_weights_from_tensor`` on the embedded server takes the tensors as the
request body itself: one safetensors blob of ``{hf_name: tensor}`` (Content-Type
``application/octet-stream``), with ``weight_version`` and ``flush_cache`` as query
parameters; no base64, no JSON around megabytes of weights. SGLang's own format
(pickled ``MultiprocessingSerializer`` handles in JSON) is refused: unpickling what a
client sends is not something an HTTP server should do.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

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


def load_hf_model(model_path: str) -> PreTrainedModel:
    """A causal LM from a Hugging Face directory, fp32, eval mode."""
    # Loaded in the checkpoint's dtype and then upcast (exact from bf16/fp16):
    # the dtype keyword changed name between transformers 4 and 5.
    return AutoModelForCausalLM.from_pretrained(model_path).float().eval()


def hf_model_from_state(named: Mapping[str, torch.Tensor], cfg: ModelConfig) -> PreTrainedModel:
    """A transformers model holding ``named`` (the embedded engine's copy of the policy)."""
    hf_cfg = hf_config_from_model_config(cfg, cfg.hf_family)
    model = AutoModelForCausalLM.from_config(hf_cfg).float().eval()
    missing, unexpected = model.load_state_dict(named, strict=False)
    tied = {"lm_head.weight"} if cfg.tie_embeddings else set()
    if unexpected or set(missing) - tied:
        raise RuntimeError(f"HF model mismatch: missing {missing}, unexpected {unexpected}")
    return model


def copy_into_model(
    model: PreTrainedModel, named_tensors: Mapping[str, torch.Tensor], *, require_all: bool
) -> None:
    """Copy tensors into the parameters and buffers of the same (HF) name.

    Raises ValueError, before changing anything, on an unknown name, a shape
    mismatch, or (with ``require_all``) a missing name.
    """
    targets = model.state_dict(keep_vars=True)
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
