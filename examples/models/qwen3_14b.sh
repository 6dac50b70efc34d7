# shellcheck shell=bash
# Qwen3-14B (Qwen3ForCausalLM). Every number is from Qwen/Qwen3-14B config.json on the
# Hugging Face Hub (num_hidden_layers, hidden_size, intermediate_size, num_attention_heads,
# num_key_value_heads, head_dim, vocab_size, max_position_embeddings, rope_theta,
# rms_norm_eps, tie_word_embeddings); Qwen3 has q/k RMSNorm and no QKV bias.
# shellcheck disable=SC2034  # read by the run script that sources this file
MODEL_ARGS=(
  --set model.num_layers=40
  --set model.hidden_size=5120
  --set model.ffn_hidden_size=17408
  --set model.num_attention_heads=40
  --set model.num_query_groups=8
  --set model.head_dim=128
  --set model.vocab_size=151936
  --set model.max_position_embeddings=40960
  --set model.rotary_base=1000000
  --set model.norm_epsilon=1e-6
  --set model.add_qkv_bias=false
  --set model.qk_layernorm=true
  --set model.tie_embeddings=false
  --set model.params_dtype=bfloat16
  --set model.hf_family=qwen3
)
