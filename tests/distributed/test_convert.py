"""Checkpoint conversion end to end, on tiny random HF models (no downloads).

Launches, to fit 2 cores: ``megatron-grpo convert hf-to-megatron`` once
(TP1 x PP2, with a model config) and ``tools/convert_megatron_to_hf.py``, the
wrapper of ``megatron-grpo convert megatron-to-hf``, once (sharded output,
copied tokenizer); then one TP2 x PP2 launch of 4 processes that, for every case,
converts the HF checkpoint, loads the saved checkpoint into a fresh model
with ``checkpoint.load_model`` for its logits, and exports it back to HF. The
command lines' refusals exit before any worker starts.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
import yaml

from megatron_grpo.launch import run_workers
from megatron_grpo.testing import checkpoint_logits, random_hf_model
from megatron_grpo.testing import tiny_hf_config as _tiny_hf_config

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

HERE = Path(__file__)
ROOT = HERE.parents[2]
VOCAB = 200
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
# name -> (family, config overrides, sequence length)
CASES: dict[str, tuple[str, dict[str, Any], int]] = {
    "llama": ("llama", {}, 16),
    "qwen2": ("qwen2", {}, 16),  # QKV bias
    "qwen3": ("qwen3", {"head_dim": 32}, 16),  # q/k norm, head_dim != hidden / heads
    "qwen3-tied": ("qwen3", {"head_dim": 32, "tie_word_embeddings": True}, 16),
    # Long enough that the scaled low frequencies turn by a visible angle.
    "llama3-rope": (
        "llama",
        {"rope_scaling": LLAMA3_ROPE, "max_position_embeddings": 131072},
        320,
    ),
}
LOGIT_TOLERANCE = 1e-5
BF16_LOGIT_TOLERANCE = 0.1  # logits are ~3; a weight in the wrong place moves them by ~1


# --------------------------------------------------------------------------- HF side


def tiny_hf_config(family: str, **overrides):
    defaults = {"max_position_embeddings": 512, "bos_token_id": 1, "eos_token_id": 2}
    return _tiny_hf_config(family, vocab_size=VOCAB, **(defaults | overrides))


def save_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0")
    fast.save_pretrained(path)


def hf_logits(model_or_dir, tokens: torch.Tensor) -> torch.Tensor:
    model = model_or_dir
    if not isinstance(model, torch.nn.Module):
        model = transformers.AutoModelForCausalLM.from_pretrained(
            model_or_dir, attn_implementation="eager"
        ).eval()
    with torch.no_grad():
        return model(tokens).logits


def safetensors_state(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        out |= load_file(file)
    return out


def run_command(*argv: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *argv], capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )


def run_cli(*args: str) -> subprocess.CompletedProcess:
    """``megatron-grpo convert ...``"""
    return run_command("-m", "megatron_grpo.cli", "convert", *args)


def run_tool(name: str, *args: str) -> subprocess.CompletedProcess:
    """``python tools/<name> ...``"""
    return run_command(str(ROOT / "tools" / name), *args)


# --------------------------------------------------------------------------- workers


def convert_load_export(cases: dict[str, dict], cli: dict) -> dict:
    """TP2 x PP2 worker: each case HF -> megatron -> (logits, HF); the CLI checkpoint's logits."""
    from megatron_grpo.commands.convert.hf_to_megatron import (
        check_hf_weights,
        convert_hf_on_ranks,
        load_model_config,
        resolve_hf_model,
    )
    from megatron_grpo.commands.convert.megatron_to_hf import export_on_ranks
    from megatron_grpo.config import ParallelDims
    from megatron_grpo.convert.hf_config import infer_family
    from megatron_grpo.convert.hf_files import HFCheckpoint, write_hf_config
    from megatron_grpo.mcore.parallel import init_parallel

    ctx = init_parallel(ParallelDims(tp=2, pp=2))
    logits = {}
    for name, case in cases.items():
        cfg = resolve_hf_model(case["hf_dir"])
        check_hf_weights(HFCheckpoint(case["hf_dir"]), cfg, ctx.dims)
        convert_hf_on_ranks(ctx, case["hf_dir"], case["megatron_dir"], cfg)
        logits[name] = checkpoint_logits(ctx, cfg, case["megatron_dir"], case["tokens"])
        family = infer_family(cfg)
        export_on_ranks(ctx, case["megatron_dir"], case["export_dir"], cfg, family)
        if ctx.is_main:  # no template: the config is built from the ModelConfig
            write_hf_config(Path(case["export_dir"]), cfg, family, torch.float32, None)
        save_hf_from_checkpoint(ctx, cfg, case["megatron_dir"], case["saved_dir"])
    cfg = load_model_config(Path(cli["megatron_dir"], "model.yaml"))
    logits["cli"] = checkpoint_logits(ctx, cfg, cli["megatron_dir"], cli["tokens"])
    return logits


