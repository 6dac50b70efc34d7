"""Weight sync: the learner's Megatron shards -> Hugging Face names -> rollout servers.

Every rank takes part in gathering the full tensors (``full_state``); global
rank 0 maps them to HF names (the same mapping as the conversion tools) and
sends them inside pause -> flush -> update -> continue, with
``weight_version`` set to the training step:
- ``tensor``: size-bounded buckets to ``/update_weights_from_tensor``
  (the embedded server's safetensors serialization);
- ``disk``: ``save_pretrained``-style safetensors in a directory, then
  ``/update_weights_from_disk``.
"""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Literal

import torch

from megatron_grpo.config import ModelConfig
from megatron_grpo.full_state import gather_full_state
from megatron_grpo.parallel import ParallelContext

SyncMethod = Literal["tensor", "disk"]


def buckets(named: Mapping[str, torch.Tensor], max_bytes: int) -> Iterator[dict[str, torch.Tensor]]:
    """Consecutive groups of tensors of at most ``max_bytes`` each (a bigger tensor goes alone)."""
    bucket: dict[str, torch.Tensor] = {}
    size = 0
    for name, t in named.items():
        nbytes = t.numel() * t.element_size()
        if bucket and size + nbytes > max_bytes:
            yield bucket
            bucket, size = {}, 0
        bucket[name] = t
        size += nbytes
    if bucket:
        yield bucket


def hf_state(model: list, ctx: ParallelContext, cfg: ModelConfig, family: str) -> dict | None:
    """The policy's weights under HF names, on global rank 0 (None elsewhere). Collective."""
    from megatron_grpo.hf_mapping import megatron_to_hf

    full = gather_full_state(model, ctx, vocab_size=cfg.vocab_size)
    if full is None:
        return None
    return megatron_to_hf(full, cfg, family)


async def push(
    client,
    named: Mapping[str, torch.Tensor],
    *,
    method: SyncMethod,
    weight_version: str,
    bucket_bytes: int = 512 << 20,
    model_cfg: ModelConfig | None = None,
    family: str | None = None,
    disk_dir: str | None = None,
) -> None:
    """Send HF-named weights to every server of ``client`` (an ``SGLangClient``)."""
    from megatron_grpo.rollout.weights import tensor_update_payload

    await client.pause_generation(mode="in_place")
    try:
        await client.flush_cache()
        if method == "tensor":
            await client.begin_weight_update()
            try:
                for bucket in buckets(named, bucket_bytes):
                    payload = tensor_update_payload(bucket, weight_version=weight_version)
                    await asyncio.gather(
                        *(client.update_weights_from_tensor(payload, url=u) for u in client.urls)
                    )
            finally:
                await client.end_weight_update()
        elif method == "disk":
            assert model_cfg is not None and family is not None
            path = Path(disk_dir or tempfile.mkdtemp(prefix="mgrpo_weights_"))
            save_hf_dir(named, model_cfg, family, path)
            await client.update_weights_from_disk(str(path), weight_version=weight_version)
        else:
            raise ValueError(f"unknown weight sync method {method!r}; expected tensor or disk")
    finally:
        await client.continue_generation()


def save_hf_dir(
    named: Mapping[str, torch.Tensor], cfg: ModelConfig, family: str, path: Path
) -> None:
    """A Hugging Face model directory (config.json + model.safetensors) for ``named``."""
    import safetensors.torch

    from megatron_grpo.hf_mapping import hf_config_from_model_config

    path.mkdir(parents=True, exist_ok=True)
    hf_config_from_model_config(cfg, family).save_pretrained(path)
    plain = {k: v.detach().contiguous().clone() for k, v in named.items()}
    safetensors.torch.save_file(plain, str(path / "model.safetensors"), metadata={"format": "pt"})
