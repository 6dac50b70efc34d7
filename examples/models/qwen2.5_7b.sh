# shellcheck shell=bash
# Qwen2.5-7B-Instruct (Qwen2ForCausalLM). Every number is from Qwen/Qwen2.5-7B-Instruct
# config.json on the Hugging Face Hub (num_hidden_layers, hidden_size, intermediate_size,
# num_attention_heads, num_key_value_heads, vocab_size, max_position_embeddings, rope_theta,
# rms_norm_eps, tie_word_embeddings); Qwen2 has a bias on Q/K/V only. head_dim is
# hidden_size / num_attention_heads = 128. The base model Qwen/Qwen2.5-7B has
# max_position_embeddings 131072.
# shellcheck disable=SC2034  # read by the run script that sources this file
MODEL_ARGS=(
  --set model.num_layers=28
  --set model.hidden_size=3584
  --set model.ffn_hidden_size=18944
  --set model.num_attention_heads=28
  --set model.num_query_groups=4
  --set model.vocab_size=152064
  --set model.max_position_embeddings=32768
  --set model.rotary_base=1000000
  --set model.norm_epsilon=1e-6
  --set model.add_qkv_bias=true
  --set model.qk_layernorm=false
  --set model.tie_embeddings=false
  --set model.params_dtype=bfloat16
  --set model.hf_family=qwen2
)
