"""Shared by the model shape tests: config.json contents of small models of each kind the plan
reads (Qwen3 tied and untied, with attention bias, Qwen3-MoE, Qwen2, Llama with MLP bias)."""

QWEN3 = dict(model_type="qwen3", hidden_size=1024, intermediate_size=3072, num_hidden_layers=2,
             num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=1000,
             tie_word_embeddings=True)
CASES = {
    "qwen3-0.6b-layers-tied": QWEN3,
    "qwen3-8b-layers-untied": dict(QWEN3, hidden_size=4096, intermediate_size=12288,
                                   num_attention_heads=32, num_hidden_layers=1,
                                   tie_word_embeddings=False),
    "qwen3-attention-bias": dict(QWEN3, attention_bias=True, hidden_size=256,
                                 intermediate_size=512, head_dim=64),
    "qwen3-moe": dict(model_type="qwen3_moe", hidden_size=256, intermediate_size=512,
                      moe_intermediate_size=128, num_experts=8, num_experts_per_tok=2,
                      num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[3],
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                      vocab_size=500, tie_word_embeddings=False),
    "qwen2": dict(model_type="qwen2", hidden_size=256, intermediate_size=512,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  vocab_size=500, tie_word_embeddings=False),
    "llama-mlp-bias": dict(model_type="llama", hidden_size=256, intermediate_size=512,
                           num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=8,
                           vocab_size=500, mlp_bias=True, attention_bias=True),
}
