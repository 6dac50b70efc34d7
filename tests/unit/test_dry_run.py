"""The dry run's arithmetic: parameter counts by hand and against known models, memory, refusals."""

from pathlib import Path

import pytest
import torch.distributed as dist

from megatron_grpo import cli
from megatron_grpo.commands.dry_run import dry_run, resolve_world_size
from megatron_grpo.commands.memory_model import (
    GIB,
    activation_bytes_per_token_layer,
    delta_copy_bytes,
    layers_in_flight,
    routes_bytes,
    stage_params,
)
from megatron_grpo.config import ParallelDims, load_config
from megatron_grpo.config.param_count import layer_params, total_params

ROOT = Path(__file__).resolve().parents[2]
HF_CONFIGS = ROOT / "tests" / "fixtures" / "hf_configs"

# The CPU demo's model: h=64, f=128, 4 heads of 16 channels, 2 query groups, 15 tokens.
TINY = [
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.ffn_hidden_size=128",
    "model.num_attention_heads=4",
    "model.num_query_groups=2",
    "model.vocab_size=15",
    "model.make_vocab_size_divisible_by=1",
    "model.add_qkv_bias=true",
]
# One layer by hand: qkv 64 x (4 + 2 x 2) x 16 = 8192, its bias 128, proj 64 x 64 = 4096,
# fc1 64 x 2 x 128 = 16384, fc2 128 x 64 = 8192, two RMSNorms 2 x 64 = 128.
TINY_LAYER = 8192 + 128 + 4096 + 16384 + 8192 + 128


def from_hf(name: str) -> list[str]:
    """Overrides that start from the recipe model's config.json (tests/fixtures/hf_configs)."""
    return [f"train.init={HF_CONFIGS / name}", "model.params_dtype=bfloat16"]


def test_tiny_layer_and_total_by_hand():
    m = load_config(None, TINY).model
    assert layer_params(m, 1) == TINY_LAYER == 37120
    # + embedding 15 x 64, output layer 15 x 64, final norm 64
    assert total_params(m) == 2 * TINY_LAYER + 960 + 960 + 64


def test_delta_copy_is_the_largest_stages_full_weights_by_hand():
    cfg = load_config(
        None, TINY + ["parallel.tp=2", "parallel.pp=2", "model.params_dtype=bfloat16"]
    )
    # stage 1: a whole layer (unsharded: the sender's HF tensors), output layer 15 x 64 and
    # the final norm, in bf16
    assert delta_copy_bytes(cfg.model, cfg.parallel) == 2 * (TINY_LAYER + 960 + 64)


def test_dry_run_prints_the_delta_copy_only_with_delta(capsys):
    argv = ["train", "--dry-run", "--world-size", "1"] + [f"--set={x}" for x in TINY]
    assert cli.main(argv) == 0
    assert "rollout.sync.delta" not in capsys.readouterr().out
    assert cli.main(argv + ["--set", "rollout.sync.delta=true"]) == 0
    out = capsys.readouterr().out
    assert "rollout.sync.delta: each stage's sender also keeps a host copy" in out, out


def test_tiny_stages_at_tp2_pp2_by_hand():
    cfg = load_config(None, TINY + ["parallel.tp=2", "parallel.pp=2"])
    s0, s1 = stage_params(cfg.model, cfg.parallel)
    # TP halves the matrices and the QKV bias; the norms stay whole. The vocabulary is
    # padded to 16 (a multiple of TP), so each vocabulary shard is 8 x 64.
    layer = (8192 + 128 + 4096 + 16384 + 8192) // 2 + 128
    assert [list(r) for r in s0.layers] == [[0]] and [list(r) for r in s1.layers] == [[1]]
    assert (s0.layers_params, s0.embedding, s0.output_layer, s0.final_norm) == (layer, 512, 0, 0)
    assert (s1.layers_params, s1.embedding, s1.output_layer, s1.final_norm) == (layer, 0, 512, 64)


def test_tied_embeddings_have_a_copy_on_the_last_stage_only_with_pp():
    tied = TINY + ["model.tie_embeddings=true"]
    (only,) = stage_params(load_config(None, tied).model, ParallelDims())
    assert (only.embedding, only.output_layer) == (960, 0)
    assert total_params(load_config(None, tied).model) == 2 * TINY_LAYER + 960 + 64
    cfg = load_config(None, tied + ["parallel.pp=2"])
    _, last = stage_params(cfg.model, cfg.parallel)
    assert last.output_layer == 960


