"""Hugging Face <-> megatron-core weight mapping: the one import point.

Shared by checkpoint conversion and by weight sync to inference engines.
Everything here except ``load_full_state`` / ``gather_full_state`` is pure and
works on dicts of tensors one decoder layer at a time, so memory stays
around one layer when a caller streams a checkpoint:

    groups = hf_keys_by_layer(weight_map)            # HF keys per layer
    for i in range(cfg.num_layers):
        mc = hf_layer_to_megatron(i, read(groups[i]), cfg)
        for name, full in mc.items():
            shard = shard_for_rank(name, full, tp_rank, tp_size, cfg)
            ...

The implementation lives in ``megatron_grpo.convert`` (config, layout,
names, sharding) and, for the two functions that touch a live model,
``megatron_grpo.full_state``; see each module for the layouts it encodes.
"""

from megatron_grpo.convert.hf_config import (
    FAMILIES,
    Family,
    check_family,
    check_hf_config,
    family_of,
    get_family,
    head_dim,
    hf_config_from_model_config,
    model_config_from_hf,
    query_groups,
)
from megatron_grpo.convert.layout import (
    fuse_gate_up,
    fuse_qkv,
    resize_vocab,
    split_gate_up,
    split_qkv,
)
from megatron_grpo.convert.sharding import (
    LayerLocation,
    chunk_layer_range,
    global_layer_index,
    layer_location,
    shard_for_rank,
    tp_layout,
    unshard,
)
from megatron_grpo.convert.weights import (
    canonical_megatron_name,
    hf_global_keys,
    hf_globals_to_megatron,
    hf_key_layer,
    hf_keys_by_layer,
    hf_layer_keys,
    hf_layer_to_megatron,
    hf_to_megatron,
    megatron_global_keys,
    megatron_globals_to_hf,
    megatron_key_layer,
    megatron_layer_keys,
    megatron_layer_to_hf,
    megatron_to_hf,
    te_megatron_name,
    with_layer_index,
)
from megatron_grpo.full_state import gather_full_state, load_full_state

__all__ = [
    "FAMILIES",
    "Family",
    "LayerLocation",
    "canonical_megatron_name",
    "check_family",
    "check_hf_config",
    "chunk_layer_range",
    "family_of",
    "fuse_gate_up",
    "fuse_qkv",
    "gather_full_state",
    "get_family",
    "global_layer_index",
    "head_dim",
    "hf_config_from_model_config",
    "hf_global_keys",
    "hf_globals_to_megatron",
    "hf_key_layer",
    "hf_keys_by_layer",
    "hf_layer_keys",
    "hf_layer_to_megatron",
    "hf_to_megatron",
    "layer_location",
    "load_full_state",
    "megatron_global_keys",
    "megatron_globals_to_hf",
    "megatron_key_layer",
    "megatron_layer_keys",
    "megatron_layer_to_hf",
    "megatron_to_hf",
    "model_config_from_hf",
    "query_groups",
    "resize_vocab",
    "shard_for_rank",
    "split_gate_up",
    "split_qkv",
    "te_megatron_name",
    "tp_layout",
    "unshard",
    "with_layer_index",
]
