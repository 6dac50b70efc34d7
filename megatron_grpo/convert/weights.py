"""Parameter names and layout of full (TP=1, PP=1) weights, HF <-> megatron.

Everything works on plain dicts of tensors, one decoder layer at a time, so a
caller can stream a checkpoint: group the HF keys with ``hf_keys_by_layer``,
read one layer's tensors, convert them, write or load them, drop them.

Megatron names are those of a TP=1, PP=1 ``GPTModel.state_dict()`` built
with the local layer spec (``decoder.layers.{i}.input_layernorm.weight``).
The Transformer Engine spec fuses the two pre-norms into the following
linear layers (``...linear_qkv.layer_norm_weight``); ``fused_norms=True``
produces those names, and every megatron -> HF function accepts either.
``_extra_state`` entries carry no weights and are ignored.

A mixture-of-experts layer (Qwen3-MoE) has a router and experts where a dense one has its
MLP; their names are ``convert.experts``'s.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

import torch

from megatron_grpo.config import ModelConfig
from megatron_grpo.config.hf import Family, check_family, get_family, head_dim, query_groups
from megatron_grpo.convert.experts import moe_gate_up, moe_hf_shapes, moe_renamed
from megatron_grpo.convert.layout import (
    fuse_gate_up,
    fuse_qkv,
    resize_vocab,
    split_gate_up,
    split_qkv,
)

Tensors = Mapping[str, torch.Tensor]

HF_EMBEDDING = "model.embed_tokens.weight"
HF_FINAL_NORM = "model.norm.weight"
HF_OUTPUT = "lm_head.weight"
MEGATRON_EMBEDDING = "embedding.word_embeddings.weight"
MEGATRON_FINAL_NORM = "decoder.final_layernorm.weight"
MEGATRON_OUTPUT = "output_layer.weight"

# Local-spec name -> Transformer Engine name of the norms TE fuses into linears.
_TE_NORM_NAMES = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}
_LOCAL_NORM_NAMES = {te: local for local, te in _TE_NORM_NAMES.items()}
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_MEGATRON_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_IGNORED_HF_SUFFIXES = ("rotary_emb.inv_freq",)  # a buffer older transformers saved


# --------------------------------------------------------------------------- names


def _renamed(cfg: ModelConfig) -> list[tuple[str, str]]:
    """(HF suffix, megatron suffix) of the layer tensors that are only renamed."""
    pairs = [
        ("input_layernorm.weight", "input_layernorm.weight"),
        ("self_attn.o_proj.weight", "self_attention.linear_proj.weight"),
        ("post_attention_layernorm.weight", "pre_mlp_layernorm.weight"),
    ]
    pairs += moe_renamed(cfg) if cfg.is_moe else [("mlp.down_proj.weight", "mlp.linear_fc2.weight")]
    if cfg.qk_layernorm:
        pairs += [
            ("self_attn.q_norm.weight", "self_attention.q_layernorm.weight"),
            ("self_attn.k_norm.weight", "self_attention.k_layernorm.weight"),
        ]
    return pairs


def _gate_up(cfg: ModelConfig) -> list[tuple[str, str, str]]:
    """(HF gate suffix, HF up suffix, megatron fused ``linear_fc1`` suffix) of each MLP."""
    if cfg.is_moe:
        return moe_gate_up(cfg)
    return [("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.linear_fc1.weight")]


def _fused_name(name: str, cfg: ModelConfig) -> str:
    """The Transformer Engine spec name; its MoE layer keeps a separate pre-MLP norm."""
    if cfg.is_moe and name.endswith("pre_mlp_layernorm.weight"):
        return name
    return te_megatron_name(name)


def _qkv_params(cfg: ModelConfig) -> list[str]:
    return ["weight", "bias"] if cfg.add_qkv_bias else ["weight"]


def _hf_layer_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Expected shape of every HF tensor of one layer, keyed by suffix."""
    hd, hidden, ffn = head_dim(cfg), cfg.hidden_size, cfg.ffn_hidden_size
    q_out, kv_out = cfg.num_attention_heads * hd, query_groups(cfg) * hd
    shapes: dict[str, tuple[int, ...]] = {
        "input_layernorm.weight": (hidden,),
        "self_attn.q_proj.weight": (q_out, hidden),
        "self_attn.k_proj.weight": (kv_out, hidden),
        "self_attn.v_proj.weight": (kv_out, hidden),
        "self_attn.o_proj.weight": (hidden, q_out),
        "post_attention_layernorm.weight": (hidden,),
    }
    if cfg.is_moe:
        shapes |= moe_hf_shapes(cfg)
    else:
        shapes |= {"mlp.gate_proj.weight": (ffn, hidden), "mlp.up_proj.weight": (ffn, hidden)}
        shapes |= {"mlp.down_proj.weight": (hidden, ffn)}
    if cfg.add_qkv_bias:
        shapes |= {"self_attn.q_proj.bias": (q_out,), "self_attn.k_proj.bias": (kv_out,)}
        shapes |= {"self_attn.v_proj.bias": (kv_out,)}
    if cfg.qk_layernorm:
        shapes |= {"self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,)}
    return shapes


def _megatron_layer_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Expected shape of every full megatron tensor of one layer, keyed by local-spec suffix."""
    hf = _hf_layer_shapes(cfg)
    shapes = {m: hf[h] for h, m in _renamed(cfg)}
    for p in _qkv_params(cfg):
        q, k, v = (hf[f"self_attn.{x}_proj.{p}"] for x in "qkv")
        shapes[f"self_attention.linear_qkv.{p}"] = (q[0] + k[0] + v[0], *q[1:])
    for gate, up, fc1 in _gate_up(cfg):
        shapes[fc1] = (hf[gate][0] + hf[up][0], *hf[gate][1:])
    return shapes


def _check_shapes(
    tensors: Tensors, prefix: str, shapes: Mapping[str, tuple[int, ...]], what: str
) -> None:
    for suffix, shape in shapes.items():
        got = tuple(tensors[prefix + suffix].shape)
        if got != shape:
            raise ValueError(
                f"{what} weight {prefix + suffix!r} has shape {got}, "
                f"the model config expects {shape}"
            )


def hf_layer_keys(layer_idx: int, cfg: ModelConfig) -> list[str]:
    """The HF tensor names that make up decoder layer ``layer_idx``."""
    return [f"model.layers.{layer_idx}.{s}" for s in _hf_layer_shapes(cfg)]


def megatron_layer_keys(
    layer_idx: int, cfg: ModelConfig, *, fused_norms: bool = False
) -> list[str]:
    """The megatron tensor names of decoder layer ``layer_idx`` (``_extra_state`` excluded)."""
    suffixes = [m for _, m in _renamed(cfg)]
    suffixes += [f"self_attention.linear_qkv.{p}" for p in _qkv_params(cfg)]
    suffixes += [fc1 for _, _, fc1 in _gate_up(cfg)]
    names = [f"decoder.layers.{layer_idx}.{s}" for s in suffixes]
    return [_fused_name(n, cfg) for n in names] if fused_norms else names


def hf_global_keys(cfg: ModelConfig) -> list[str]:
    """HF tensors outside the decoder layers; no ``lm_head`` when embeddings are tied."""
    return [HF_EMBEDDING, HF_FINAL_NORM] + ([] if cfg.tie_embeddings else [HF_OUTPUT])


def megatron_global_keys(cfg: ModelConfig) -> list[str]:
    """Megatron tensors outside the decoder layers; no output layer when tied."""
    tied = cfg.tie_embeddings
    return [MEGATRON_EMBEDDING, MEGATRON_FINAL_NORM] + ([] if tied else [MEGATRON_OUTPUT])


def hf_key_layer(name: str) -> int | None:
    """The decoder layer an HF tensor belongs to, or None for embedding / final norm / head."""
    match = _HF_LAYER.match(name)
    return int(match.group(1)) if match else None


def megatron_key_layer(name: str) -> int | None:
    """The decoder layer index in a megatron name, or None outside the decoder layers."""
    match = _MEGATRON_LAYER.match(name)
    return int(match.group(1)) if match else None


def with_layer_index(name: str, layer_idx: int) -> str:
    """``name`` with its decoder layer index replaced (global <-> pipeline-local names)."""
    match = _MEGATRON_LAYER.match(name)
    if match is None:
        raise ValueError(f"{name!r} is not a decoder layer parameter")
    return f"decoder.layers.{layer_idx}.{match.group(2)}"


def hf_keys_by_layer(names: Iterable[str]) -> dict[int | None, list[str]]:
    """HF names grouped by decoder layer (key None: embedding, final norm, head).

    Feed it the keys of a safetensors index's ``weight_map`` to read a
    checkpoint one layer at a time.
    """
    groups: dict[int | None, list[str]] = {}
    for name in names:
        if not name.endswith(_IGNORED_HF_SUFFIXES):
            groups.setdefault(hf_key_layer(name), []).append(name)
    return groups


def _rename_suffix(name: str, table: Mapping[str, str]) -> str:
    match = _MEGATRON_LAYER.match(name)
    if match is None:
        return name
    layer, suffix = match.groups()
    return f"decoder.layers.{layer}.{table.get(suffix, suffix)}"


def canonical_megatron_name(name: str) -> str:
    """The local-spec name of a megatron parameter given either spec's name."""
    return _rename_suffix(name, _LOCAL_NORM_NAMES)


def te_megatron_name(name: str) -> str:
    """The Transformer Engine spec name of a local-spec megatron parameter name."""
    return _rename_suffix(name, _TE_NORM_NAMES)


def _canonical(tensors: Tensors) -> dict[str, torch.Tensor]:
    """Local-spec names, ``_extra_state`` dropped."""
    return {
        canonical_megatron_name(k): v for k, v in tensors.items() if not k.endswith("_extra_state")
    }


def _check_keys(got: Iterable[str], expected: Iterable[str], what: str, optional=()) -> None:
    got, expected = set(got), set(expected)
    missing = sorted(expected - got)
    if missing:
        raise ValueError(f"missing {what} weight {missing[0]!r}")
    unexpected = sorted(got - expected - set(optional))
    if unexpected:
        raise ValueError(
            f"unexpected {what} weight {unexpected[0]!r}; does the model config "
            "(qkv bias, qk norm, tied embeddings, number of layers, experts) match the checkpoint?"
        )


# --------------------------------------------------------------------------- layers


def hf_layer_to_megatron(
    layer_idx: int, hf_tensors: Tensors, cfg: ModelConfig, *, fused_norms: bool = False
) -> dict[str, torch.Tensor]:
    """Megatron tensors of decoder layer ``layer_idx`` from exactly that layer's HF tensors."""
    hf_pre, mc_pre = f"model.layers.{layer_idx}.", f"decoder.layers.{layer_idx}."
    hf = {k: v for k, v in hf_tensors.items() if not k.endswith(_IGNORED_HF_SUFFIXES)}
    shapes = _hf_layer_shapes(cfg)
    _check_keys(hf, [hf_pre + s for s in shapes], "HF")
    _check_shapes(hf, hf_pre, shapes, "HF")
    out = {mc_pre + m: hf[hf_pre + h] for h, m in _renamed(cfg)}
    for p in _qkv_params(cfg):
        q, k, v = (hf[f"{hf_pre}self_attn.{x}_proj.{p}"] for x in "qkv")
        out[f"{mc_pre}self_attention.linear_qkv.{p}"] = fuse_qkv(
            q, k, v, num_query_groups=query_groups(cfg)
        )
    for gate, up, fc1 in _gate_up(cfg):
        out[mc_pre + fc1] = fuse_gate_up(hf[hf_pre + gate], hf[hf_pre + up])
    return {_fused_name(k, cfg): v for k, v in out.items()} if fused_norms else out


def megatron_layer_to_hf(
    layer_idx: int, mcore_tensors: Tensors, cfg: ModelConfig
) -> dict[str, torch.Tensor]:
    """HF tensors of decoder layer ``layer_idx`` from that layer's full megatron tensors."""
    hf_pre, mc_pre = f"model.layers.{layer_idx}.", f"decoder.layers.{layer_idx}."
    mc = _canonical(mcore_tensors)
    _check_keys(mc, megatron_layer_keys(layer_idx, cfg), "megatron")
    _check_shapes(mc, mc_pre, _megatron_layer_shapes(cfg), "megatron")
    out = {hf_pre + h: mc[mc_pre + m] for h, m in _renamed(cfg)}
    for p in _qkv_params(cfg):
        q, k, v = split_qkv(
            mc[f"{mc_pre}self_attention.linear_qkv.{p}"],
            num_attention_heads=cfg.num_attention_heads,
            num_query_groups=query_groups(cfg),
            head_dim=head_dim(cfg),
        )
        out |= {f"{hf_pre}self_attn.{x}_proj.{p}": t for x, t in zip("qkv", (q, k, v))}
    for gate, up, fc1 in _gate_up(cfg):
        out[hf_pre + gate], out[hf_pre + up] = split_gate_up(mc[mc_pre + fc1])
    return out


# --------------------------------------------------------------------------- embedding, head


def hf_globals_to_megatron(hf_tensors: Tensors, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Embedding, final norm and output layer, vocab padded to ``padded_vocab_size(1)``.

    With tied embeddings an ``lm_head.weight`` (an in-memory HF state dict has
    one) is accepted and dropped: it is the embedding.
    """
    optional = [HF_OUTPUT] if cfg.tie_embeddings else []
    _check_keys(hf_tensors, hf_global_keys(cfg), "HF", optional)
    rows = cfg.padded_vocab_size(1)
    out = {}
    for hf_name, mc_name in ((HF_EMBEDDING, MEGATRON_EMBEDDING), (HF_OUTPUT, MEGATRON_OUTPUT)):
        if hf_name in hf_global_keys(cfg):
            weight = hf_tensors[hf_name]
            if weight.shape[0] != cfg.vocab_size:
                raise ValueError(
                    f"HF weight {hf_name!r} has {weight.shape[0]} rows "
                    f"but model.vocab_size={cfg.vocab_size}"
                )
            out[mc_name] = resize_vocab(weight, rows)
    out[MEGATRON_FINAL_NORM] = hf_tensors[HF_FINAL_NORM]
    return out


def megatron_globals_to_hf(mcore_tensors: Tensors, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """HF embedding, final norm and head; the vocab padding rows are dropped."""
    mc = _canonical(mcore_tensors)
    optional = [MEGATRON_OUTPUT] if cfg.tie_embeddings else []
    _check_keys(mc, megatron_global_keys(cfg), "megatron", optional)
    out = {HF_EMBEDDING: resize_vocab(mc[MEGATRON_EMBEDDING], cfg.vocab_size)}
    out[HF_FINAL_NORM] = mc[MEGATRON_FINAL_NORM]
    if not cfg.tie_embeddings:
        out[HF_OUTPUT] = resize_vocab(mc[MEGATRON_OUTPUT], cfg.vocab_size)
    return out


# --------------------------------------------------------------------------- whole models


def _check_layer_range(groups: Mapping[int | None, object], num_layers: int, what: str) -> None:
    extra = sorted(i for i in groups if i is not None and i >= num_layers)
    if extra:
        raise ValueError(f"{what} weights for layer {extra[0]} but model.num_layers={num_layers}")


def hf_to_megatron(
    hf_state_dict: Tensors, cfg: ModelConfig, *, fused_norms: bool = False
) -> dict[str, torch.Tensor]:
    """A full megatron (TP=1, PP=1) state dict from a full HF one."""
    groups = hf_keys_by_layer(hf_state_dict)
    _check_layer_range(groups, cfg.num_layers, "HF")
    out = hf_globals_to_megatron({k: hf_state_dict[k] for k in groups.get(None, [])}, cfg)
    for i in range(cfg.num_layers):
        layer = {k: hf_state_dict[k] for k in groups.get(i, [])}
        out |= hf_layer_to_megatron(i, layer, cfg, fused_norms=fused_norms)
    return out


def megatron_to_hf(
    mcore_state_dict: Tensors, cfg: ModelConfig, family: str | Family
) -> dict[str, torch.Tensor]:
    """A full HF state dict of ``family`` (as saved: no ``lm_head`` when tied) from megatron's."""
    check_family(cfg, get_family(family) if isinstance(family, str) else family)
    mc = _canonical(mcore_state_dict)
    groups: dict[int | None, list[str]] = {}
    for name in mc:
        groups.setdefault(megatron_key_layer(name), []).append(name)
    _check_layer_range(groups, cfg.num_layers, "megatron")
    out = megatron_globals_to_hf({k: mc[k] for k in groups.get(None, [])}, cfg)
    for i in range(cfg.num_layers):
        out |= megatron_layer_to_hf(i, {k: mc[k] for k in groups.get(i, [])}, cfg)
    return out