def test_interleaved_stages_hold_their_chunks():
    cfg = load_config(None, TINY + ["model.num_layers=8", "parallel.pp=2", "parallel.vpp=2"])
    s0, s1 = stage_params(cfg.model, cfg.parallel)
    assert [list(r) for r in s0.layers] == [[0, 1], [4, 5]]
    assert [list(r) for r in s1.layers] == [[2, 3], [6, 7]]


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("tie", [False, True])
def test_total_matches_the_hugging_face_model(family, tie):
    from transformers import AutoModelForCausalLM

    from megatron_grpo.convert.hf_config import hf_config_from_model_config

    overrides = TINY + [
        f"model.add_qkv_bias={family == 'qwen2'}",
        f"model.qk_layernorm={family == 'qwen3'}",
        f"model.tie_embeddings={tie}",
        "model.head_dim=32",  # != hidden_size / heads, as in Qwen3
    ]
    m = load_config(None, overrides).model
    hf = AutoModelForCausalLM.from_config(hf_config_from_model_config(m, family))
    assert total_params(m) == sum(p.numel() for p in hf.parameters())


@pytest.mark.parametrize(
    "name, known",
    [
        ("qwen3_8b", 8_190_735_360),  # Qwen/Qwen3-8B: 8.2B
        ("llama3.1_8b", 8_030_261_248),  # meta-llama/Llama-3.1-8B safetensors total
        ("llama3.1_70b", 70_553_706_496),  # meta-llama/Llama-3.1-70B safetensors total
    ],
)
def test_total_of_known_models(name, known):
    assert total_params(load_config(None, from_hf(name)).model) == known


# Qwen3-8B's architecture written out by hand from its config.json on the Hub.
QWEN3_8B_BY_HAND = [
    "model.num_layers=36",
    "model.hidden_size=4096",
    "model.ffn_hidden_size=12288",
    "model.num_attention_heads=32",
    "model.num_query_groups=8",
    "model.head_dim=128",
    "model.vocab_size=151936",
    "model.max_position_embeddings=40960",
    "model.rotary_base=1000000",
    "model.norm_epsilon=1e-6",
    "model.add_qkv_bias=false",
    "model.qk_layernorm=true",
    "model.tie_embeddings=false",
    "model.params_dtype=bfloat16",
    "model.hf_family=qwen3",
]


def test_report_from_the_hf_directory_is_the_report_by_hand():
    layout = ["parallel.tp=4", "train.max_tokens_per_micro_batch=8192"]
    by_hand = dry_run(load_config(None, QWEN3_8B_BY_HAND + layout), world_size=8)
    from_dir = dry_run(load_config(None, from_hf("qwen3_8b") + layout), world_size=8)
    assert from_dir.format() == by_hand.format()
    assert from_dir.cfg.model == by_hand.cfg.model
    # the same numbers given as overrides agree with config.json
    both = load_config(None, from_hf("qwen3_8b") + QWEN3_8B_BY_HAND + layout)
    assert both.model == by_hand.cfg.model


def test_stages_sum_to_the_model_at_tp1():
    cfg = load_config(None, from_hf("qwen3_8b") + ["parallel.pp=4"])
    assert sum(s.total for s in stage_params(cfg.model, cfg.parallel)) == 8_190_735_360


def memory(overrides, world_size=1):
    report = dry_run(load_config(None, TINY + overrides), world_size=world_size)
    return report, report.memory


def test_bytes_per_parameter_of_the_model_states():
    report, (m,) = memory(["model.params_dtype=bfloat16"])
    n = report.params[0].total
    # bf16 weights, fp32 main_grad, Adam: fp32 master + exp_avg + exp_avg_sq
    assert (m.weights, m.gradients, m.optimizer, m.reference) == (2 * n, 4 * n, 12 * n, 0)
    _, (m,) = memory(["model.params_dtype=float32"])
    assert (m.weights, m.gradients, m.optimizer) == (4 * n, 4 * n, 8 * n)
    _, (m,) = memory(["model.params_dtype=bfloat16", "optim.optimizer=sgd"])
    assert m.optimizer == 4 * n
    _, (m,) = memory(["model.params_dtype=bfloat16", "loss.kl_coef=0.01"])
    assert m.reference == 2 * n


