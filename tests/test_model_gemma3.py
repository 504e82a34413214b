"""Gemma 2 and 3: their configs as the Hub ships them, what kvd refuses of them, and Gemma 3's
multimodal checkpoints' language model (the models themselves are checked against transformers
in test_model.py)."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from kvctl.capacity import ModelShape, language_model_bytes  # noqa: E402
from kvctl.daemon.model.config import ModelConfig, ModelError  # noqa: E402
from kvctl.daemon.model.llama import load_model  # noqa: E402
from kvctl.daemon.model.rope import LinearScaling  # noqa: E402

from .model_cases import build_checkpoint  # noqa: E402
from .test_model import LONG_PROMPT, full_forward_logits  # noqa: E402

# google/gemma-3-1b-it's config.json, as transformers 4.50 wrote it: no layer_types, the sliding
# layers' RoPE base as rope_local_base_freq
GEMMA3_1B = {
    "architectures": ["Gemma3ForCausalLM"], "attention_bias": False, "attn_logit_softcapping": None,
    "bos_token_id": 2, "eos_token_id": [1, 106], "final_logit_softcapping": None, "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1152, "intermediate_size": 6912,
    "max_position_embeddings": 32768, "model_type": "gemma3_text", "num_attention_heads": 4,
    "num_hidden_layers": 26, "num_key_value_heads": 1, "pad_token_id": 0, "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000, "rope_scaling": None, "rope_theta": 1000000,
    "sliding_window": 512, "sliding_window_pattern": 6, "torch_dtype": "bfloat16", "vocab_size": 262144,
}
# google/gemma-3-4b-it's: the language model's text_config gives only what differs from
# transformers' Gemma3TextConfig defaults; dtype and EOS are the outer config's
GEMMA3_4B = {
    "architectures": ["Gemma3ForConditionalGeneration"], "eos_token_id": [1, 106], "model_type": "gemma3",
    "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                    "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                    "sliding_window": 1024},
    "torch_dtype": "bfloat16", "vision_config": {"model_type": "siglip_vision_model"},
}


# google/gemma-2-9b-it's, as transformers 4.42 wrote it: scores capped at 50, logits at 30, every
# other layer slides a window of 4,096 tokens
GEMMA2_9B = {
    "architectures": ["Gemma2ForCausalLM"], "attention_bias": False, "attn_logit_softcapping": 50.0,
    "bos_token_id": 2, "cache_implementation": "hybrid", "eos_token_id": 1, "final_logit_softcapping": 30.0,
    "head_dim": 256, "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 3584, "intermediate_size": 14336, "max_position_embeddings": 8192, "model_type": "gemma2",
    "num_attention_heads": 16, "num_hidden_layers": 42, "num_key_value_heads": 8, "pad_token_id": 0,
    "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_theta": 10000.0, "sliding_window": 4096,
    "sliding_window_size": 4096, "torch_dtype": "float32", "vocab_size": 256000,
}


def full_layers(layers: int, pattern: int = 6) -> tuple[int, ...]:
    return tuple(i for i in range(layers) if (i + 1) % pattern == 0)


def test_gemma_3_1b_reads_as_transformers_reads_it():
    config = ModelConfig.from_dict(GEMMA3_1B)
    assert (config.architecture, config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim) == (
        "gemma3", 26, 4, 1, 256)
    assert config.sliding_window == 512
    assert set(range(26)) - set(config.sliding_layers) == {5, 11, 17, 23} == set(full_layers(26))
    assert (config.rope_theta, config.rope_scaling) == (1_000_000.0, None)
    assert (config.sliding_rope_theta, config.sliding_rope_scaling) == (10_000.0, None)
    assert config.attention_scale == 256 ** -0.5 and config.embedding_scale == 1152 ** 0.5
    assert (config.activation, config.gemma_norms, config.qk_norm, config.tie_word_embeddings) == (
        "gelu_tanh", True, True, True)
    assert (config.eos_token_ids, config.dtype, config.context_limit) == ((1, 106), "bfloat16", 32768)
    assert not config.every_layer_slides  # its full layers read every block: the cache gives none back


def test_gemma_3_4b_reads_its_text_config_with_transformers_defaults():
    config = ModelConfig.from_dict(GEMMA3_4B)
    assert (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim) == (
        34, 2560, 8, 4, 256)
    assert (config.vocab_size, config.max_position_embeddings, config.dtype, config.eos_token_ids) == (
        262208, 131072, "bfloat16", (1, 106))
    assert config.sliding_window == 1024 and set(range(34)) - set(config.sliding_layers) == {5, 11, 17, 23, 29}
    # the full layers' RoPE is scaled; the sliding layers' is not
    assert (config.rope_theta, config.rope_scaling) == (1_000_000.0, LinearScaling(8.0))
    assert (config.sliding_rope_theta, config.sliding_rope_scaling) == (10_000.0, None)
    assert config.attention_scale == 256 ** -0.5 and config.final_logit_softcapping is None


def test_gemma_2_9b_reads_as_transformers_reads_it():
    config = ModelConfig.from_dict(GEMMA2_9B)
    assert (config.architecture, config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim) == (
        "gemma2", 42, 16, 8, 256)
    assert config.sliding_window == 4096 and config.sliding_layers == tuple(range(0, 42, 2))
    assert (config.attn_logit_softcapping, config.final_logit_softcapping) == (50.0, 30.0)
    assert (config.rope_theta, config.rope_scaling, config.sliding_rope_theta) == (10_000.0, None, None)
    assert (config.activation, config.gemma_norms, config.qk_norm) == ("gelu_tanh", True, False)
    assert config.attention_scale == 256 ** -0.5 and config.embedding_scale == 3584 ** 0.5


@pytest.mark.parametrize("fields, message", [
    ({"attn_logit_softcapping": 0},
     "config.json: field 'attn_logit_softcapping' must be a positive number (got 0)"),
    ({"attn_logit_softcapping": float("inf")},
     "config.json: field 'attn_logit_softcapping' must be a positive number (got inf)"),
    ({"use_bidirectional_attention": True},
     "config.json: use_bidirectional_attention true is not supported (kvd decodes causally)"),
    ({"hidden_activation": "relu"},
     "config.json: field 'hidden_activation' 'relu' is not supported; supported: silu, gelu_pytorch_tanh"),
    ({"sliding_window_pattern": 0}, "config.json: field 'sliding_window_pattern' must be a positive integer (got 0)"),
    ({"query_pre_attn_scalar": -1}, "config.json: field 'query_pre_attn_scalar' must be a positive number (got -1)"),
    ({"final_logit_softcapping": "30"},
     "config.json: field 'final_logit_softcapping' must be a positive number (got '30')"),
    ({"rope_local_base_freq": None, "rope_parameters": {"full_attention": {"rope_theta": 1e6},
                                                        "sliding_attention": {"rope_theta": 0}}},
     "config.json: the sliding layers' rope_theta must be a positive number (got 0)"),
])
def test_what_kvd_does_not_compute_is_refused_by_name(fields, message):
    """EmbeddingGemma's bidirectional attention, an activation or a cap kvd cannot follow:
    served anyway they would answer, and answer wrongly."""
    with pytest.raises(ModelError) as refused:
        ModelConfig.from_dict({**GEMMA3_1B, **fields})
    assert str(refused.value) == message


def test_a_multimodal_config_without_its_text_config_is_named():
    with pytest.raises(ModelError) as refused:
        ModelConfig.from_dict({"architectures": ["Gemma3ForConditionalGeneration"], "text_config": None})
    assert str(refused.value) == ("config.json: field 'text_config' must be an object for "
                                  "Gemma3ForConditionalGeneration (got None)")


def test_an_activation_the_llama_family_does_not_use_is_refused():
    base = dict(architectures=["LlamaForCausalLM"], vocab_size=300, hidden_size=128, intermediate_size=256,
                num_hidden_layers=2, num_attention_heads=2)
    assert ModelConfig.from_dict({**base, "hidden_act": "silu"}).activation == "silu"
    with pytest.raises(ModelError) as refused:
        ModelConfig.from_dict({**base, "hidden_act": "gelu"})
    assert str(refused.value) == "config.json: field 'hidden_act' 'gelu' is not supported; supported: silu, " \
                                 "gelu_pytorch_tanh"


@pytest.mark.parametrize("layout", ["language_model.model.", "model.language_model."])
def test_a_multimodal_checkpoint_serves_its_language_model_and_leaves_the_vision_tower(layout, tmp_path):
    """transformers 4 saved the language model under `language_model.model.`, 5 keeps it under
    `model.language_model.`: either loads, with transformers' own logits for text, and no tensor
    of the vision tower is read. kvctl capacity counts the bytes kvd reads, not the tower's."""
    from safetensors.torch import load_file, save_file

    hf = build_checkpoint("gemma3-multimodal", tmp_path)
    [path] = tmp_path.glob("*.safetensors")
    tensors = load_file(str(path))
    assert any(name.startswith("vision_tower.") for name in tensors)
    renamed = {(layout + name[len("language_model.model."):] if name.startswith("language_model.model.") else name): t
               for name, t in tensors.items()}
    save_file(renamed, str(path), metadata={"format": "pt"})
    loaded = load_model(tmp_path)
    assert loaded.config.architecture == "gemma3" and loaded.config.sliding_layers == (0, 1)
    assert sorted(loaded.model.w) == ["model.embed_tokens.weight", "model.norm.weight"]  # the rest packed in layers
    with torch.no_grad():
        expected = hf(torch.tensor([LONG_PROMPT])).logits[0, -1]
    torch.testing.assert_close(full_forward_logits(loaded, LONG_PROMPT), expected, atol=1e-4, rtol=1e-4)
    text_bytes = sum(p.numel() * p.element_size() for p in hf.model.language_model.parameters())
    config = json.loads((tmp_path / "config.json").read_text())
    assert language_model_bytes(tmp_path, config) == text_bytes < path.stat().st_size - 10_000
    shape = ModelShape.from_model_dir(tmp_path)
    assert (shape.layers, shape.kv_heads, shape.head_dim, shape.weights_bytes, shape.sliding_window) == (
        3, 2, 64, text_bytes, None)
    assert shape.mixed_window == (24, 2)  # read from the multimodal config's text_config


