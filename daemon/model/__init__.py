"""Llama-family decoders over the paged KV cache: config, weights, tokenizer, demo checkpoint."""