def test_optimizer_states_are_sharded_over_dp_only_by_the_distributed_optimizer():
    _, (one,) = memory(["model.params_dtype=bfloat16"], world_size=1)
    _, (four,) = memory(["model.params_dtype=bfloat16"], world_size=4)
    assert one.optimizer == four.optimizer and one.total == four.total
    report, (zero1,) = memory(
        ["model.params_dtype=bfloat16", "optim.use_distributed_optimizer=true"], world_size=4
    )
    n = report.params[0].total
    # ZeRO-1: master + moments / DP; the bf16 weights and fp32 gradient buffer stay whole.
    assert (zero1.weights, zero1.gradients, zero1.optimizer) == (2 * n, 4 * n, 12 * n / 4)
    assert "sharded over DP=4 (distributed optimizer)" in report.format()


def test_activations_per_token_and_layer_by_hand():
    cfg = load_config(None, TINY + ["model.params_dtype=bfloat16"])
    # bf16: 4h replicated, (2a + 2g)d + 3f sharded; fp32 softmax stats per head.
    by_hand = 2 * (4 * 64 + (2 * 4 + 2 * 2) * 16 + 3 * 128) + 4 * 4
    fused = activation_bytes_per_token_layer(cfg.model, cfg.parallel, 512, unfused_attention=False)
    assert fused == by_hand
    no_sp = ParallelDims(tp=2, sequence_parallel=False)
    by_hand_tp2 = 2 * (4 * 64 + ((2 * 4 + 2 * 2) * 16 + 3 * 128) / 2) + 4 * 4 / 2
    assert activation_bytes_per_token_layer(cfg.model, no_sp, 512, unfused_attention=False) == (
        by_hand_tp2
    )
    # Sequence parallelism splits the 4h that TP alone replicates.
    sp = ParallelDims(tp=2)
    by_hand_sp = 2 * (4 * 64 / 2 + ((2 * 4 + 2 * 2) * 16 + 3 * 128) / 2) + 4 * 4 / 2
    assert activation_bytes_per_token_layer(cfg.model, sp, 512, unfused_attention=False) == (
        by_hand_sp
    )
    unfused = activation_bytes_per_token_layer(cfg.model, cfg.parallel, 512, unfused_attention=True)
    assert unfused == by_hand + 6 * 4 * 512  # fp32 softmax output and its bf16 copy
    fp32 = load_config(None, TINY).model
    fp32_unfused = activation_bytes_per_token_layer(fp32, cfg.parallel, 512, unfused_attention=True)
    assert fp32_unfused == 4 * (4 * 64 + (2 * 4 + 2 * 2) * 16 + 3 * 128) + 4 * 4 + 4 * 4 * 512


def test_recomputation_by_hand():
    # 4 layers at PP1, 100 tokens, bf16, fused attention: per layer and token, the input
    # hidden state is 2 x 64 bytes; the whole layer is `whole`.
    base = TINY + ["model.num_layers=4", "model.params_dtype=bfloat16"]
    base += ["train.max_tokens_per_micro_batch=100"]
    whole = 2 * (4 * 64 + (2 * 4 + 2 * 2) * 16 + 3 * 128) + 4 * 4
    act = {}
    for name, extra in {
        "none": [],
        "uniform1": ["train.recompute_granularity=full"],
        "uniform2": ["train.recompute_granularity=full", "train.recompute_num_layers=2"],
        "block1": ["train.recompute_granularity=full", "train.recompute_method=block"],
        "selective": ["train.recompute_granularity=selective"],
        "selective_mlp": [
            "train.recompute_granularity=selective",
            "train.recompute_modules=[core_attn,mlp,layernorm]",
        ],
    }.items():
        act[name] = memory(base + extra)[1][0].activations
    assert act["none"] == 100 * 4 * whole
    # uniform: one input per group of N layers, plus one group recomputed in the backward
    assert act["uniform1"] == 100 * (4 * 2 * 64 + 1 * whole)
    assert act["uniform2"] == 100 * (4 * 2 * 64 / 2 + 2 * whole)
    # block: the first layer recomputed (its input kept), three kept whole, one recomputing
    assert act["block1"] == 100 * (2 * 64 + 3 * whole + whole)
    assert act["selective"] == 100 * 4 * (whole - 4 * 4)  # softmax statistics dropped
    only_input_and_attention = 2 * (2 * 64 + (2 * 4 + 2 * 2) * 16)
    assert act["selective_mlp"] == 100 * 4 * only_input_and_attention


