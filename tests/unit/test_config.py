import ast
import dataclasses
import json
import re
from pathlib import Path

import pytest

from megatron_grpo.config import Config, ModelConfig, ParallelDims, dump_config, load_config
from megatron_grpo.config.hf import check_hf_config, model_config_from_hf
from megatron_grpo.config.init_model import MODEL_CONFIG_FILE, init_kind


def write(tmp_path, text):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return path


def test_yaml_and_dotted_overrides(tmp_path):
    path = write(tmp_path, "model:\n  num_layers: 4\noptim:\n  lr: 1e-5\nparallel:\n  tp: 2\n")
    cfg = load_config(path, ["optim.lr=3e-6", "model.qk_layernorm=true", "seed=7"])
    assert isinstance(cfg, Config)
    assert cfg.model.num_layers == 4
    assert cfg.optim.lr == pytest.approx(3e-6)
    assert cfg.model.qk_layernorm is True
    assert cfg.seed == 7
    assert cfg.parallel == ParallelDims(tp=2)
    assert cfg.model.num_query_groups == cfg.model.num_attention_heads


def test_unknown_key_is_named(tmp_path):
    path = write(tmp_path, "optim:\n  lrr: 1e-5\n")
    with pytest.raises(ValueError, match=r"unknown config key 'optim\.lrr'"):
        load_config(path)
    with pytest.raises(ValueError, match=r"unknown config key 'bogus'"):
        load_config(None, ["bogus=1"])


def test_wrong_type_and_bad_value_are_named():
    with pytest.raises(ValueError, match=r"model\.num_layers must be int, got 'four'"):
        load_config(None, ["model.num_layers=four"])
    with pytest.raises(ValueError, match=r"optim\.optimizer='adamw' is not one of 'adam', 'sgd'"):
        load_config(None, ["optim.optimizer=adamw"])
    with pytest.raises(ValueError, match=r"optim\.min_lr=0\.1 is above optim\.lr"):
        load_config(None, ["optim.lr=0.01", "optim.min_lr=0.1"])
    with pytest.raises(ValueError, match="not of the form key=value"):
        load_config(None, ["optim.lr"])


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(None, ["model.hidden_size=128", "parallel.pp=2"])
    path = write(tmp_path, dump_config(cfg))
    assert load_config(path) == cfg


def test_layout_validation_names_the_cause():
    dims = ParallelDims(tp=2, pp=2)
    with pytest.raises(
        ValueError, match=r"world size 6 is not divisible by TP\(2\) x PP\(2\) x CP\(1\) = 4"
    ):
        dims.data_parallel_size(6)
    assert dims.data_parallel_size(8) == 2
    with pytest.raises(ValueError, match=r"model\.num_layers=3 is not divisible"):
        dims.validate_model(num_layers=3, num_attention_heads=4, num_query_groups=2)
    with pytest.raises(ValueError, match=r"model\.num_attention_heads=6 is not divisible by TP=4"):
        ParallelDims(tp=4).validate_model(num_layers=2, num_attention_heads=6, num_query_groups=6)
    with pytest.raises(ValueError, match=r"model\.num_query_groups=2 is not divisible by TP=4"):
        ParallelDims(tp=4).validate_model(num_layers=2, num_attention_heads=8, num_query_groups=2)
    with pytest.raises(ValueError, match=r"parallel\.tp must be >= 1"):
        ParallelDims(tp=0)


# --------------------------------------------------------------------------- model from train.init

HF_CONFIGS = Path(__file__).resolve().parents[1] / "fixtures" / "hf_configs"
QWEN3_8B = json.loads((HF_CONFIGS / "qwen3_8b" / "config.json").read_text())


