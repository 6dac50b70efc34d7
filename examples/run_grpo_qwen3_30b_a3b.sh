#!/usr/bin/env bash
# shellcheck source-path=SCRIPTDIR
# GRPO on Qwen3-30B-A3B (mixture of experts: 128 experts, top-8). Training: 8 GPUs of 141 GB
# (1 x 8 H200) at TP4 x PP1 x DP2, experts over EP8. Without optimizer offload the model
# states alone (18 bytes per parameter, 30.5B parameters) need about 69 GB per GPU on
# 8 GPUs: more than an 80 GB GPU holds with the rest. Rollout: 4 SGLang engines at TP2 on
# 1 more host. Steps and paths: docs/recipes.md.
# The architecture comes from the config.json of the model's Hugging Face directory,
# HF_DIR (default $MODELS_DIR/Qwen3-30B-A3B):
#   HF_DIR=/path/to/Qwen3-30B-A3B bash examples/run_grpo_qwen3_30b_a3b.sh \
#     [--dry-run | --rollout] [--set key=value ...]
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
ROLLOUT_NODES=1 SGLANG_TP=2
SGLANG_ARGS=(--mem-fraction-static 0.85 --dtype bfloat16)
# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
run_recipe "$@"
