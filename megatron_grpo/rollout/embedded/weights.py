"""Weights into the embedded server: from a Hugging Face directory or from named tensors.

``/update_weights_from_tensor`` on the embedded server takes SGLang's request
fields, with the tensors in the project's own serialization: one safetensors
blob of ``{hf_name: tensor}``, base64-encoded, per entry of
``serialized_named_tensors``, and ``load_format`` set to
``EMBEDDED_TENSOR_FORMAT``. SGLang's own format (pickled
``MultiprocessingSerializer`` handles) is refused: unpickling what a client
sends is not something an HTTP server should do.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from typing import Any

import safetensors.torch
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from megatron_grpo.config import ModelConfig
from megatron_grpo.convert.hf_config import hf_config_from_model_config

EMBEDDED_TENSOR_FORMAT = "megatron_grpo_safetensors_base64"


def serialize_named_tensors(named_tensors: Mapping[str, torch.Tensor]) -> str:
    """Tensors to one base64 string (copies, so tied or strided tensors are fine)."""
    plain = {name: t.detach().to("cpu").contiguous().clone() for name, t in named_tensors.items()}
    return base64.b64encode(safetensors.torch.save(plain)).decode("ascii")


def deserialize_named_tensors(data: str) -> dict[str, torch.Tensor]:
    try:
        blob = base64.b64decode(data, validate=True)
        return safetensors.torch.load(blob)
    except Exception as err:  # binascii and safetensors raise several types
        raise ValueError(
            f"serialized_named_tensors entry is not base64 safetensors: {err}"
        ) from err


def tensor_update_payload(
    named_tensors: Mapping[str, torch.Tensor], *, weight_version: str, flush_cache: bool = True
) -> dict[str, Any]:
    """A ``/update_weights_from_tensor`` body for the embedded server (one TP rank)."""
    return {
        "serialized_named_tensors": [serialize_named_tensors(named_tensors)],
        "load_format": EMBEDDED_TENSOR_FORMAT,
        "flush_cache": flush_cache,
        "weight_version": weight_version,
    }


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
