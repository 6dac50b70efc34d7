"""Hugging Face <-> megatron-core weight mapping: pure functions on full (TP=1) tensors.

- ``hf_config``: the transformers config of a ``ModelConfig`` and the family it implies
  (the export direction; reading an HF ``config.json`` into a ``ModelConfig`` is
  ``megatron_grpo.config.hf``).
- ``layout``: tensor re-layouts (fused QKV, fused gate/up, vocab padding).
- ``weights``: parameter names and layer-by-layer conversion of full tensors.
- ``experts``: the names of a mixture-of-experts layer's router and experts, global
  and per expert-parallel rank.
- ``sharding``: TP shards of full tensors and the PP layer split.
- ``hf_files``: streaming reads and writes of HF safetensors checkpoints, and the config,
  generation config and tokenizer files written beside them.

Everything here works on dicts of tensors, one decoder layer at a time when a
caller streams a checkpoint, and never touches a live model: moving full
tensors into and out of one is ``megatron_grpo.mcore.full_state``; the
conversion commands are ``megatron_grpo.commands.convert``. Weight sync and
the conversion commands share this mapping.
"""