def save_hf_from_checkpoint(ctx, cfg, megatron_dir: str, out_dir: str) -> None:
    """What ``train.save_hf_interval`` writes, from a model loaded from ``megatron_dir``:
    every stage its own layers, files of at most 100 KB."""
    from megatron_grpo.mcore import checkpoint
    from megatron_grpo.mcore.model import build_model
    from megatron_grpo.train.save_hf import write_hf_model

    model = build_model(cfg, ctx)
    checkpoint.load_model(model, megatron_dir)
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    write_hf_model(model, cfg, ctx, Path(out_dir), None, None, max_bytes=100_000)


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, dict]:
    """Every case saved as an HF directory, with its tokens and transformers' logits."""
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for name, (family, overrides, seq) in CASES.items():
        hf_config = tiny_hf_config(family, **overrides)
        model = random_hf_model(hf_config)
        hf_dir = root / name
        model.save_pretrained(hf_dir, max_shard_size="100KB" if name == "llama" else "5GB")
        tokens = torch.randint(0, VOCAB, (2, seq), generator=torch.Generator().manual_seed(1))
        out[name] = {"dir": hf_dir, "model": model, "tokens": tokens}
        out[name]["logits"] = hf_logits(model, tokens)
    # The command lines get a bf16 copy, as most published checkpoints are.
    bf16 = random_hf_model(tiny_hf_config("llama")).to(torch.bfloat16)
    bf16.save_pretrained(root / "llama-bf16", max_shard_size="100KB")
    save_tokenizer(root / "llama-bf16")
    tokens = out["llama"]["tokens"]
    out["llama-bf16"] = {"dir": root / "llama-bf16", "tokens": tokens}
    out["llama-bf16"]["logits"] = hf_logits(bf16, tokens)
    return out


@pytest.fixture(scope="module")
def cli_round_trip(sources, tmp_path_factory) -> dict[str, Path]:
    """bf16 llama through the CLI (TP1 x PP2, with a model config) and back through the
    tools wrapper (to sharded HF)."""
    root = tmp_path_factory.mktemp("cli")
    from megatron_grpo.commands.convert.hf_to_megatron import resolve_hf_model
    from megatron_grpo.config import dump_config

    source = sources["llama-bf16"]["dir"]
    cfg = resolve_hf_model(source)
    assert cfg.params_dtype == "bfloat16"  # from the HF config's dtype
    cfg.make_vocab_size_divisible_by = 8  # a training-only field the YAML may set
    (root / "model.yaml").write_text(dump_config(cfg))
    megatron_dir, hf_dir = root / "megatron", root / "hf"
    to_megatron = run_cli(
        "hf-to-megatron",
        *("--hf-dir", str(source), "--out", str(megatron_dir)),
        *("--tp", "1", "--pp", "2", "--model-config", str(root / "model.yaml")),
    )
    assert to_megatron.returncode == 0, to_megatron.stderr[-3000:]
    assert f"wrote {megatron_dir} (TP1 x PP2, 2 layers, bfloat16)" in to_megatron.stdout
    to_hf = run_tool(
        "convert_megatron_to_hf.py",
        *("--megatron-dir", str(megatron_dir), "--out", str(hf_dir), "--max-shard-size", "100KB"),
    )
    assert to_hf.returncode == 0, to_hf.stderr[-3000:]
    assert to_hf.stdout.strip() == f"wrote {hf_dir} from {megatron_dir}"
    return {"megatron": megatron_dir, "hf": hf_dir}


@pytest.fixture(scope="module")
def launched(sources, cli_round_trip, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("converted")
    cases = {
        name: {
            "hf_dir": str(src["dir"]),
            "megatron_dir": str(root / name / "megatron"),
            "export_dir": str(root / name / "hf"),
            "saved_dir": str(root / name / "saved"),
            "tokens": src["tokens"],
        }
        for name, src in sources.items()
        if name in CASES
    }
    cli = {"megatron_dir": str(cli_round_trip["megatron"]), "tokens": sources["llama"]["tokens"]}
    results = run_workers(
        f"{HERE}:convert_load_export", 4, kwargs={"cases": cases, "cli": cli}, timeout=300
    )
    logits = {
        name: next(r[name] for r in results if r[name] is not None) for name in [*cases, "cli"]
    }
    return {"cases": cases, "logits": logits}


# --------------------------------------------------------------------------- tests

# Config fields that decide what the model computes or how it is used.
CONFIG_FIELDS = (
    "architectures",
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "max_position_embeddings",
    "rms_norm_eps",
    "tie_word_embeddings",
    "rope_parameters",
    "hidden_act",
    "attention_bias",
)


@pytest.mark.parametrize("name", list(CASES))
def test_round_trip_is_bitwise(sources, launched, name):
    source_dir, export_dir = sources[name]["dir"], Path(launched["cases"][name]["export_dir"])
    want, got = safetensors_state(source_dir), safetensors_state(export_dir)
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) and got[k].dtype == want[k].dtype for k in want)
    want_cfg = json.loads((source_dir / "config.json").read_text())
    got_cfg = json.loads((export_dir / "config.json").read_text())
    for field in CONFIG_FIELDS:
        assert got_cfg.get(field) == want_cfg.get(field), field
    heads = want_cfg["hidden_size"] // want_cfg["num_attention_heads"]
    assert (got_cfg.get("head_dim") or heads) == (want_cfg.get("head_dim") or heads)