def hf_dir(tmp_path, config=QWEN3_8B, name="Qwen3-8B"):
    """A Hugging Face directory that holds only ``config``."""
    path = tmp_path / name
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_model_comes_from_the_hf_config(tmp_path):
    path = write(tmp_path, "model:\n  params_dtype: bfloat16\n  make_vocab_size_divisible_by: 64\n")
    cfg = load_config(path, [f"train.init={hf_dir(tmp_path)}"])
    m = cfg.model
    assert (m.num_layers, m.hidden_size, m.ffn_hidden_size) == (36, 4096, 12288)
    assert (m.num_attention_heads, m.num_query_groups, m.head_dim) == (32, 8, 128)
    assert (m.vocab_size, m.max_position_embeddings) == (151936, 40960)
    assert (m.rotary_base, m.rope_scaling_factor, m.norm_epsilon) == (1e6, None, 1e-6)
    assert (m.add_qkv_bias, m.qk_layernorm, m.tie_embeddings) == (False, True, False)
    assert m.hf_family == "qwen3"
    # training-only fields are the config's
    assert (m.params_dtype, m.make_vocab_size_divisible_by) == ("bfloat16", 64)
    assert m.init_method_std == ModelConfig().init_method_std


def test_resolved_config_from_an_hf_directory_round_trips(tmp_path):
    cfg = load_config(None, [f"train.init={hf_dir(tmp_path)}"])
    assert load_config(write(tmp_path, dump_config(cfg))) == cfg


def test_overrides_that_agree_are_accepted(tmp_path):
    path = write(tmp_path, "model:\n  num_layers: 36\n  norm_epsilon: 1e-6\n  hf_family: qwen3\n")
    overrides = [
        f"train.init={hf_dir(tmp_path)}",
        "model.rotary_base=1000000",
        "model.head_dim=128",
    ]
    assert load_config(path, overrides).model.num_layers == 36


def test_overrides_that_disagree_are_named_in_one_error(tmp_path):
    path = write(tmp_path, "model:\n  num_layers: 32\n  params_dtype: bfloat16\n")
    directory = hf_dir(tmp_path)
    overrides = [f"train.init={directory}", "model.rotary_base=10000", "model.qk_layernorm=false"]
    with pytest.raises(ValueError) as err:
        load_config(path, overrides)
    assert str(err.value) == (
        f"model section does not match {directory}/config.json: "
        "model.num_layers=32 but num_hidden_layers=36; "
        "model.rotary_base=10000.0 but rope_theta=1000000.0; "
        "model.qk_layernorm=False but qk norm (q_norm/k_norm, Qwen3)=True"
    )


def test_a_missing_config_json_key_is_named(tmp_path):
    config = {k: v for k, v in QWEN3_8B.items() if k not in ("num_hidden_layers", "rms_norm_eps")}
    directory = hf_dir(tmp_path, config)
    with pytest.raises(ValueError) as err:
        load_config(None, [f"train.init={directory}"])
    assert str(err.value) == (
        f"{directory}/config.json: HF config has no num_hidden_layers, rms_norm_eps"
    )


def test_an_unsupported_hf_config_is_refused_by_name(tmp_path):
    directory = hf_dir(tmp_path, QWEN3_8B | {"architectures": ["MistralForCausalLM"]})
    with pytest.raises(ValueError, match=r"config\.json: unsupported architecture 'Mistral"):
        load_config(None, [f"train.init={directory}"])


def test_transformers_5_rope_parameters(tmp_path):
    llama = json.loads((HF_CONFIGS / "llama3.1_8b" / "config.json").read_text())
    scaling = llama.pop("rope_scaling")
    legacy = load_config(
        None, [f"train.init={hf_dir(tmp_path, llama | {'rope_scaling': scaling})}"]
    )
    llama.pop("rope_theta")
    llama["rope_parameters"] = scaling | {"rope_theta": 500000.0}
    cfg = load_config(None, [f"train.init={hf_dir(tmp_path, llama, 'v5')}"])
    assert (cfg.model.rotary_base, cfg.model.rope_scaling_factor) == (500000.0, 8.0)
    assert cfg.model == legacy.model


