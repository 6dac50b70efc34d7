# Shared by examples/run_grpo_<model>.sh: paths, checkpoint conversion, SGLang engines, launch.
#
# A run script sets HF_NAME (the Hugging Face directory name), TRAIN_NODES, TP, PP, CP (a
# mixture-of-experts model also EP, and GPU_MEMORY_GB when its GPUs are not 80 GB ones),
# ROLLOUT_ARGS and PERF_ARGS (batch sizes, lengths, params dtype), ROLLOUT_NODES, SGLANG_TP and
# SGLANG_ARGS, then sources this file and calls
#   run_recipe "$@"
# where "$@" is [--dry-run | --rollout] [--set key=value ...]. The model's architecture is
# train.init's: the config.json of HF_DIR for the dry run and the conversion, the model.yaml
# that the conversion writes into MEGATRON_DIR (the same model) for training.
#   (none)     train: convert the HF checkpoint once (node 0), wait for the SGLang engines
#              (node 0), then torchrun on this node.
#   --dry-run  check the layout and memory per GPU at NNODES x GPUS_PER_NODE; starts nothing.
#   --rollout  start this host's SGLang engines (GPUs ROLLOUT_GPUS, SGLANG_TP per engine) and
#              wait; run it on each of the ROLLOUT_NODES rollout hosts first.
# A colocated recipe (PLACEMENT=colocated, and COLOCATE_ARGS) runs its engines on the training
# GPUs: the trainer starts them itself from rollout.engines.launch_command (SGLANG_ARGS, at
# rollout.colocate.engine_tp=SGLANG_TP) and pushes the weights by tensor; it has no --rollout.
#
# Environment, with defaults (relative paths are from the repository root):
#   NNODES=TRAIN_NODES NODE_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 GPUS_PER_NODE=8
#     (MASTER_ADDR is also where the engines reach global rank 0 for the weight broadcast:
#     with engines on other hosts, give node 0's address even for a single training node)
#   MODELS_DIR=models        HF_DIR=$MODELS_DIR/$HF_NAME  MEGATRON_DIR=$HF_DIR-megatron
#   DATA=data/math/train.jsonl  (jsonl or parquet with "prompt" and "label" columns)
#   OUTPUT_DIR=runs/<recipe>    (on a filesystem every training node sees: checkpoints)
#   ROLLOUT_HOSTS=127.0.0.1     (the rollout hosts, comma separated)
#   ROLLOUT_GPUS=0,...,GPUS_PER_NODE-1  SGLANG_PORT=30000 (engine i listens on SGLANG_PORT+i)
#   SGLANG_PYTHON=python        (the interpreter that has sglang, e.g. another virtualenv)
#   HOST_MEMORY_GIB             (--dry-run: host memory per node; the dry run's default if unset)
# shellcheck shell=bash
# shellcheck disable=SC2034  # TRAIN_ARGS etc. are read by the functions below

EXAMPLES=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
cd "$EXAMPLES/.." || exit