def test_kvctl_capacity_plans_gemma_3_4b_from_its_config(tmp_path, capsys):
    from .test_cli import cli

    (tmp_path / "config.json").write_text(json.dumps(GEMMA3_4B))
    status, out, _ = cli(capsys, "capacity", "--model", str(tmp_path), "--gpu-memory", "80GB", "--weights-bytes",
                         "8600000000", "--context", "8192", "--dtype", "bfloat16", "--json")
    document = json.loads(out)
    assert status == 0 and document["rows"][0]["bytes_per_token"] == 2 * 34 * 4 * 256 * 2  # 139,264
    # its full layers read every block: counted whole, and said why
    assert "sliding_window" not in document
    assert document["mixed_sliding_window"] == {"tokens": 1024, "layers": 29, "of": 34}
    status, out, _ = cli(capsys, "capacity", "--model", str(tmp_path), "--gpu-memory", "80GB", "--weights-bytes",
                         "8600000000", "--context", "8192", "--dtype", "bfloat16")
    assert status == 0 and ("29 of the 34 layers slide a window of 1,024 tokens; the others attend to the whole "
                            "context, so kvd keeps every block of a sequence, as counted here.") in " ".join(out.split())


def test_kvd_serves_gemma_3_with_transformers_tokens_and_says_which_layers_slide(tmp_path, caplog):
    from .daemon_fixtures import call, settled, start_service
    from .model_cases import hf_greedy
    from kvctl.daemon.server.app import create_app

    hf = build_checkpoint("gemma3", tmp_path / "model")
    caplog.set_level("INFO", logger="kvd")  # for the whole test: the model may finish loading after start_service
    service = start_service(tmp_path, model=str(tmp_path / "model"), max_batch_tokens=32)
    try:
        unix = create_app(service, service.metrics, front="unix")
        reply = call(unix, "POST", "/v1/completions", json={"prompt": LONG_PROMPT, "max_tokens": 12,
                                                             "ignore_eos": True, "temperature": 0})
        assert reply.status_code == 200 and reply.json()["choices"][0]["token_ids"] == hf_greedy(hf, LONG_PROMPT, 12)
        status = settled(lambda: call(unix, "GET", "/admin/status").json(), lambda s: not s["queue"]["running"])
        assert status["model"]["architecture"] == "gemma3"
        assert status["model"]["sliding_window"] == {"tokens": 24, "layers": 2, "of": 3, "blocks_per_sequence": None,
                                                     "released_blocks": 0}
        assert any(r.getMessage() == "model: 2 of its 3 layers attend to a sliding window of 24 tokens, the others to "
                   "the whole context, which a sequence keeps every block of" for r in caplog.records)
    finally:
        service.shutdown(1)


