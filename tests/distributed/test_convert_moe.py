"""Qwen3-MoE checkpoint conversion at TP2 x PP2 x EP2 (8 gloo processes), on tiny random
models: HF -> megatron -> HF is bitwise, and the megatron model loaded from the converted
checkpoint gives transformers' logits, at that layout and resharded to DP2 with EP2 or
EP1. Two routers: top-k renormalized (Qwen3-MoE's ``norm_topk_prob``) and not."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megatron_grpo.launch import run_workers
from megatron_grpo.testing import checkpoint_logits, random_hf_model, tiny_hf_config

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

HERE = Path(__file__)
VOCAB = 200
CASES = {"normalized": {"norm_topk_prob": True}, "unnormalized": {"norm_topk_prob": False}}
LOGIT_TOLERANCE = 1e-5
CONFIG_FIELDS = (
    "architectures",
    "model_type",
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "norm_topk_prob",
    "decoder_sparse_step",
    "mlp_only_layers",
    "hidden_size",
    "num_hidden_layers",
    "head_dim",
)


def safetensors_state(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        out |= load_file(file)
    return out


def load_resharded(cases: dict[str, dict], ep: int) -> dict:
    """DP2 worker at EP ``ep``: the logits of each case's TP2 x PP2 x EP2 checkpoint."""
    from megatron_grpo.commands.convert.hf_to_megatron import resolve_hf_model
    from megatron_grpo.config import ParallelDims
    from megatron_grpo.mcore.parallel import init_parallel

    ctx = init_parallel(ParallelDims(ep=ep))
    return {
        name: checkpoint_logits(
            ctx, resolve_hf_model(case["hf_dir"]), case["megatron_dir"], case["tokens"]
        )
        for name, case in cases.items()
    }


def convert_load_export(cases: dict[str, dict]) -> dict:
    """TP2 x PP2 x EP2 worker: each case HF -> megatron checkpoint -> (logits of a fresh
    model loaded from it, HF export)."""
    from megatron_grpo.commands.convert.hf_to_megatron import (
        check_hf_weights,
        convert_hf_on_ranks,
        resolve_hf_model,
    )
    from megatron_grpo.commands.convert.megatron_to_hf import export_on_ranks
    from megatron_grpo.config import ParallelDims
    from megatron_grpo.convert.hf_config import infer_family
    from megatron_grpo.convert.hf_files import HFCheckpoint, write_hf_config
    from megatron_grpo.mcore import checkpoint
    from megatron_grpo.mcore.model import build_model
    from megatron_grpo.mcore.parallel import init_parallel
    from megatron_grpo.train.save_hf import write_hf_model

    ctx = init_parallel(ParallelDims(tp=2, pp=2, ep=2))
    logits = {}
    for name, case in cases.items():
        cfg = resolve_hf_model(case["hf_dir"])
        check_hf_weights(HFCheckpoint(case["hf_dir"]), cfg, ctx.dims)
        convert_hf_on_ranks(ctx, case["hf_dir"], case["megatron_dir"], cfg)
        logits[name] = checkpoint_logits(ctx, cfg, case["megatron_dir"], case["tokens"])
        family = infer_family(cfg)
        export_on_ranks(ctx, case["megatron_dir"], case["export_dir"], cfg, family)
        if ctx.is_main:
            write_hf_config(Path(case["export_dir"]), cfg, family, torch.float32, None)
        # what train.save_hf_interval writes: every stage its layers, the experts over EP
        model = build_model(cfg, ctx)
        checkpoint.load_model(model, case["megatron_dir"])
        Path(case["saved_dir"]).mkdir(parents=True, exist_ok=True)
        write_hf_model(model, cfg, ctx, Path(case["saved_dir"]), None, None)
    return {"logits": logits, "ep_rank": ctx.ep_rank}


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("moe")
    cases, sources = {}, {}
    for name, overrides in CASES.items():
        model = random_hf_model(tiny_hf_config("qwen3_moe", vocab_size=VOCAB, **overrides))
        model.save_pretrained(root / name / "source")
        tokens = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            sources[name] = {"dir": root / name / "source", "logits": model(tokens).logits}
        cases[name] = {
            "hf_dir": str(root / name / "source"),
            "megatron_dir": str(root / name / "megatron"),
            "export_dir": str(root / name / "hf"),
            "saved_dir": str(root / name / "saved"),
            "tokens": tokens,
        }
    results = run_workers(f"{HERE}:convert_load_export", 8, kwargs={"cases": cases}, timeout=420)
    assert sorted(r["ep_rank"] for r in results) == [0] * 4 + [1] * 4
    logits = {n: next(r["logits"][n] for r in results if r["logits"][n] is not None) for n in cases}
    return {"cases": cases, "sources": sources, "logits": logits}


@pytest.mark.parametrize("name", list(CASES))
def test_round_trip_at_tp2_pp2_ep2_is_bitwise(launched, name):
    source_dir = launched["sources"][name]["dir"]
    export_dir = Path(launched["cases"][name]["export_dir"])
    want, got = safetensors_state(source_dir), safetensors_state(export_dir)
    assert any(".mlp.experts.3.down_proj." in k for k in want)
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) and got[k].dtype == want[k].dtype for k in want)
    want_cfg = json.loads((source_dir / "config.json").read_text())
    got_cfg = json.loads((export_dir / "config.json").read_text())
    for field in CONFIG_FIELDS:
        assert got_cfg.get(field) == want_cfg.get(field), field


@pytest.mark.parametrize("name", list(CASES))
def test_every_stage_writes_its_layers_and_experts_as_the_source_had_them(launched, name):
    """``save_hf``'s writer at TP2 x PP2 x EP2 (DP2): the source's tensors, bitwise, one
    file per stage."""
    saved = Path(launched["cases"][name]["saved_dir"])
    want, got = safetensors_state(launched["sources"][name]["dir"]), safetensors_state(saved)
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) and got[k].dtype == want[k].dtype for k in want)
    index = json.loads((saved / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 2


@pytest.mark.parametrize("name", list(CASES))
def test_megatron_logits_at_tp2_pp2_ep2_match_transformers(launched, name):
    got, want = launched["logits"][name], launched["sources"][name]["logits"]
    assert got.shape == want.shape
    diff = (got - want).abs().max().item()
    print(f"{name}: max |megatron - transformers| = {diff:.2e}, max |logit| {want.abs().max():.2f}")
    assert diff < LOGIT_TOLERANCE


@pytest.mark.parametrize("ep", [2, 1])
def test_the_checkpoint_reshards_over_ep(launched, ep):
    """Saved at TP2 x PP2 x EP2, loaded at TP1 x PP1 on 2 ranks with EP2 (other experts per
    rank) and EP1 (every expert on each rank)."""
    results = run_workers(
        f"{HERE}:load_resharded", 2, kwargs={"cases": launched["cases"], "ep": ep}, timeout=240
    )
    for name in CASES:
        got, want = results[0][name], launched["sources"][name]["logits"]
        diff = (got - want).abs().max().item()
        print(f"{name} at EP{ep}: max |megatron - transformers| = {diff:.2e}")
        assert diff < LOGIT_TOLERANCE