RECIPE=$(basename "$0" .sh)
RECIPE=${RECIPE#run_}
NNODES=${NNODES:-$TRAIN_NODES}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
MODELS_DIR=${MODELS_DIR:-models}
HF_DIR=${HF_DIR:-$MODELS_DIR/$HF_NAME}
MEGATRON_DIR=${MEGATRON_DIR:-$HF_DIR-megatron}
DATA=${DATA:-data/math/train.jsonl}
OUTPUT_DIR=${OUTPUT_DIR:-runs/$RECIPE}
ROLLOUT_HOSTS=${ROLLOUT_HOSTS:-127.0.0.1}
ROLLOUT_GPUS=${ROLLOUT_GPUS:-$(seq -s, 0 $((GPUS_PER_NODE - 1)))}
SGLANG_PORT=${SGLANG_PORT:-30000}
SGLANG_PYTHON=${SGLANG_PYTHON:-python}

# Engine URLs: every rollout host runs (number of ROLLOUT_GPUS) / SGLANG_TP engines.
IFS=, read -r -a _rollout_gpus <<<"$ROLLOUT_GPUS"
ENGINES_PER_HOST=$((${#_rollout_gpus[@]} / SGLANG_TP))
ROLLOUT_URLS=()
for _host in ${ROLLOUT_HOSTS//,/ }; do
  for ((_i = 0; _i < ENGINES_PER_HOST; _i++)); do
    ROLLOUT_URLS+=("http://$_host:$((SGLANG_PORT + _i))")
  done
done

CKPT_ARGS=(--set tokenizer="$HF_DIR" --set output_dir="$OUTPUT_DIR")
FROM_HF=(--set train.init="$HF_DIR")
FROM_MEGATRON=(--set train.init="$MEGATRON_DIR")
LAYOUT_ARGS=(--set parallel.tp="$TP" --set parallel.pp="$PP" --set parallel.cp="$CP")
if [ -n "${EP:-}" ]; then LAYOUT_ARGS+=(--set parallel.ep="$EP"); fi
URL_LIST=$(printf '"%s",' "${ROLLOUT_URLS[@]}")
PLACEMENT=${PLACEMENT:-disaggregated}
if [ "$PLACEMENT" = colocated ]; then
  # {model}, {host} and {port} are filled by the trainer for each engine it starts.
  SGLANG_LAUNCH="$SGLANG_PYTHON -m sglang.launch_server --model-path {model} --host {host}"
  ENGINE_ARGS=(
    --set rollout.placement=colocated
    "${COLOCATE_ARGS[@]}"
    --set rollout.colocate.engine_tp="$SGLANG_TP"
    --set rollout.engines.launch_command="$SGLANG_LAUNCH --port {port} ${SGLANG_ARGS[*]}"
    --set rollout.sync.method=tensor
  )
else
  ENGINE_ARGS=(
    --set rollout.engines.urls="[${URL_LIST%,}]"
    --set rollout.sync.master_address="$MASTER_ADDR"
  )
fi
TRAIN_ARGS=(
  --config "$EXAMPLES/grpo_math.yaml"
  "${CKPT_ARGS[@]}"
  "${LAYOUT_ARGS[@]}"
  "${PERF_ARGS[@]}"
  "${ROLLOUT_ARGS[@]}"
  --set data.path="$DATA"
  "${ENGINE_ARGS[@]}"
)

run_recipe() {
  if [ ! -f "$HF_DIR/config.json" ]; then
    echo "$HF_DIR/config.json not found: set HF_DIR to the $HF_NAME Hugging Face directory" \
      "(or MODELS_DIR to the directory that holds it)" >&2
    exit 1
  fi
  case "${1:-}" in
    --dry-run) shift && dry_run "$@" ;;
    --rollout) shift && start_engines ;;
    *) train "$@" ;;
  esac
}

dry_run() {
  local host_memory=()
  if [ -n "${HOST_MEMORY_GIB:-}" ]; then host_memory=(--host-memory-gib "$HOST_MEMORY_GIB"); fi
  megatron-grpo train --dry-run --nnodes "$NNODES" --gpus-per-node "$GPUS_PER_NODE" \
    --gpu-memory-gb "${GPU_MEMORY_GB:-80}" "${host_memory[@]}" "${TRAIN_ARGS[@]}" \
    "${FROM_HF[@]}" "$@"
}

train() {
  if [ "$NODE_RANK" = 0 ]; then
    convert_checkpoint "$@"
    if [ "$PLACEMENT" != colocated ]; then wait_for_engines; fi
  else
    wait_for_file "$MEGATRON_DIR/model.yaml"
  fi
  torchrun --nnodes "$NNODES" --node_rank "$NODE_RANK" --master_addr "$MASTER_ADDR" \
    --master_port "$MASTER_PORT" --nproc_per_node "$GPUS_PER_NODE" \
    -m megatron_grpo.cli train "${TRAIN_ARGS[@]}" "${FROM_MEGATRON[@]}" "$@"
}

# HF -> megatron, once. Distributed checkpoints load at any layout, so the conversion runs
# at the recipe's TP on this node alone (PP=1).
convert_checkpoint() {
  if [ -e "$MEGATRON_DIR" ]; then
    return
  fi
  mkdir -p "$OUTPUT_DIR"
  megatron-grpo config "${TRAIN_ARGS[@]}" "${FROM_HF[@]}" "$@" >"$OUTPUT_DIR/recipe.yaml"
  megatron-grpo convert hf-to-megatron --hf-dir "$HF_DIR" --out "$MEGATRON_DIR" \
    --tp "$TP" --pp 1 --model-config "$OUTPUT_DIR/recipe.yaml"
}

wait_for_file() {
  echo "waiting for $1 (written by node 0)"
  until [ -e "$1" ]; do sleep 10; done
}

wait_for_engines() {
  local url hosts
  read -r -a hosts <<<"${ROLLOUT_HOSTS//,/ }"
  if [ "${#hosts[@]}" != "$ROLLOUT_NODES" ]; then
    echo "note: this recipe plans $ROLLOUT_NODES rollout host(s); ROLLOUT_HOSTS names ${#hosts[@]}"
  fi
  for url in "${ROLLOUT_URLS[@]}"; do
    echo "waiting for the SGLang engine at $url"
    until curl -sf "$url/health" >/dev/null; do sleep 10; done
  done
}

# SGLang engines on this host, SGLANG_TP GPUs each, in the background; stops them all when
# one exits or this script is interrupted.
start_engines() {
  local i devices
  if [ "$PLACEMENT" = colocated ]; then
    echo "$RECIPE is colocated: the trainer starts its engines on the training GPUs" >&2
    exit 1
  fi
  ENGINE_PIDS=()
  for ((i = 0; i < ENGINES_PER_HOST; i++)); do
    devices=$(IFS=,; echo "${_rollout_gpus[*]:i * SGLANG_TP:SGLANG_TP}")
    CUDA_VISIBLE_DEVICES=$devices "$SGLANG_PYTHON" -m sglang.launch_server \
      --model-path "$HF_DIR" --host 0.0.0.0 --port $((SGLANG_PORT + i)) \
      --tp-size "$SGLANG_TP" "${SGLANG_ARGS[@]}" &
    ENGINE_PIDS+=("$!")
  done
  trap 'kill "${ENGINE_PIDS[@]}" 2>/dev/null' EXIT INT TERM
  wait -n "${ENGINE_PIDS[@]}"
}
