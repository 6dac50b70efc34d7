#!/usr/bin/env bash
# shellcheck source-path=SCRIPTDIR
# GRPO on Qwen3-235B-A22B (mixture of experts: 128 experts, top-8). Training: 128 GPUs
# (16 x 8, the node count NeMo-RL's recipe for it uses) at TP4 x PP2 x DP16, experts over
# EP32. Rollout: 8 SGLang engines at TP8 on 8 more hosts. Steps and paths: docs/recipes.md.
# The architecture comes from the config.json of the model's Hugging Face directory,
# HF_DIR (default $MODELS_DIR/Qwen3-235B-A22B):
#   HF_DIR=/path/to/Qwen3-235B-A22B bash examples/run_grpo_qwen3_235b_a22b.sh \
#     [--dry-run | --rollout] [--set key=value ...]
set -euo pipefail
HF_NAME=Qwen3-235B-A22B
TRAIN_NODES=16 TP=4 PP=2 CP=1 EP=32
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
ROLLOUT_NODES=8 SGLANG_TP=8
SGLANG_ARGS=(--mem-fraction-static 0.85 --dtype bfloat16)
# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
run_recipe "$@"