def test_converted_megatron_checkpoint_gives_its_model(tmp_path):
    from_hf = load_config(None, [f"train.init={hf_dir(tmp_path)}"]).model
    megatron = tmp_path / "Qwen3-8B-megatron"
    megatron.mkdir()
    (megatron / "metadata.json").write_text("{}")
    (megatron / MODEL_CONFIG_FILE).write_text(dump_config(from_hf))  # params_dtype float32
    cfg = load_config(None, [f"train.init={megatron}", "model.params_dtype=bfloat16"])
    assert cfg.model == dataclasses.replace(from_hf, params_dtype="bfloat16")
    with pytest.raises(ValueError) as err:
        load_config(None, [f"train.init={megatron}", "model.num_layers=3", "model.vocab_size=8"])
    assert str(err.value) == (
        f"model section does not match {megatron}/{MODEL_CONFIG_FILE}: "
        "model.num_layers=3 but num_layers=36; model.vocab_size=8 but vocab_size=151936"
    )


def test_other_train_init_keeps_the_model_section_and_its_error(tmp_path):
    megatron = tmp_path / "trained"  # a checkpoint saved by training: no model.yaml
    megatron.mkdir()
    (megatron / "metadata.json").write_text("{}")
    assert load_config(None, [f"train.init={megatron}", "model.num_layers=4"]).model.num_layers == 4
    assert init_kind(str(megatron)) == "megatron"
    missing = tmp_path / "nothing"
    cfg = load_config(None, [f"train.init={missing}", "model.num_layers=4"])
    assert cfg.model.num_layers == 4
    kinds = (
        "a Hugging Face model directory (with config.json) or a megatron checkpoint "
        "directory (with metadata.json)"
    )
    with pytest.raises(FileNotFoundError) as err:
        init_kind(str(missing))
    assert str(err.value) == f"train.init={str(missing)!r} does not exist: give {kinds}"
    (tmp_path / "weights.bin").write_text("")
    with pytest.raises(FileNotFoundError, match=r"weights.bin' is a file: give a Hugging Face"):
        init_kind(str(tmp_path / "weights.bin"))
    with pytest.raises(FileNotFoundError) as err:
        init_kind(str(tmp_path))
    assert str(err.value) == (
        f"train.init={str(tmp_path)!r} is neither a megatron checkpoint (no metadata.json "
        "in it) nor a Hugging Face model directory (no config.json in it)"
    )


def test_a_relative_train_init_says_where_it_was_looked_for(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError) as err:
        init_kind("runs/demo/model")
    assert str(err.value).startswith(
        f"train.init='runs/demo/model' (looked for {tmp_path}/runs/demo/model, from the "
        "current directory) does not exist: give a Hugging Face model directory"
    )
    with pytest.raises(FileNotFoundError, match=r"~ is not expanded in a config: write /"):
        init_kind("~/no_such_model")


def test_max_prompt_length_defaults_to_the_room_the_context_leaves():
    """None becomes the longest prompt whose sample fits the context and a micro-batch."""
    context = ["model.max_position_embeddings=64", "rollout.max_new_tokens=16"]
    assert load_config(None, context).data.max_prompt_length == 48
    with_eval = load_config(None, [*context, "eval.max_new_tokens=24"])
    assert with_eval.data.max_prompt_length == 40
    budget = load_config(None, [*context, "train.max_tokens_per_micro_batch=32"])
    assert budget.data.max_prompt_length == 16
    assert load_config(None, [*context, "data.max_prompt_length=8"]).data.max_prompt_length == 8
    assert load_config(None, context).data.overlong_prompts == "filter"
    with pytest.raises(ValueError, match="no room for a prompt: model.max_position_embeddings=64"):
        load_config(None, ["model.max_position_embeddings=64", "rollout.max_new_tokens=64"])


def test_check_hf_config_names_every_field():
    model = dataclasses.replace(model_config_from_hf(QWEN3_8B), num_layers=3, vocab_size=8)
    with pytest.raises(ValueError) as err:
        check_hf_config(QWEN3_8B, model)
    assert str(err.value) == (
        "HF config does not match the model: num_hidden_layers=36 but model.num_layers=3; "
        "vocab_size=151936 but model.vocab_size=8"
    )


def test_config_imports_nothing_above_it():
    """config/ is the bottom floor: the rest of the package imports it, never the reverse."""
    config_dir = Path(__file__).resolve().parents[2] / "megatron_grpo" / "config"
    for path in config_dir.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                modules = [node.module or ""]
            elif isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            else:
                continue
            for module in modules:
                if module.startswith("megatron_grpo"):
                    assert module.startswith("megatron_grpo.config"), f"{path.name}: {module}"