@pytest.mark.parametrize("name", list(CASES))
def test_every_stage_writes_its_layers_as_the_source_had_them(sources, launched, name):
    """``save_hf``'s writer at TP2 x PP2: the source's tensors, bitwise, in files of each
    stage and an index; the config as the export's."""
    saved = Path(launched["cases"][name]["saved_dir"])
    want, got = safetensors_state(sources[name]["dir"]), safetensors_state(saved)
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) and got[k].dtype == want[k].dtype for k in want)
    index = json.loads((saved / "model.safetensors.index.json").read_text())
    files = sorted(saved.glob("*.safetensors"))
    assert sorted(set(index["weight_map"].values())) == [f.name for f in files]
    assert files[-1].name == f"model-{len(files):05d}-of-{len(files):05d}.safetensors"
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for t in got.values()
    )
    export_dir = Path(launched["cases"][name]["export_dir"])
    assert (saved / "config.json").read_text() == (export_dir / "config.json").read_text()


@pytest.mark.parametrize("name", list(CASES))
def test_megatron_logits_at_tp2_pp2_match_transformers(sources, launched, name):
    got, want = launched["logits"][name], sources[name]["logits"]
    assert got.shape == want.shape
    diff = (got - want).abs().max().item()
    print(f"{name}: max |megatron - transformers| = {diff:.2e}, max |logit| {want.abs().max():.2f}")
    assert diff < LOGIT_TOLERANCE


def test_llama3_rope_scaling_changes_the_logits(sources):
    """The llama3 case would catch a megatron model that ignored the scaling."""
    src = sources["llama3-rope"]
    plain_config = tiny_hf_config("llama", max_position_embeddings=131072)
    plain = random_hf_model(plain_config)
    plain.load_state_dict(src["model"].state_dict())
    diff = (hf_logits(plain, src["tokens"]) - src["logits"]).abs().max().item()
    print(f"llama3 RoPE scaling moves transformers' logits by up to {diff:.2e}")
    assert diff > 100 * LOGIT_TOLERANCE, diff


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3-tied"])
def test_exported_directory_loads_in_transformers(sources, launched, name):
    export_dir = launched["cases"][name]["export_dir"]
    got = hf_logits(export_dir, sources[name]["tokens"])
    assert torch.equal(got, hf_logits(sources[name]["dir"], sources[name]["tokens"]))


def test_exported_directory_serves_from_the_embedded_rollout_server(sources, launched):
    """Greedy tokens from the embedded server on the exported directory equal transformers'."""
    import asyncio

    from megatron_grpo.embedded.server import start_embedded_server
    from megatron_grpo.rollout.client import ClientConfig, SGLangClient
    from megatron_grpo.sglang_api.types import RolloutRequest, SamplingParams

    export_dir = launched["cases"]["qwen2"]["export_dir"]
    prompt = sources["qwen2"]["tokens"][0, :6].tolist()
    model = transformers.AutoModelForCausalLM.from_pretrained(export_dir).float().eval()
    expected = model.generate(
        torch.tensor([prompt]),
        max_new_tokens=5,
        do_sample=False,
        eos_token_id=None,
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
    )[0, len(prompt) :].tolist()
    server = start_embedded_server(export_dir)
    try:
        request = RolloutRequest(
            prompts=(tuple(prompt),),
            sampling=SamplingParams(max_new_tokens=5, temperature=0.0, ignore_eos=True),
        )

        async def run():
            async with SGLangClient(ClientConfig(urls=(server.url,))) as client:
                return await client.generate(request)

        (sample,) = asyncio.run(run())
    finally:
        server.stop()
    assert list(sample.output_ids) == expected


