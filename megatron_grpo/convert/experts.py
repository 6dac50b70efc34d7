"""Names and layout of a mixture-of-experts layer's weights (Qwen3-MoE), HF <-> megatron.

A MoE layer holds a router and ``num_experts`` SwiGLU experts, no shared expert:

    HF (as saved)                                 megatron (TP=1, PP=1, EP=1)
    mlp.gate.weight [E, H]                        mlp.router.weight
    mlp.experts.{e}.gate_proj / up_proj [I, H]    mlp.experts.local_experts.{e}.linear_fc1.weight
                                                  ([gate; up], [2I, H])
    mlp.experts.{e}.down_proj [H, I]              mlp.experts.local_experts.{e}.linear_fc2.weight

Under expert parallelism a rank holds experts ``[ep_rank * E / ep, (ep_rank + 1) * E / ep)``
and names them from 0 (``local_experts.{e - ep_rank * E / ep}``); full names use the
global index. Expert TP is 1: every expert is whole on the ranks that hold it.

megatron-core's sharded state dict stacks the experts of all layers into one tensor with
two prepended axes (layer, expert): ``decoder.layers.mlp.experts.experts.linear_fc1.weight``
of shape [layers, E, 2I, H]; ``unstack_expert_axes`` names its slices.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch
from torch import Tensor

from megatron_grpo.config import ModelConfig

_LOCAL_EXPERT = re.compile(r"^(.*\.mlp\.experts\.local_experts\.)(\d+)(\..+)$")
_STACKED_KEY = "layers.mlp.experts.experts."


def _per_expert(cfg: ModelConfig, pairs: list[tuple[str, str]]) -> list[tuple[str, str]]:
    assert cfg.num_experts is not None
    return [(a.format(e=e), b.format(e=e)) for e in range(cfg.num_experts) for a, b in pairs]


def moe_renamed(cfg: ModelConfig) -> list[tuple[str, str]]:
    """(HF suffix, megatron suffix) of a MoE layer's tensors that are only renamed."""
    down = [("mlp.experts.{e}.down_proj.weight", "mlp.experts.local_experts.{e}.linear_fc2.weight")]
    return [("mlp.gate.weight", "mlp.router.weight"), *_per_expert(cfg, down)]


def moe_gate_up(cfg: ModelConfig) -> list[tuple[str, str, str]]:
    """(HF gate suffix, HF up suffix, megatron fused ``linear_fc1`` suffix) per expert."""
    assert cfg.num_experts is not None
    return [
        (
            f"mlp.experts.{e}.gate_proj.weight",
            f"mlp.experts.{e}.up_proj.weight",
            f"mlp.experts.local_experts.{e}.linear_fc1.weight",
        )
        for e in range(cfg.num_experts)
    ]


def moe_hf_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Expected shape of a MoE layer's HF tensors, keyed by suffix."""
    assert cfg.num_experts is not None
    hidden, width = cfg.hidden_size, cfg.expert_ffn_hidden_size
    shapes: dict[str, tuple[int, ...]] = {"mlp.gate.weight": (cfg.num_experts, hidden)}
    for e in range(cfg.num_experts):
        shapes[f"mlp.experts.{e}.gate_proj.weight"] = (width, hidden)
        shapes[f"mlp.experts.{e}.up_proj.weight"] = (width, hidden)
        shapes[f"mlp.experts.{e}.down_proj.weight"] = (hidden, width)
    return shapes


def expert_index(name: str) -> int | None:
    """The expert index in a megatron parameter name, or None outside the experts."""
    match = _LOCAL_EXPERT.match(name)
    return int(match.group(2)) if match else None


def with_expert_index(name: str, index: int) -> str:
    """``name`` with its expert index replaced (local <-> global expert names)."""
    match = _LOCAL_EXPERT.match(name)
    if match is None:
        raise ValueError(f"{name!r} is not an expert parameter")
    return f"{match.group(1)}{index}{match.group(3)}"