def test_scale_options_and_their_refusals_are_named():
    cfg = load_config(None, [])
    assert not cfg.optim.use_distributed_optimizer
    assert cfg.optim.overlap_grad_reduce and cfg.optim.overlap_param_gather
    assert cfg.parallel.sequence_parallel and not cfg.parallel.uses_sequence_parallel  # TP=1
    assert load_config(None, ["parallel.tp=2"]).parallel.uses_sequence_parallel
    cases = {
        "optim.use_distributed_optimizer=true needs optim.optimizer=adam": [
            "optim.optimizer=sgd",
            "optim.use_distributed_optimizer=true",
        ],
        "parallel.cp=2 with parallel.vpp=2 is not supported": [
            "model.num_layers=4",
            "parallel.pp=2",
            "parallel.vpp=2",
            "parallel.cp=2",
        ],
        "a mixture-of-experts model at parallel.cp=2 is not supported": [
            "model.num_experts=4",
            "parallel.cp=2",
        ],
        "model.params_dtype=float16 is not supported: fp16 training needs a dynamic loss": [
            "model.params_dtype=float16"
        ],
        "train.recompute_num_layers must be >= 1, got 0": ["train.recompute_num_layers=0"],
        "train.recompute_granularity=selective needs train.recompute_modules": [
            "train.recompute_granularity=selective",
            "train.recompute_modules=[]",
        ],
        "train.recompute_granularity='partial' is not one of": [
            "train.recompute_granularity=partial"
        ],
    }
    for message, overrides in cases.items():
        with pytest.raises(ValueError, match=re.escape(message)):
            load_config(None, overrides)


MOE = ["model.num_experts=4", "model.moe_ffn_hidden_size=32", "model.moe_router_topk=2"]


def test_moe_options_and_their_refusals_are_named():
    cfg = load_config(None, [*MOE, "model.moe_aux_loss_coeff=0.01", "parallel.ep=2"])
    assert cfg.model.is_moe and cfg.model.expert_ffn_hidden_size == 32
    assert cfg.parallel.ep == 2
    assert not load_config(None, []).model.is_moe
    assert load_config(None, ["model.num_experts=4"]).model.expert_ffn_hidden_size == 128
    cases = {
        "model.num_experts must be >= 2": ["model.num_experts=1"],
        "model.moe_router_topk=5 must lie in [1, model.num_experts=4]": [
            *MOE,
            "model.moe_router_topk=5",
        ],
        "model.moe_capacity_factor must be > 0": [*MOE, "model.moe_capacity_factor=0"],
        "model.moe_aux_loss_coeff must be >= 0": [*MOE, "model.moe_aux_loss_coeff=-1"],
        "megatron-core always renormalizes sigmoid top-k scores": [
            *MOE,
            "model.moe_router_score_function=sigmoid",
            "model.moe_norm_topk_prob=false",
        ],
        "model.hf_family=qwen3_moe needs model.num_experts": ["model.hf_family=qwen3_moe"],
        "parallel.ep must be >= 1, got 0": ["parallel.ep=0"],
    }
    for message, overrides in cases.items():
        with pytest.raises(ValueError, match=re.escape(message)):
            load_config(None, overrides)


def test_expert_parallel_layout_validation_names_the_cause():
    # EP takes its ranks from DP x TP: 2x1x1x2, 1x2x1x2 and 2x1x2x2 are layouts
    assert ParallelDims(ep=2).data_parallel_size(2) == 2
    assert ParallelDims(tp=2, ep=2).data_parallel_size(2) == 1
    assert ParallelDims(pp=2, ep=2).data_parallel_size(4) == 2
    with pytest.raises(ValueError, match=re.escape("parallel.ep=4 does not divide DP(1) x TP(2)")):
        ParallelDims(tp=2, ep=4).data_parallel_size(2)
    with pytest.raises(ValueError, match=re.escape("parallel.ep=2 does not divide DP(1) x TP(1)")):
        ParallelDims(pp=2, ep=2).data_parallel_size(2)
    dims = ParallelDims(ep=4)
    with pytest.raises(ValueError, match=re.escape("model.num_experts=6 is not divisible by")):
        dims.validate_model(num_layers=2, num_attention_heads=4, num_query_groups=4, num_experts=6)
    with pytest.raises(ValueError, match=re.escape("parallel.ep=4 needs a mixture-of-experts")):
        dims.validate_model(num_layers=2, num_attention_heads=4, num_query_groups=4)
    dims.validate_model(num_layers=2, num_attention_heads=4, num_query_groups=4, num_experts=8)


