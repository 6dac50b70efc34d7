"""Hugging Face <-> megatron-core weight conversion, split by job.

- ``hf_config``: which HF families are supported, and ModelConfig <-> HF config.
- ``layout``: pure tensor re-layouts (fused QKV, fused gate/up, vocab padding).
- ``weights``: parameter names and layer-by-layer conversion of full (TP=1) tensors.
- ``sharding``: TP shards of full tensors and the PP layer split.
- ``checkpoints``: HF checkpoint -> megatron distributed checkpoint (and shared helpers).
- ``export``: megatron distributed checkpoint -> HF checkpoint.
- ``hf_files``: streaming reads and writes of HF safetensors checkpoints.

Moving full tensors into and out of a live model is ``megatron_grpo.full_state``.

``megatron_grpo.hf_mapping`` re-exports the public functions; import from there.
"""
