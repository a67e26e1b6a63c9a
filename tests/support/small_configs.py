"""Shared by the cost model tests: a small Hugging Face config.json of a given model type."""


def small_config(model_type, **extra):
    config = {"model_type": model_type, "num_hidden_layers": 2, "hidden_size": 64,
              "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 32, "vocab_size": 100, "tie_word_embeddings": False}
    return config | extra
