"""Tiny Llama / Qwen2 / Qwen3 / Phi-3 / Mistral / Gemma 2 and 3 / Mixtral / Qwen2-MoE / Qwen3-MoE / gpt-oss
checkpoints built with transformers (a test-only dependency)."""

from __future__ import annotations

from pathlib import Path

import torch

from kvctl.daemon.model.demo import write_byte_tokenizer

TINY = dict(vocab_size=300, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
            num_attention_heads=2, head_dim=64, max_position_embeddings=512, initializer_range=0.2)


def tiny_config(kind: str):
    import transformers

    if kind == "llama3":
        return transformers.LlamaConfig(
            **TINY, num_key_value_heads=1, tie_word_embeddings=False, rope_theta=500000.0,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    if kind == "llama-bias":  # attention_bias: Q, K, V and the output projection have biases
        return transformers.LlamaConfig(**TINY, num_key_value_heads=1, attention_bias=True)
    if kind == "gpt-oss":
        # gpt-oss-20b's shape scaled down: sinks, layer 0 sliding (24 tokens) and layer 1 full, YaRN,
        # 4 biased experts with the clamped SwiGLU (its limit low enough to clamp these random ones), 2 for each token
        return transformers.GptOssConfig(
            **{**TINY, "num_attention_heads": 4}, num_key_value_heads=2, sliding_window=24, num_local_experts=4,
            num_experts_per_tok=2, swiglu_limit=1.5, eos_token_id=2, pad_token_id=0,
            rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                             "truncate": False, "original_max_position_embeddings": 128, "rope_theta": 150000.0})
    if kind == "llama2-tied-mha":
        return transformers.LlamaConfig(**TINY, num_key_value_heads=2, tie_word_embeddings=True)
    if kind == "qwen2":
        return transformers.Qwen2Config(**TINY, num_key_value_heads=1, tie_word_embeddings=True)
    if kind == "qwen3":  # q_norm and k_norm; GQA 2:1 like the real ones (32 or 64 Q heads to 8 KV heads)
        return transformers.Qwen3Config(**{**TINY, "num_attention_heads": 4}, num_key_value_heads=2,
                                        tie_word_embeddings=False)
    if kind == "qwen3-yarn":  # YaRN as Qwen3's model cards turn it on for long contexts, scaled down
        return transformers.Qwen3Config(**{**TINY, "num_attention_heads": 4}, num_key_value_heads=2,
                                        rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                      "original_max_position_embeddings": 128})
    if kind == "llama-linear":
        return transformers.LlamaConfig(**TINY, num_key_value_heads=1,
                                        rope_scaling={"rope_type": "linear", "factor": 2.0})
    if kind in ("phi3", "phi3-window"):  # Phi-3 mini 4k slides every layer's window (2,047 tokens; 24 here)
        return transformers.Phi3Config(**TINY, num_key_value_heads=1, pad_token_id=0, eos_token_id=2,
                                       sliding_window=24 if kind == "phi3-window" else None)
    if kind == "mistral":
        return transformers.MistralConfig(**TINY, num_key_value_heads=1, sliding_window=None)
    if kind == "mistral-window":  # Mistral 7B v0.1's sliding window, short enough for a test to pass it
        return transformers.MistralConfig(**TINY, num_key_value_heads=1, sliding_window=24)
    if kind == "qwen2-window":  # Qwen's use_sliding_window: layer 0 attends in full, layer 1 slides
        return transformers.Qwen2Config(**TINY, num_key_value_heads=1, tie_word_embeddings=True,
                                        use_sliding_window=True, sliding_window=24, max_window_layers=1)
    if kind in ("gemma3", "gemma3-text"):
        # Gemma 3's 5:1 sliding:full layers scaled to 2:1, a window of 24 tokens; its own RoPE for
        # each kind of layer, the full layers' scaled as the 4B and larger ones are; "gemma3" also
        # caps its logits (Gemma 3 does not, Gemma 2 did) so that the cap is checked too
        return transformers.Gemma3TextConfig(
            **{**TINY, "num_hidden_layers": 3, "num_attention_heads": 4}, num_key_value_heads=2, sliding_window=24,
            sliding_window_pattern=3, query_pre_attn_scalar=48,
            final_logit_softcapping=10.0 if kind == "gemma3" else None,
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                             "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}})
    if kind == "mixtral":  # 4 experts, 2 for each token, in every layer
        return transformers.MixtralConfig(**TINY, num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2,
                                          sliding_window=None)
    if kind == "qwen3-moe":  # Qwen3-30B-A3B's routing (top-k renormalised), scaled down; layer 1 dense
        return transformers.Qwen3MoeConfig(**{**TINY, "num_attention_heads": 4}, num_key_value_heads=2,
                                           num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                                           norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1])
    if kind == "qwen2-moe":  # a gated shared expert beside the routed ones; top-k weights as the softmax gave them
        return transformers.Qwen2MoeConfig(**TINY, num_key_value_heads=1, num_experts=4, num_experts_per_tok=2,
                                           moe_intermediate_size=64, shared_expert_intermediate_size=96,
                                           norm_topk_prob=False)
    if kind == "gemma2":  # every other layer slides a window (24 tokens here); scores and logits capped
        return transformers.Gemma2Config(**{**TINY, "num_hidden_layers": 3, "num_attention_heads": 4},
                                         num_key_value_heads=2, sliding_window=24, query_pre_attn_scalar=48,
                                         attn_logit_softcapping=3.0, final_logit_softcapping=10.0)
    if kind == "gemma3-multimodal":  # Gemma 3 4B and up: the language model beside a (tiny) vision tower
        vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                 num_attention_heads=2, image_size=28, patch_size=14)
        return transformers.Gemma3Config(text_config=tiny_config("gemma3-text"), vision_config=vision,
                                         mm_tokens_per_image=4)
    raise ValueError(kind)