def test_1f1b_in_flight_micro_batches():
    assert [layers_in_flight(32, ParallelDims(pp=4), r) for r in range(4)] == [32, 24, 16, 8]
    # interleaved: the first stage holds L x (1 + (PP - 1) / (PP x VPP)) (Megatron's formula)
    assert layers_in_flight(32, ParallelDims(pp=4, vpp=2), 0) == 32 * (1 + 3 / 8)


def test_logits_only_on_the_last_stage():
    _, (first, last) = memory(["parallel.pp=2", "train.max_tokens_per_micro_batch=100"], 2)
    assert first.logits == 0
    assert last.logits == 100 * 15 * (4 + 16)  # fp32 logits and four fp32 working copies


def test_invalid_layouts_name_the_reason():
    def check(overrides, world_size, match):
        with pytest.raises(ValueError, match=match):
            dry_run(load_config(None, TINY + overrides), world_size=world_size)

    check(["parallel.tp=2"], 3, r"world size 3 is not divisible by TP\(2\) x PP\(1\) x CP\(1\)")
    check(["parallel.pp=4"], 4, r"model.num_layers=2 is not divisible by .* PP\(4\)")
    check(["parallel.tp=8"], 8, "model.num_attention_heads=4 is not divisible by TP=8")
    check(["model.num_query_groups=1", "parallel.tp=2"], 2, "num_query_groups=1 is not")
    check(["model.ffn_hidden_size=129", "parallel.tp=2"], 2, "ffn_hidden_size=129 is not")
    check(["train.global_batch_size=4", "rollout.samples_per_prompt=4"], 8, "below DP=8")


def test_too_big_is_refused_with_what_to_change():
    cfg = load_config(None, from_hf("qwen3_8b"))
    report = dry_run(cfg, world_size=8, gpu_memory_gb=80)
    assert not report.fits
    msg = report.refusal()
    assert "does not fit" in msg and "80 GiB" in msg
    assert "raise parallel.tp (now 1) or parallel.pp (now 1)" in msg
    assert "set optim.use_distributed_optimizer=true to shard the optimizer states" in msg
    assert "set train.recompute_granularity=full" in msg
    assert "train.max_tokens_per_micro_batch" in msg
    assert report.worst.total > 80 * GIB


def test_world_size_from_flags():
    assert resolve_world_size(None, None, None) == (8, 8)
    assert resolve_world_size(16, None, None) == (16, None)
    assert resolve_world_size(None, 4, None) == (32, 8)
    assert resolve_world_size(8, 2, 4) == (8, 4)
    with pytest.raises(ValueError, match="--world-size 8 is not --nnodes 2 x --gpus-per-node 8"):
        resolve_world_size(8, 2, None)


