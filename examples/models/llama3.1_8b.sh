# shellcheck shell=bash
# Llama 3.1 8B Instruct (LlamaForCausalLM). Every number is from
# meta-llama/Llama-3.1-8B-Instruct config.json on the Hugging Face Hub (num_hidden_layers,
# hidden_size, intermediate_size, num_attention_heads, num_key_value_heads, vocab_size,
# max_position_embeddings, rope_theta, rms_norm_eps, tie_word_embeddings, and
# rope_scaling.factor with rope_type llama3; its low/high frequency factors 1 and 4 and
# original context 8192 are the ones megatron-core fixes). head_dim is
# hidden_size / num_attention_heads = 128. The base model meta-llama/Llama-3.1-8B has the
# same architecture.
# shellcheck disable=SC2034  # read by the run script that sources this file
MODEL_ARGS=(
  --set model.num_layers=32
  --set model.hidden_size=4096
  --set model.ffn_hidden_size=14336
  --set model.num_attention_heads=32
  --set model.num_query_groups=8
  --set model.vocab_size=128256
  --set model.max_position_embeddings=131072
  --set model.rotary_base=500000
  --set model.rope_scaling_factor=8.0
  --set model.norm_epsilon=1e-5
  --set model.add_qkv_bias=false
  --set model.qk_layernorm=false
  --set model.tie_embeddings=false
  --set model.params_dtype=bfloat16
  --set model.hf_family=llama
)