def test_layouts_are_written_with_three_four_or_five_fields():
    from megatron_grpo.commands.invariance import Layout

    assert Layout.parse("2x1x2") == Layout(2, 1, 2, 1) == Layout.parse("2x1x2x1")
    assert Layout.parse("1x2x1x2") == Layout(1, 2, 1, 2)
    assert str(Layout(1, 2, 1, 2)) == "1x2x1x2" and str(Layout(2, 1, 1)) == "2x1x1"
    assert Layout(2, 1, 2, 2).world_size == 4
    assert Layout.parse("1x1x1x1x2") == Layout(1, 1, 1, 1, 2) == Layout(1, 1, 1, cp=2)
    assert str(Layout(2, 1, 1, cp=2)) == "2x1x1x1x2" and Layout(2, 1, 1, cp=2).world_size == 4
    assert Layout.parse("2x1x1x1x1") == Layout(2, 1, 1)
    for bad in ("2x1", "2x1x1x1x1x1", "ax1x1"):
        with pytest.raises(ValueError, match="DPxTPxPPxEP"):
            Layout.parse(bad)


def test_moe_layout_refusals_are_named_when_the_config_is_built():
    cases = {
        "a mixture-of-experts model at TP=2 needs parallel.sequence_parallel=true": [
            *MOE,
            "parallel.tp=2",
            "parallel.sequence_parallel=false",
        ],
        "train.routing_replay=r2 needs a mixture-of-experts model": ["train.routing_replay=r2"],
    }
    for message, overrides in cases.items():
        with pytest.raises(ValueError, match=re.escape(message)):
            load_config(None, overrides)
    # the balance loss and routing replay under full recomputation (mcore.router_balance)
    recomputed = [*MOE, "model.moe_aux_loss_coeff=0.01", "train.recompute_granularity=full"]
    load_config(None, [*recomputed, "train.routing_replay=r3"])


def test_asynchronous_rl_options_and_their_refusals_are_named():
    cfg = load_config(None, ["rollout.max_staleness=2", "rollout.producer_cpus=[0]"])
    assert cfg.rollout.embedded_process  # auto: generation beside training
    assert cfg.rollout.producer_cpus == [0]
    assert not load_config(None, []).rollout.embedded_process
    thread = [
        "rollout.max_staleness=1",
        "reward.num_workers=1",
        "rollout.engines.embedded_server=thread",
    ]
    assert not load_config(None, thread).rollout.embedded_process
    cases = {
        "rollout.max_staleness must be >= 0, got -1": ["rollout.max_staleness=-1"],
        "rollout.producer_cpus places the rollout producer's process, which runs": [
            "rollout.producer_cpus=[1]"
        ],
        "rollout.producer_cpus must be CPU numbers >= 0, got [-1]": [
            "rollout.max_staleness=1",
            "rollout.producer_cpus=[-1]",
        ],
        "rollout.engines.embedded_server is for rollout.engines.type=embedded": [
            "rollout.engines.type=sglang",
            "rollout.engines.urls=[http://127.0.0.1:1]",
            "rollout.engines.embedded_server=process",
        ],
        "rollout.hook with rollout.max_staleness >= 1 is not supported": [
            "rollout.max_staleness=1",
            "reward.num_workers=1",
            "rollout.hook=tools",
        ],
        "with loss.old_logprobs=rollout the ratio is already taken against the engine's": [
            "loss.old_logprobs=rollout",
            "loss.tis_level=token",
        ],
    }
    for message, overrides in cases.items():
        with pytest.raises(ValueError, match=re.escape(message)):
            load_config(None, overrides)