@pytest.mark.parametrize("kind", ["gemma3", "gemma3-multimodal"])
def test_a_peft_lora_adapter_of_gemma_3_gives_peft_s_logits(kind, tmp_path):
    """PEFT names a multimodal model's language-model tensors under its own prefix and adapts its
    vision tower's projections too: kvd reads the first as the text model's and skips the second
    (the tower is not served: it changes nothing kvd computes)."""
    peft = pytest.importorskip("peft")
    from safetensors import safe_open

    from kvctl.daemon.model.lora import load_adapters

    hf = build_checkpoint(kind, tmp_path / "model")
    torch.manual_seed(0)
    tuned = peft.get_peft_model(hf, peft.LoraConfig(init_lora_weights=False, lora_dropout=0.0, r=4, lora_alpha=8,
                                                    target_modules=["q_proj", "v_proj", "o_proj", "down_proj"])).eval()
    tuned.save_pretrained(tmp_path / "adapter")
    with safe_open(str(tmp_path / "adapter" / "adapter_model.safetensors"), "pt") as handle:
        assert any("vision_tower" in name for name in handle.keys()) == (kind == "gemma3-multimodal")
    loaded = load_model(tmp_path / "model")
    loaded.adapters = load_adapters((("x", str(tmp_path / "adapter")),), loaded, "gemma")
    adapter = loaded.adapters["x"]
    assert adapter.modules == ("q_proj", "v_proj", "o_proj", "down_proj") and adapter.rank == 4
    with torch.no_grad():
        expected = tuned(torch.tensor([LONG_PROMPT])).logits[0, -1]
    adapted = full_forward_logits(loaded, LONG_PROMPT, lora=[(adapter, None)])
    torch.testing.assert_close(adapted, expected, atol=1e-4, rtol=1e-4)
    assert (adapted - full_forward_logits(loaded, LONG_PROMPT)).abs().max() > 0.05
