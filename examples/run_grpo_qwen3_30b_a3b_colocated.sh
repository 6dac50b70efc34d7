#!/usr/bin/env bash
# shellcheck source-path=SCRIPTDIR
# GRPO on Qwen3-30B-A3B (mixture of experts: 128 experts, top-8), colocated: training and
# generation take turns on the same 8 GPUs of 141 GB (1 x 8 H200), where
# run_grpo_qwen3_30b_a3b.sh gives the engines a node of their own (16 GPUs). Training at
# TP4 x PP1 x DP2, experts over EP8, as there (its training peak alone needs the 141 GB GPUs);
# 4 SGLang engines at TP2, started by the trainer on the training GPUs. While the engines
# generate, the learner's optimizer states and gradients wait in host memory; while it
# trains, the engines sleep (weights and KV cache released).
# The trainer starts each engine from rollout.engines.launch_command, filling {model}, {host}
# and {port}, on its rollout.colocate.engine_tp GPUs; the command must carry
# --enable-memory-saver (so that the engines can release their memory) and
# --mem-fraction-static equal to rollout.colocate.mem_fraction_static (the share the dry run
# checks). Steps and paths: docs/recipes.md.
# The architecture comes from the config.json of the model's Hugging Face directory,
# HF_DIR (default $MODELS_DIR/Qwen3-30B-A3B):
#   HF_DIR=/path/to/Qwen3-30B-A3B bash examples/run_grpo_qwen3_30b_a3b_colocated.sh \
#     [--dry-run] [--set key=value ...]
set -euo pipefail
HF_NAME=Qwen3-30B-A3B
TRAIN_NODES=1 TP=4 PP=1 CP=1 EP=8 GPU_MEMORY_GB=141
ROLLOUT_ARGS=(
  --set rollout.prompts_per_step=64
  --set rollout.samples_per_prompt=8
  --set train.global_batch_size=128
  --set data.max_prompt_length=1024
  --set rollout.max_new_tokens=7168
)
PERF_ARGS=(
  --set model.params_dtype=bfloat16
  --set train.max_tokens_per_micro_batch=8192
  --set optim.use_distributed_optimizer=true
  --set train.recompute_granularity=full
)
PLACEMENT=colocated MEM_FRACTION=0.7
COLOCATE_ARGS=(
  --set "rollout.colocate.offload=[optimizer, grads]"
  --set rollout.colocate.mem_fraction_static="$MEM_FRACTION"
)
ROLLOUT_NODES=0 SGLANG_TP=2
SGLANG_ARGS=(--enable-memory-saver --mem-fraction-static "$MEM_FRACTION" --dtype bfloat16)
# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
run_recipe "$@"
