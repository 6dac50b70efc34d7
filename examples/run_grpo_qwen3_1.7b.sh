#!/usr/bin/env bash
# shellcheck source-path=SCRIPTDIR
# GRPO on Qwen3-1.7B. Training: 8 GPUs (1 x 8) at TP1 x PP1 x DP8.
# Rollout: 8 SGLang engines at TP1 on 1 more host(s). Steps and paths: docs/recipes.md.
# The architecture comes from the config.json of the model's Hugging Face directory,
# HF_DIR (default $MODELS_DIR/Qwen3-1.7B):
#   HF_DIR=/path/to/Qwen3-1.7B bash examples/run_grpo_qwen3_1.7b.sh \
#     [--dry-run | --rollout] [--set key=value ...]
set -euo pipefail
HF_NAME=Qwen3-1.7B
TRAIN_NODES=1 TP=1 PP=1 CP=1
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
)
ROLLOUT_NODES=1 SGLANG_TP=1
SGLANG_ARGS=(--mem-fraction-static 0.85 --dtype bfloat16)
# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
run_recipe "$@"
