"""HF <-> megatron weight mapping: layouts, names, sharding, and logits parity.

The pure conversions run in the pytest process on tiny random HF models.
The parity checks build a real megatron GPTModel, so they run in worker
processes (megatron's parallel state is process-global).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import transformers

from megatron_grpo.config import ModelConfig
from megatron_grpo.config.hf import check_hf_config, model_config_from_hf
from megatron_grpo.convert.hf_config import hf_config_from_model_config
from megatron_grpo.convert.layout import fuse_qkv, split_qkv
from megatron_grpo.convert.sharding import (
    chunk_layer_range,
    layer_location,
    shard_for_rank,
    unshard,
)
from megatron_grpo.convert.weights import (
    hf_keys_by_layer,
    hf_layer_keys,
    hf_layer_to_megatron,
    hf_to_megatron,
    megatron_layer_to_hf,
    megatron_to_hf,
)
from megatron_grpo.launch import run_workers
from megatron_grpo.testing import random_hf_model, tiny_hf_config

HERE = Path(__file__)
VOCAB = 200

# (family, tied embeddings): every family, plus tied variants.
CASES = [("llama", False), ("qwen2", False), ("qwen3", False), ("llama", True), ("qwen2", True)]


def hf_state(family: str, tied: bool = False, **overrides) -> tuple[dict, ModelConfig]:
    hf_config = tiny_hf_config(family, tied=tied, **overrides)
    state = random_hf_model(hf_config).state_dict()
    return state, model_config_from_hf(hf_config)


# --------------------------------------------------------------------------- layouts


def test_fused_qkv_is_laid_out_per_query_group():
    # 4 query heads in 2 groups, head_dim 1: [q0 q1 k0 v0 | q2 q3 k1 v1].
    q, k, v = torch.tensor([0.0, 1, 2, 3]), torch.tensor([10.0, 11]), torch.tensor([20.0, 21])
    fused = fuse_qkv(q, k, v, num_query_groups=2)
    assert fused.tolist() == [0, 1, 10, 20, 2, 3, 11, 21]
    back = split_qkv(fused, num_attention_heads=4, num_query_groups=2, head_dim=1)
    assert [t.tolist() for t in back] == [q.tolist(), k.tolist(), v.tolist()]


def test_fc1_shard_holds_its_own_gate_and_up():
    cfg = ModelConfig(hidden_size=1, ffn_hidden_size=4, num_attention_heads=1)
    fc1 = torch.tensor([0.0, 1, 2, 3, 10, 11, 12, 13])[:, None]  # [gate; up]
    shard = shard_for_rank("decoder.layers.0.mlp.linear_fc1.weight", fc1, 1, 2, cfg)
    assert shard[:, 0].tolist() == [2, 3, 12, 13]


# --------------------------------------------------------------------------- full round trip


@pytest.mark.parametrize("family,tied", CASES)
def test_hf_megatron_hf_round_trip_is_bitwise(family, tied):
    state, cfg = hf_state(family, tied)
    mcore = hf_to_megatron(state, cfg)
    embedding = mcore["embedding.word_embeddings.weight"]
    assert embedding.shape[0] == cfg.padded_vocab_size(1) == 256
    assert torch.equal(embedding[:VOCAB], state["model.embed_tokens.weight"])
    assert not embedding[VOCAB:].any()  # padding rows are zeros
    assert ("output_layer.weight" in mcore) is not tied

    back = megatron_to_hf(mcore, cfg, family)
    expected = {k: v for k, v in state.items() if not (tied and k == "lm_head.weight")}
    assert back.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(back[name], tensor), name


def test_transformer_engine_norm_names_round_trip():
    state, cfg = hf_state("qwen3")
    mcore = hf_to_megatron(state, cfg, fused_norms=True)
    assert "decoder.layers.1.self_attention.linear_qkv.layer_norm_weight" in mcore
    assert "decoder.layers.1.mlp.linear_fc1.layer_norm_weight" in mcore
    assert not any("input_layernorm" in k or "pre_mlp_layernorm" in k for k in mcore)
    mcore["decoder.layers.0.self_attention.linear_qkv._extra_state"] = None  # ignored
    back = megatron_to_hf(mcore, cfg, "Qwen3ForCausalLM")
    assert all(torch.equal(back[k], state[k]) for k in state)


def test_layer_by_layer_conversion_matches_the_full_one():
    state, cfg = hf_state("qwen2")
    full = hf_to_megatron(state, cfg)
    groups = hf_keys_by_layer(state)
    assert set(groups) == {None, 0, 1}
    for i in range(cfg.num_layers):
        assert sorted(groups[i]) == sorted(hf_layer_keys(i, cfg))
        layer = hf_layer_to_megatron(i, {k: state[k] for k in groups[i]}, cfg)
        assert all(torch.equal(full[k], v) for k, v in layer.items())
        back = megatron_layer_to_hf(i, layer, cfg)
        assert all(torch.equal(back[k], state[k]) for k in groups[i])


def test_missing_and_unexpected_weights_are_named():
    state, cfg = hf_state("qwen2")
    missing = {k: v for k, v in state.items() if k != "model.layers.1.self_attn.k_proj.bias"}
    with pytest.raises(ValueError, match=r"missing HF weight 'model\.layers\.1\.self_attn\.k_proj"):
        hf_to_megatron(missing, cfg)
    with pytest.raises(ValueError, match=r"unexpected HF weight .*_proj\.bias"):
        hf_to_megatron(state, dataclasses.replace(cfg, add_qkv_bias=False))
    with pytest.raises(ValueError, match="layer 1 but model.num_layers=1"):
        hf_to_megatron(state, dataclasses.replace(cfg, num_layers=1))


def test_wrong_shape_is_named():
    state, cfg = hf_state("llama")
    with pytest.raises(ValueError, match=r"q_proj\.weight' has shape \(64, 64\).*\(128, 64\)"):
        hf_to_megatron(state, dataclasses.replace(cfg, head_dim=32))


# --------------------------------------------------------------------------- tensor parallel


@pytest.mark.parametrize("tp", [2, 4])
def test_shard_unshard_round_trip_with_gqa(tp):
    # 8 heads in 4 groups so that TP=4 still holds whole groups; Qwen2 for the QKV bias.
    state, cfg = hf_state("qwen2", num_attention_heads=8, num_key_value_heads=4)
    full = hf_to_megatron(state, cfg)
    for name, tensor in full.items():
        shards = [shard_for_rank(name, tensor, r, tp, cfg) for r in range(tp)]
        assert torch.equal(unshard(name, shards, cfg), tensor), name

    # Each rank's QKV is the fused QKV of its own query groups' HF heads.
    qkv_name = "decoder.layers.0.self_attention.linear_qkv.weight"
    hf = {x: state[f"model.layers.0.self_attn.{x}_proj.weight"].chunk(tp) for x in "qkv"}
    for r in range(tp):
        want = fuse_qkv(hf["q"][r], hf["k"][r], hf["v"][r], num_query_groups=4 // tp)
        assert torch.equal(shard_for_rank(qkv_name, full[qkv_name], r, tp, cfg), want)

    emb_name, fc2_name = (
        "embedding.word_embeddings.weight",
        "decoder.layers.0.mlp.linear_fc2.weight",
    )
    emb = [shard_for_rank(emb_name, full[emb_name], r, tp, cfg) for r in range(tp)]
    assert [s.shape[0] for s in emb] == [cfg.padded_vocab_size(tp) // tp] * tp
    assert shard_for_rank(fc2_name, full[fc2_name], 0, tp, cfg).shape == (64, 128 // tp)


def test_unknown_parameter_has_no_tp_layout():
    name = "decoder.layers.0.mlp.shared_experts.gate_weight"  # no shared experts here
    with pytest.raises(ValueError, match=name):
        shard_for_rank(name, torch.zeros(2), 0, 2, ModelConfig())


# --------------------------------------------------------------------------- pipeline


def test_pipeline_layer_locations():
    assert list(chunk_layer_range(8, pp_rank=1, pp_size=2)) == [4, 5, 6, 7]
    # Interleaved: chunks go virtual stage first, then pipeline rank.
    assert list(chunk_layer_range(8, pp_rank=1, pp_size=2, vp_stage=1, vpp_size=2)) == [6, 7]
    assert tuple(layer_location(2, 8, pp_size=2, vpp_size=2)) == (1, 0, 0)
    for layer in range(8):
        loc = layer_location(layer, 8, pp_size=2, vpp_size=2)
        chunk = chunk_layer_range(8, loc.pp_rank, 2, loc.vp_stage, 2)
        assert chunk[loc.local_index] == layer
    with pytest.raises(ValueError, match="not divisible"):
        chunk_layer_range(6, pp_rank=0, pp_size=4)


# --------------------------------------------------------------------------- configs


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_model_config_from_hf_and_back(family):
    hf_config = tiny_hf_config(family)
    cfg = model_config_from_hf(hf_config)
    assert (cfg.num_query_groups, cfg.vocab_size, cfg.add_qkv_bias, cfg.qk_layernorm) == (
        2,
        VOCAB,
        family == "qwen2",
        family == "qwen3",
    )
    assert cfg.head_dim == (32 if family == "qwen3" else 16)
    check_hf_config(hf_config, cfg)
    exported = hf_config_from_model_config(cfg, family)
    assert exported.architectures == [f"{family.capitalize()}ForCausalLM"]
    assert model_config_from_hf(exported) == cfg
    check_hf_config(exported.to_dict(), cfg)  # a config.json dict works too


@pytest.mark.parametrize(
    "field,value,hf_name",
    [
        ("num_layers", 3, "num_hidden_layers"),
        ("hidden_size", 128, "hidden_size"),
        ("ffn_hidden_size", 256, "intermediate_size"),
        ("num_attention_heads", 2, "num_attention_heads"),
        ("num_query_groups", 4, "num_key_value_heads"),
        ("head_dim", 16, "head_dim"),
        ("rotary_base", 10000.0, "rope_theta"),
        ("vocab_size", 256, "vocab_size"),
        ("tie_embeddings", True, "tie_word_embeddings"),
        ("add_qkv_bias", True, "qkv bias"),
        ("qk_layernorm", False, "qk norm"),
    ],
)
def test_config_mismatch_names_the_field(field, value, hf_name):
    hf_config = tiny_hf_config("qwen3")
    cfg = dataclasses.replace(model_config_from_hf(hf_config), **{field: value})
    with pytest.raises(ValueError, match=rf"{hf_name}.*model\.{field}={value!r}"):
        check_hf_config(hf_config, cfg)


def test_unsupported_architectures_are_refused_by_name():
    with pytest.raises(ValueError, match="unsupported architecture 'MistralForCausalLM'"):
        model_config_from_hf(tiny_hf_config("llama", architectures=["MistralForCausalLM"]))
    with pytest.raises(ValueError, match="unsupported architecture 'gemma'"):
        model_config_from_hf({"model_type": "gemma"})
    with pytest.raises(ValueError, match="unsupported architecture 'mixtral'"):
        hf_config_from_model_config(ModelConfig(), "mixtral")


LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def test_llama3_rope_scaling_is_accepted_and_exported():
    hf_config = tiny_hf_config("llama", rope_scaling=LLAMA3_ROPE, max_position_embeddings=131072)
    cfg = model_config_from_hf(hf_config)
    assert cfg.rope_scaling_factor == 8.0
    check_hf_config(hf_config, cfg)
    exported = hf_config_from_model_config(cfg, "llama")
    assert exported.rope_parameters["rope_type"] == "llama3"
    assert model_config_from_hf(exported) == cfg
    # A 4.x config.json keeps rope_theta at top level and the rest in rope_scaling.
    legacy = {"architectures": ["LlamaForCausalLM"], "rope_theta": 500000.0}
    legacy |= {k: v for k, v in exported.to_dict().items() if k != "rope_parameters"}
    legacy["rope_scaling"] = LLAMA3_ROPE
    assert model_config_from_hf(legacy) == cfg
    with pytest.raises(ValueError, match=r"rope_scaling\.factor.*model\.rope_scaling_factor=None"):
        check_hf_config(hf_config, dataclasses.replace(cfg, rope_scaling_factor=None))
    with pytest.raises(ValueError, match="model.rope_scaling_factor must be > 0"):
        dataclasses.replace(cfg, rope_scaling_factor=0.0)


@pytest.mark.parametrize(
    "change,match",
    [
        ({"original_max_position_embeddings": 32}, "original_max_position_embeddings=32"),
        ({"low_freq_factor": 2.0}, "low_freq_factor=2.0"),
        ({"rope_type": "yarn"}, "rope_type='yarn'"),
    ],
)
def test_other_rope_scaling_is_refused_by_name(change, match):
    hf_config = tiny_hf_config("llama", max_position_embeddings=131072)
    hf_config.rope_parameters = hf_config.rope_parameters | LLAMA3_ROPE | change
    with pytest.raises(ValueError, match=match):
        model_config_from_hf(hf_config)


def test_unsupported_options_are_refused_by_name():
    with pytest.raises(ValueError, match="attention_bias"):
        model_config_from_hf(tiny_hf_config("llama", attention_bias=True))
    with pytest.raises(ValueError, match=r"model\.add_qkv_bias=True does not fit LlamaForCausalLM"):
        hf_config_from_model_config(ModelConfig(add_qkv_bias=True), "llama")


def test_exported_weights_load_into_transformers():
    state, cfg = hf_state("qwen3", tied=True)
    exported = megatron_to_hf(hf_to_megatron(state, cfg), cfg, "qwen3")
    model = transformers.AutoModelForCausalLM.from_config(hf_config_from_model_config(cfg, "qwen3"))
    missing, unexpected = model.load_state_dict(exported, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied to the embedding
    assert torch.equal(model.lm_head.weight, state["model.embed_tokens.weight"])


# --------------------------------------------------------------------------- megatron parity


def megatron_logits_worker(hf_config, hf_state_dict: dict, input_ids: torch.Tensor, tp: int):
    """Logits of a megatron model loaded from HF weights (rank 0 returns the full vocab)."""
    import torch.distributed as dist

    from megatron_grpo.config import ParallelDims
    from megatron_grpo.mcore.full_state import load_full_state
    from megatron_grpo.mcore.model import build_model
    from megatron_grpo.mcore.parallel import init_parallel

    ctx = init_parallel(ParallelDims(tp=tp))
    cfg = model_config_from_hf(hf_config)
    (chunk,) = build_model(cfg, ctx, wrap_ddp=False)
    full = hf_to_megatron(hf_state_dict, cfg)
    if tp == 1:  # load by name: checks the names against the real model, not our own loader
        missing, unexpected = chunk.load_state_dict(full, strict=False)
        assert not unexpected, unexpected
        assert all(k.endswith("_extra_state") for k in missing), missing
    else:
        load_full_state([chunk], full, cfg, ctx)
    chunk.eval()
    batch, seq = input_ids.shape
    with torch.no_grad():
        logits = chunk(input_ids, torch.arange(seq).expand(batch, seq), None)
    shards = [torch.empty_like(logits) for _ in range(tp)]
    dist.all_gather(shards, logits.contiguous(), group=ctx.tp_group)
    return torch.cat(shards, dim=-1)[..., : cfg.vocab_size]


def _max_logit_diff(family: str, tied: bool, tp: int, **overrides) -> float:
    hf_config = tiny_hf_config(family, tied=tied, **overrides)
    model = random_hf_model(hf_config)
    input_ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(input_ids).logits
    kwargs = dict(hf_config=hf_config, hf_state_dict=model.state_dict(), input_ids=input_ids, tp=tp)
    got = run_workers(f"{HERE}:megatron_logits_worker", tp, kwargs=kwargs, timeout=120)[0]
    assert got.shape == want.shape
    diff = (got - want).abs().max().item()
    scale = want.abs().max().item()
    print(f"{family} tied={tied} tp={tp}: max |logit diff| {diff:.2e}, max |logit| {scale:.2f}")
    return diff


@pytest.mark.distributed
@pytest.mark.parametrize("family,tied", CASES)
def test_megatron_logits_match_transformers(family, tied):
    assert _max_logit_diff(family, tied, tp=1) < 1e-4


@pytest.mark.distributed
@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_megatron_logits_match_transformers_at_tp2(family):
    assert _max_logit_diff(family, False, tp=2) < 1e-4


def load_and_gather_worker(hf_config, hf_state_dict: dict, tp: int, pp: int, vpp: int | None):
    """Load full HF-converted weights into TP x PP chunks, gather them back, compare.

    Loads twice: with the vocab padded to ``padded_vocab_size(1)`` and with
    exactly ``vocab_size`` rows, as the gather returns them.
    """
    from megatron_grpo.config import ParallelDims
    from megatron_grpo.convert.layout import resize_vocab
    from megatron_grpo.convert.weights import canonical_megatron_name
    from megatron_grpo.mcore.full_state import gather_full_state, load_full_state
    from megatron_grpo.mcore.model import build_model
    from megatron_grpo.mcore.parallel import init_parallel

    ctx = init_parallel(ParallelDims(tp=tp, pp=pp, vpp=vpp))
    cfg = model_config_from_hf(hf_config)
    chunks = build_model(cfg, ctx, wrap_ddp=False)
    for vp_stage, chunk in enumerate(chunks):  # our layer split agrees with megatron's
        expected = chunk_layer_range(cfg.num_layers, ctx.pp_rank, pp, vp_stage, vpp)
        assert [layer.layer_number - 1 for layer in chunk.decoder.layers] == list(expected)
    padded = hf_to_megatron(hf_state_dict, cfg)
    exact = {
        k: resize_vocab(v, cfg.vocab_size) if "embedding" in k else v for k, v in padded.items()
    }
    same = []
    for full in (padded, exact):
        for chunk in chunks:
            for p in chunk.parameters():
                p.data.fill_(float("nan"))
        load_full_state(chunks, full, cfg, ctx)
        gathered = gather_full_state(chunks, ctx, vocab_size=cfg.vocab_size)
        if gathered is not None:  # global rank 0
            gathered = {canonical_megatron_name(k): v for k, v in gathered.items()}
            assert gathered.keys() == exact.keys(), sorted(set(gathered) ^ set(exact))
            same.append(all(torch.equal(gathered[k], exact[k]) for k in exact))
    return all(same)


@pytest.mark.distributed
def test_load_and_gather_round_trip_at_tp2_pp2_vpp2():
    hf_config = tiny_hf_config("qwen2", tied=True, num_hidden_layers=4)
    state = random_hf_model(hf_config).state_dict()
    kwargs = dict(hf_config=hf_config, hf_state_dict=state, tp=2, pp=2, vpp=2)
    assert all(run_workers(f"{HERE}:load_and_gather_worker", 4, kwargs=kwargs, timeout=180))
