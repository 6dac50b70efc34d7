"""megatron_grpo: model-parallel GRPO on megatron-core with exact loss normalization."""