def build_checkpoint(kind: str, directory: Path, seed: int = 0, max_shard_size: str | None = None):
    """Save a random tiny model in the Hugging Face layout, with a byte-level tokenizer."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(kind)).eval()
    with torch.no_grad():  # norms start at ones: random ones catch a weight read for the wrong norm
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.uniform_(0.5, 1.5)
            elif name.endswith(("bias", "sinks")):  # they start at zero, which a bias left unread would match
                parameter.normal_(0.0, 0.5)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(directory), **kwargs)
    write_byte_tokenizer(Path(directory))
    return model


def hf_greedy(model, prompt: list[int], steps: int) -> list[int]:
    """transformers' own forward, no KV cache: the next token is the argmax every step."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            logits = model(torch.tensor([ids])).logits[0, -1]
            ids.append(int(torch.argmax(logits)))
    return ids[len(prompt):]


def harmony_checkpoint(folder):
    """A tiny gpt-oss checkpoint in `folder` whose tokenizer holds harmony's markers as special
    tokens and whose replies stop at <|return|> and <|call|> (gpt-oss's generation_config.json's;
    the byte tokenizer's own EOS, spelled <|end|>, is not one). Returns its tokenizers.Tokenizer."""
    import json
    from pathlib import Path

    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTokenizer

    from kvctl.daemon.server.reasoning import HARMONY

    folder = Path(folder)
    build_checkpoint("gpt-oss", folder)
    hf = HFTokenizer.from_file(str(folder / "tokenizer.json"))
    hf.add_special_tokens([AddedToken(marker, special=True) for marker in HARMONY])
    hf.save(str(folder / "tokenizer.json"))
    tokenizer_config = folder / "tokenizer_config.json"
    tokenizer_config.write_text(json.dumps({**json.loads(tokenizer_config.read_text()), "eos_token": "<|return|>"}))
    stops = [hf.token_to_id("<|return|>"), hf.token_to_id("<|call|>")]
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": stops}))
    return hf