def test_command_lines_round_trip_bf16(sources, cli_round_trip, launched):
    source = sources["llama-bf16"]
    megatron_dir, hf_dir = cli_round_trip["megatron"], cli_round_trip["hf"]
    model_cfg = yaml.safe_load((megatron_dir / "model.yaml").read_text())
    assert model_cfg["make_vocab_size_divisible_by"] == 8  # the given model config won
    want, got = safetensors_state(source["dir"]), safetensors_state(hf_dir)
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) and got[k].dtype == torch.bfloat16 for k in want)
    assert len(list(hf_dir.glob("model-*-of-*.safetensors"))) > 1
    assert (hf_dir / "model.safetensors.index.json").is_file()
    for name in ("config.json", "generation_config.json", "tokenizer.json"):
        assert (hf_dir / name).read_text() == (source["dir"] / name).read_text(), name
    assert transformers.AutoTokenizer.from_pretrained(hf_dir)("t5 t7")["input_ids"] == [5, 7]
    # Saved at TP1 x PP2, loaded at TP2 x PP2, computed in bf16 by both.
    diff = (launched["logits"]["cli"].float() - source["logits"].float()).abs().max().item()
    print(f"bf16 command-line checkpoint: max |megatron - transformers| = {diff:.2e}")
    assert diff < BF16_LOGIT_TOLERANCE


def test_config_mismatch_is_refused_by_name(sources, tmp_path):
    from megatron_grpo.commands.convert.hf_to_megatron import resolve_hf_model
    from megatron_grpo.config import dump_config

    cfg = resolve_hf_model(sources["qwen2"]["dir"])
    cfg.num_query_groups = 4
    (tmp_path / "model.yaml").write_text(dump_config(cfg))
    result = run_cli(
        "hf-to-megatron",
        *("--hf-dir", str(sources["qwen2"]["dir"]), "--out", str(tmp_path / "out")),
        *("--tp", "2", "--model-config", str(tmp_path / "model.yaml")),
    )
    assert result.returncode == 2
    error = "num_key_value_heads=2 but model.num_query_groups=4"
    prefix = "megatron-grpo convert hf-to-megatron: error: "
    assert re.search(f"^{prefix}.*{error}", result.stderr, re.M), result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "out").exists()


def test_unsupported_architecture_is_refused_by_name(tmp_path):
    config = {"architectures": ["MistralForCausalLM"], "model_type": "mistral"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    result = run_tool(
        "convert_hf_to_megatron.py", "--hf-dir", str(tmp_path), "--out", str(tmp_path / "out")
    )
    assert result.returncode == 2
    assert "unsupported architecture 'MistralForCausalLM'" in result.stderr
    assert "Traceback" not in result.stderr


def test_export_family_mismatch_is_refused_by_name(cli_round_trip, tmp_path):
    result = run_tool(
        "convert_megatron_to_hf.py",
        *("--megatron-dir", str(cli_round_trip["megatron"]), "--out", str(tmp_path / "out")),
        *("--family", "qwen2"),
    )
    assert result.returncode == 2
    error = "model.add_qkv_bias=False does not fit Qwen2ForCausalLM"
    assert re.search(f"^convert_megatron_to_hf.py: error: .*{error}", result.stderr, re.M), (
        result.stderr
    )
    assert "Traceback" not in result.stderr


# --------------------------------------------------------------------------- streaming


def test_hf_reader_reads_one_layer_at_a_time(sources):
    from megatron_grpo.commands.convert.hf_to_megatron import resolve_hf_model
    from megatron_grpo.convert.hf_files import HFCheckpoint, MegatronView

    ckpt = HFCheckpoint(sources["qwen2"]["dir"])
    reads: list[list[str]] = []
    read = ckpt.read
    ckpt.read = lambda names: reads.append(names) or read(names)  # type: ignore[method-assign]
    view = MegatronView(ckpt, resolve_hf_model(sources["qwen2"]["dir"]))
    for name in view:  # model order, as load_full_state reads
        view[name]
        assert len({k.split(".")[2] for k in view._tensors}) <= 1  # one layer held
    layers = [{n.split(".")[2] for n in names if n.startswith("model.layers.")} for names in reads]
    assert [x for x in layers if x] == [{"0"}, {"1"}]  # each layer read once, alone


def test_writer_writes_each_file_as_it_completes(tmp_path):
    from megatron_grpo.convert.hf_files import ShardedWriter

    planned = {f"w{i}": torch.empty(256, device="meta") for i in range(3)}  # 1 KB each
    writer = ShardedWriter(tmp_path, planned, max_shard_size="1KB")
    for i in range(3):
        writer.add({f"w{i}": torch.full((256,), float(i))})
        assert len(list(tmp_path.glob("*.safetensors"))) == i + 1
    writer.close()
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["weight_map"]["w2"] == "model-00003-of-00003.safetensors"
    assert safetensors_state(tmp_path)["w1"].eq(1).all()
