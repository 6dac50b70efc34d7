#!/usr/bin/env bash
# shellcheck source-path=SCRIPTDIR
# GRPO on Llama-3.1-70B-Instruct. Training: 32 GPUs (4 x 8) at TP8 x PP2 x DP2.
# Rollout: 4 SGLang engines at TP8 on 4 more host(s). Steps and paths: docs/recipes.md.
# The architecture comes from the config.json of the model's Hugging Face directory,
# HF_DIR (default $MODELS_DIR/Llama-3.1-70B-Instruct):
#   HF_DIR=/path/to/Llama-3.1-70B-Instruct bash examples/run_grpo_llama3.1_70b.sh \
#     [--dry-run | --rollout] [--set key=value ...]
set -euo pipefail
HF_NAME=Llama-3.1-70B-Instruct
TRAIN_NODES=4 TP=8 PP=2 CP=1
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
ROLLOUT_NODES=4 SGLANG_TP=8
SGLANG_ARGS=(--mem-fraction-static 0.85 --dtype bfloat16)
# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
run_recipe "$@"
