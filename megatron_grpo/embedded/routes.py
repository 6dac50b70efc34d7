"""The experts a Hugging Face mixture-of-experts model routes each token to, by forward hooks.

A sparse MoE block of transformers (Qwen3-MoE, Qwen2-MoE, Mixtral, ...) has a router
``gate`` beside its ``experts``. In transformers 5 the router returns ``(logits, scores,
indices)``, the indices being the top-k experts; where it returns only the logits (a plain
``nn.Linear``, as in transformers 4), the block takes the top-k of their softmax, and so
does ``_top_k_ids``. A layer without such a block (dense) routes nowhere: its ids are 0,
as in SGLang's buffer (``megatron_grpo.sglang_api.protocol``).

``RouteRecorder`` hooks every router while it is entered; after each forward of the model,
``take`` returns that forward's ids as ``[batch, tokens, layers, topk]``. Nothing is hooked
outside it, so a model that nobody asks routes of runs as it would.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def moe_routers(model: nn.Module) -> list[nn.Module | None]:
    """Each decoder layer's router (its MLP's ``gate``), or None for a dense layer."""
    base = getattr(model, "model", model)
    layers = getattr(base, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__} has no decoder layers at .model.layers")
    routers: list[nn.Module | None] = []
    for layer in layers:
        mlp: Any = getattr(layer, "mlp", None) or getattr(layer, "block_sparse_moe", None)
        sparse = hasattr(mlp, "gate") and hasattr(mlp, "experts")
        routers.append(mlp.gate if sparse else None)
    return routers


def has_moe_layers(model: nn.Module) -> bool:
    """Whether ``model`` has a layer with a router that ``moe_routers`` finds."""
    try:
        return any(moe_routers(model))
    except ValueError:  # no decoder layers where transformers keeps them
        return False


def num_experts_per_token(model: nn.Module) -> int:
    """The model's top-k (``num_experts_per_tok`` of its config)."""
    top_k = getattr(model.config, "num_experts_per_tok", None)
    if not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"{type(model).__name__}'s config has no num_experts_per_tok >= 1")
    return top_k


class RouteRecorder:
    """Forward hooks on the routers of ``model`` (one with at least one MoE layer) that keep
    the expert ids of its latest forward; use as ``with RouteRecorder(model) as recorder``."""

    def __init__(self, model: nn.Module) -> None:
        self.routers = moe_routers(model)
        if not any(self.routers):
            raise ValueError(f"{type(model).__name__} has no mixture-of-experts layers")
        self.top_k = num_experts_per_token(model)
        self._ids: list[torch.Tensor | None] = [None] * len(self.routers)
        self._handles: list[Any] = []

    def __enter__(self) -> RouteRecorder:
        for layer, router in enumerate(self.routers):
            if router is not None:
                self._handles.append(router.register_forward_hook(self._hook(layer)))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def take(self, batch: int, tokens: int) -> torch.Tensor:
        """The ids of the latest forward, int32 ``[batch, tokens, layers, topk]``; a dense
        layer's are 0. Forgets them."""
        out = torch.zeros(batch, tokens, len(self.routers), self.top_k, dtype=torch.int32)
        for layer, ids in enumerate(self._ids):
            if ids is not None:
                out[:, :, layer] = ids.reshape(batch, tokens, self.top_k).cpu()
        self._ids = [None] * len(self.routers)
        return out

    def _hook(self, layer: int):
        def keep(module: nn.Module, args: Any, output: Any) -> None:
            self._ids[layer] = _top_k_ids(output, self.top_k)

        return keep


def _top_k_ids(output: Any, top_k: int) -> torch.Tensor:
    """A router's top-k expert ids ``[tokens, top_k]``: its returned indices, or the top-k
    of the softmax of its logits (in float32, as the HF blocks compute it)."""
    if isinstance(output, tuple):
        ids = output[-1]
        if ids.dtype.is_floating_point or ids.shape[-1] != top_k:
            raise ValueError(
                f"a router returned {len(output)} values, the last of shape {tuple(ids.shape)} "
                f"and dtype {ids.dtype}: not the top-{top_k} expert indices"
            )
        return ids.reshape(-1, top_k)
    probs = torch.softmax(output.reshape(-1, output.shape[-1]), dim=-1, dtype=torch.float)
    return torch.topk(probs, top_k, dim=-1).indices
