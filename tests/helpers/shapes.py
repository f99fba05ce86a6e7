"""Model shapes the planner tests describe (HF config dicts: ``planner.describe`` reads them; nothing is built)."""

# Llama-3.2-3B: 3.21B parameters, 394.0M resident (tied embeddings), 28 layers of 100.7M
LLAMA_3B = {"model_type": "llama", "vocab_size": 128256, "hidden_size": 3072, "intermediate_size": 8192,
            "num_hidden_layers": 28, "num_attention_heads": 24, "num_key_value_heads": 8, "tie_word_embeddings": True}
# Llama-3-8B: 8.03B parameters, untied embeddings
LLAMA3_8B = {"model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
             "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8}
# Llama-2-13B: 13.02B parameters, 40 layers of 317.2M, 327.7M resident (untied embeddings)
LLAMA2_13B = {"model_type": "llama", "vocab_size": 32000, "hidden_size": 5120, "intermediate_size": 13824,
              "num_hidden_layers": 40, "num_attention_heads": 40, "num_key_value_heads": 40}