def global_expert_name(name: str, ep_rank: int, num_local_experts: int) -> str:
    """The full (EP=1) name of a rank's local expert parameter; other names unchanged."""
    local = expert_index(name)
    if local is None:
        return name
    return with_expert_index(name, ep_rank * num_local_experts + local)


def unstack_expert_axes(key: str, full: Tensor) -> dict[str, Tensor]:
    """Per-layer, per-expert state-dict names of a sharded-state-dict tensor with two
    prepended axes (layer, expert): ``decoder.layers.mlp.experts.experts.linear_fc1.weight``
    [layers, E, 2I, H] gives ``decoder.layers.{i}.mlp.experts.local_experts.{e}.linear_fc1.weight``.
    """
    stem, found, leaf = key.partition(_STACKED_KEY)
    if not found:
        raise ValueError(f"{key}: two prepended axes, but not a stacked expert weight")
    return {
        f"{stem}layers.{i}.mlp.experts.local_experts.{e}.{leaf}": full[i, e]
        for i in range(full.shape[0])
        for e in range(full.shape[1])
    }


_LAYER_STACK = re.compile(r"^(decoder\.layers\.\d+\.mlp\.experts\.)experts\.(.+)$")


def split_stacked_experts(tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Per-expert names for one layer's experts read from a checkpoint as one tensor each
    (``decoder.layers.{i}.mlp.experts.experts.linear_fc1.weight`` [E, 2I, H]); other
    tensors unchanged."""
    out: dict[str, Tensor] = {}
    for name, tensor in tensors.items():
        match = _LAYER_STACK.match(name)
        if match is None:
            out[name] = tensor
            continue
        stem, leaf = match.groups()
        out |= {f"{stem}local_experts.{e}.{leaf}": tensor[e] for e in range(tensor.shape[0])}
    return out


# --------------------------------------------------------------------------- transformers


def fuse_hf_experts(hf_tensors: Mapping[str, Tensor], num_layers: int) -> dict[str, Tensor]:
    """Saved (one tensor per expert projection) -> transformers 5's in-memory Qwen3-MoE
    layout: ``mlp.experts.gate_up_proj`` [E, 2I, H] (each expert ``[gate; up]``) and
    ``mlp.experts.down_proj`` [E, H, I]. Other tensors unchanged."""
    out = {k: v for k, v in hf_tensors.items() if ".mlp.experts." not in k}
    for i in range(num_layers):
        pre = f"model.layers.{i}.mlp.experts."
        num_experts = sum(
            1 for k in hf_tensors if k.startswith(pre) and k.endswith("down_proj.weight")
        )
        proj = [
            {p: hf_tensors[f"{pre}{e}.{p}_proj.weight"] for p in ("gate", "up", "down")}
            for e in range(num_experts)
        ]
        out[pre + "gate_up_proj"] = torch.stack([torch.cat([x["gate"], x["up"]]) for x in proj])
        out[pre + "down_proj"] = torch.stack([x["down"] for x in proj])
    return out


def split_hf_experts(hf_tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """transformers 5's fused in-memory expert tensors -> the saved per-expert names;
    inverse of ``fuse_hf_experts``."""
    out: dict[str, Tensor] = {}
    for name, tensor in hf_tensors.items():
        pre, _, leaf = name.rpartition(".mlp.experts.")
        if leaf == "gate_up_proj":
            for e, fused in enumerate(tensor):
                gate, up = fused.chunk(2, dim=0)
                out[f"{pre}.mlp.experts.{e}.gate_proj.weight"] = gate
                out[f"{pre}.mlp.experts.{e}.up_proj.weight"] = up
        elif leaf == "down_proj":
            out |= {f"{pre}.mlp.experts.{e}.down_proj.weight": t for e, t in enumerate(tensor)}
        else:
            out[name] = tensor
    return out
