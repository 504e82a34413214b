"""The built-in demo checkpoint: a small deterministic Llama with a byte-level tokenizer.

Built in the state directory in the Hugging Face on-disk format and loaded through the
same loader as any other checkpoint; nothing is downloaded.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

DEMO_NAME = "kvd-demo-llama-v1"
DEMO_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 258,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "bos_token_id": 256,
    "eos_token_id": 257,
}
EMBED_STD = 1.0
HEAD_STD = 0.15  # keeps logits spread: sampling varies, greedy is not one repeated token
BOS, EOS = "<|begin|>", "<|end|>"
# The demo's chat format: each message as "<|role|>\n" + content + EOS + "\n", after one BOS; the
# reply is asked for with "<|assistant|>\n" and ends with EOS, which stops generation.
DEMO_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + eos_token + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


def write_byte_tokenizer(directory: Path) -> None:
    """A byte-level tokenizer: one token per byte, plus BOS and EOS (ids 256, 257); its
    post-processor puts BOS before a prompt, for kvd as for `transformers`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {symbol: index for index, symbol in enumerate(alphabet)}
    vocab[BOS], vocab[EOS] = 256, 257
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([BOS, EOS])
    tokenizer.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A $B",
                                                             special_tokens=[(BOS, 256)])
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": BOS, "eos_token": EOS, "tokenizer_class": "PreTrainedTokenizerFast"}, indent=2))


def write_chat_template(directory: Path) -> None:
    """The demo's chat template beside its tokenizer, atomically (a file of its own, outside
    tokenizer_config.json: the tokenizer's digest, and so every cached block's key, stays)."""
    staging = directory / ".chat_template.jinja.tmp"
    staging.write_text(DEMO_CHAT_TEMPLATE, encoding="utf-8")
    with open(staging, "rb") as handle:
        os.fsync(handle.fileno())
    staging.replace(directory / "chat_template.jinja")


def demo_weights(config: dict, seed: int = 0) -> dict:
    import torch

    g = torch.Generator().manual_seed(seed)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    q_out = config["num_attention_heads"] * config["head_dim"]
    kv_out = config["num_key_value_heads"] * config["head_dim"]

    def normal(*shape, std=0.02):
        return torch.randn(shape, generator=g) * std

    weights = {"model.embed_tokens.weight": normal(config["vocab_size"], hidden, std=EMBED_STD),
               "model.norm.weight": torch.ones(hidden),
               "lm_head.weight": normal(config["vocab_size"], hidden, std=HEAD_STD)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        weights.update({
            p + "input_layernorm.weight": torch.ones(hidden),
            p + "post_attention_layernorm.weight": torch.ones(hidden),
            p + "self_attn.q_proj.weight": normal(q_out, hidden, std=hidden ** -0.5),
            p + "self_attn.k_proj.weight": normal(kv_out, hidden, std=hidden ** -0.5),
            p + "self_attn.v_proj.weight": normal(kv_out, hidden, std=hidden ** -0.5),
            p + "self_attn.o_proj.weight": normal(hidden, q_out, std=q_out ** -0.5),
            p + "mlp.gate_proj.weight": normal(inter, hidden, std=hidden ** -0.5),
            p + "mlp.up_proj.weight": normal(inter, hidden, std=hidden ** -0.5),
            p + "mlp.down_proj.weight": normal(hidden, inter, std=inter ** -0.5),
        })
    return weights


def ensure_demo_checkpoint(state_dir: str | Path) -> Path:
    """The demo checkpoint's directory under `state_dir/models`, built once (atomically)."""
    from safetensors.torch import save_file

    target = Path(state_dir) / "models" / DEMO_NAME
    if (target / "config.json").is_file():
        if not (target / "chat_template.jinja").is_file():  # built before kvd served chat
            write_chat_template(target)
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".demo-", dir=target.parent))
    try:
        (staging / "config.json").write_text(json.dumps(DEMO_CONFIG, indent=2))
        save_file(demo_weights(DEMO_CONFIG), str(staging / "model.safetensors"))
        write_byte_tokenizer(staging)
        (staging / "chat_template.jinja").write_text(DEMO_CHAT_TEMPLATE, encoding="utf-8")
        for path in staging.iterdir():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
        try:
            staging.rename(target)
        except OSError:
            if not (target / "config.json").is_file():  # another process did not win the race
                raise
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return target