def test_cli_exit_codes_and_no_process_group(capsys):
    tiny = [f"--set={o}" for o in TINY]
    assert cli.main(["train", *tiny, "--dry-run", "--world-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "layout: DP=2 TP=1 PP=1 CP=1" in out and "verdict: fits" in out
    assert not dist.is_initialized()

    big = [f"--set={o}" for o in from_hf("qwen3_8b")]
    assert cli.main(["train", *big, "--dry-run", "--nnodes", "1"]) == 2
    captured = capsys.readouterr()
    assert "verdict: DOES NOT FIT" in captured.out
    assert "error: the layout does not fit" in captured.err

    assert cli.main(["train", *tiny, "--set=parallel.tp=8", "--dry-run"]) == 2
    assert "num_attention_heads=4 is not divisible by TP=8" in capsys.readouterr().err

    assert cli.main(["train", *tiny, "--world-size", "2"]) == 2
    assert "need --dry-run" in capsys.readouterr().err

    # planned here for a GPU machine: the dry run takes CP, the run itself needs Transformer Engine
    assert cli.main(["train", *tiny, "--set=parallel.cp=2", "--dry-run", "--world-size", "2"]) == 0
    assert "layout: DP=1 TP=1 PP=1 CP=2" in capsys.readouterr().out
    vpp = ["--set=model.num_layers=4", "--set=parallel.pp=2", "--set=parallel.vpp=2"]
    assert cli.main(["train", *tiny, *vpp, "--dry-run", "--world-size", "2"]) == 0
    assert "layout: DP=1 TP=1 PP=2 CP=1 VPP=2" in capsys.readouterr().out


# A tiny Qwen3-MoE: h=64, 4 heads of 32 channels in 2 groups, q/k norm, 4 experts of width 32.
TINY_MOE = [
    *TINY[:-1],
    "model.head_dim=32",
    "model.qk_layernorm=true",
    "model.num_experts=4",
    "model.moe_ffn_hidden_size=32",
    "model.moe_router_topk=2",
    "model.hf_family=qwen3_moe",
]
# One layer by hand: qkv 64 x (4 + 2 x 2) x 32 = 16384, proj 128 x 64 = 8192, q/k norms 64,
# router 4 x 64 = 256, an expert 3 x 64 x 32 = 6144, two RMSNorms 128.
TINY_MOE_SHARED = 16384 + 8192 + 64 + 256 + 128


def test_moe_layer_holds_its_ep_ranks_experts_by_hand():
    m = load_config(None, TINY_MOE).model
    assert layer_params(m, 1) == TINY_MOE_SHARED + 4 * 6144
    assert layer_params(m, 1, ep=2) == TINY_MOE_SHARED + 2 * 6144
    # TP splits attention, not the router or the (whole) experts
    assert layer_params(m, 2, ep=4) == (16384 + 8192) // 2 + 64 + 256 + 128 + 6144
    (stage,) = stage_params(m, ParallelDims(ep=2))
    assert stage.expert_params == 2 * 2 * 6144


def test_moe_total_matches_the_hugging_face_model():
    from transformers import AutoModelForCausalLM

    from megatron_grpo.convert.hf_config import hf_config_from_model_config

    m = load_config(None, TINY_MOE).model
    hf = AutoModelForCausalLM.from_config(hf_config_from_model_config(m, "qwen3_moe"))
    assert total_params(m) == sum(p.numel() for p in hf.parameters())


def test_moe_dry_run_counts_experts_per_ep_rank(capsys):
    argv = ["train", "--dry-run", "--world-size", "4", "--set", "parallel.ep=4"]
    code = cli.main(argv + [f"--set={x}" for x in TINY_MOE])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "layout: DP=4 TP=1 PP=1 CP=1 EP=4" in out
    assert "experts: 4 per layer, top-2, 1 per EP rank (EP=4), 6,144 each" in out


def test_expert_optimizer_states_shard_over_expert_dp():
    from megatron_grpo.commands.memory_model import optimizer_bytes_per_param, stage_memory

    cfg = load_config(None, [*TINY_MOE, "optim.use_distributed_optimizer=true", "parallel.ep=2"])
    (stage,) = stage_params(cfg.model, cfg.parallel)
    mem = stage_memory(cfg, stage, dp=4)  # dense states over DP 4, experts' over 4 x 1 / 2
    dense = stage.total - stage.expert_params
    expected = optimizer_bytes_per_param(cfg) * (dense / 4 + stage.expert_params / 2)
    assert mem.optimizer == pytest.approx(expected)


def test_routing_replay_routes_by_hand(capsys):
    """int16 routes, 2 layers x top-2 a token: 8 B a token for the engine's (R3) and 8 B for
    the learner's own (R2); a step of 4 x 2 samples of at most 10 + 6 tokens over DP 2."""
    step = [
        *TINY_MOE,
        "rollout.prompts_per_step=4",
        "rollout.samples_per_prompt=2",
        "data.max_prompt_length=10",
        "rollout.max_new_tokens=6",
        "train.max_tokens_per_micro_batch=64",
    ]
    assert dry_run(load_config(None, step), world_size=2).memory[0].routes == 0
    r3 = load_config(None, [*step, "train.routing_replay=r3"])
    assert dry_run(r3, world_size=2).memory[0].routes == 4 * 16 * 8
    assert routes_bytes(r3, dp=2) == (64 * 8, 4 * 16 * 8)
    r2 = [*step, "train.routing_replay=r2"]
    assert routes_bytes(load_config(None, r2), dp=2) == (64 * 8, 4 * 16 * 8)
    both = load_config(None, [*r2, "rollout.return_routed_experts=true"])
    assert routes_bytes(both, dp=2) == (64 * 16, 4 * 16 * 16)
    flags = [f"--set={x}" for x in (*step, "train.routing_replay=r3")]
    assert cli.main(["train", *flags, "--dry-run", "--world-size", "2"]) == 0
    assert "engine's routes, 2 layers x top-2 x 2 B a token" in capsys.readouterr().out
