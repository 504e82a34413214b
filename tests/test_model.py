"""The model loader and decoder against transformers' own implementation."""

from __future__ import annotations

import json
import math

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from kvctl.daemon.engine.engine import Engine, EngineSettings  # noqa: E402
from kvctl.daemon.engine.sampling import SamplingParams  # noqa: E402
from kvctl.daemon.model.config import ModelError  # noqa: E402
from kvctl.daemon.model.demo import ensure_demo_checkpoint  # noqa: E402
from kvctl.daemon.model.llama import ForwardBatch, load_model  # noqa: E402

from .model_cases import build_checkpoint, hf_greedy  # noqa: E402

PROMPT = [5, 17, 200, 33, 33, 101, 7, 250, 64, 9, 12, 180, 44, 3, 98, 120, 77, 31, 2, 150]


def full_forward_logits(loaded, ids, lora=None):
    """Last-position logits of one fresh prefill over `ids` (block size 16, identity table);
    `lora`: ForwardBatch.lora, the adapters of its rows."""
    n = len(ids)
    caches = loaded.model.allocate_cache(-(-n // 16) + 1, 16)
    batch = ForwardBatch(
        input_ids=torch.tensor(ids), positions=torch.arange(n), slot_mapping=torch.arange(n),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        context_lens=torch.tensor([n], dtype=torch.int32),
        block_tables=torch.arange(-(-n // 16) + 1, dtype=torch.int32)[None],
        logits_indices=torch.tensor([n - 1]), max_new_tokens=n, max_context=n, lora=lora)
    return loaded.model.forward(batch, caches)[0]


@pytest.mark.parametrize("kind", ["llama3", "llama2-tied-mha", "qwen2", "qwen3", "mistral", "qwen3-yarn",
                                  "llama-linear", "phi3", "gemma2", "gemma3", "gemma3-multimodal", "mixtral",
                                  "qwen3-moe", "qwen2-moe", "llama-bias", "gpt-oss"])
def test_greedy_tokens_and_logits_match_transformers(kind, tmp_path):
    hf = build_checkpoint(kind, tmp_path)
    assert_serves_as_transformers(hf, load_model(tmp_path), PROMPT, 12)


def assert_serves_as_transformers(hf, loaded, prompt: list[int], steps: int) -> None:
    """The logits of one prefill of `prompt`, and `steps` greedy tokens through an engine, are
    transformers' model `hf`'s."""
    with torch.no_grad():
        expected_logits = hf(torch.tensor([prompt])).logits[0, -1]
    torch.testing.assert_close(full_forward_logits(loaded, prompt), expected_logits, atol=1e-4, rtol=1e-4)
    engine = Engine(loaded, EngineSettings(num_blocks=32, block_size=16))
    request = engine.add_request(prompt, SamplingParams(max_tokens=steps, ignore_eos=True))
    engine.run_until_done()
    assert request.sequences[0].output_ids == hf_greedy(hf, prompt, steps)


def test_sharded_checkpoint_loads_through_its_index(tmp_path):
    hf = build_checkpoint("llama3", tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    loaded = load_model(tmp_path)
    with torch.no_grad():
        expected = hf(torch.tensor([PROMPT])).logits[0, -1]
    torch.testing.assert_close(full_forward_logits(loaded, PROMPT), expected, atol=1e-4, rtol=1e-4)


def test_bfloat16_weights_load_and_run(tmp_path):
    build_checkpoint("qwen2", tmp_path)
    loaded = load_model(tmp_path, dtype="bfloat16")
    assert loaded.model.dtype == torch.bfloat16
    engine = Engine(loaded, EngineSettings(num_blocks=16, block_size=16))
    request = engine.add_request(PROMPT, SamplingParams(max_tokens=4, ignore_eos=True))
    engine.run_until_done()
    assert len(request.sequences[0].output_ids) == 4


def test_unsupported_architecture_and_missing_tensor_are_named(tmp_path):
    build_checkpoint("llama3", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ModelError, match=r"unsupported architecture \['GPT2LMHeadModel'\]"):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    with pytest.raises(ModelError, match="tensor 'model.layers.2.input_layernorm.weight' is missing"):
        load_model(tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelError, match="no config.json"):
        load_model(empty)


LONG_PROMPT = [(i * 37 + 5) % 300 for i in range(70)]  # three windows of 24 tokens


SLIDING = {"mistral-window": (0, 1), "phi3-window": (0, 1), "qwen2-window": (1,), "gemma2": (0, 2),
           "gemma3": (0, 1), "gpt-oss": (0,)}  # the layers that slide


@pytest.mark.parametrize("kind", list(SLIDING))
def test_a_sliding_window_model_attends_to_its_window_past_it_as_transformers_does(kind, tmp_path):
    """Mistral 7B v0.1 slides every layer's window (4,096 tokens); Qwen's `use_sliding_window` the
    layers from `max_window_layers` on; Gemma 2 every other layer, its scores capped; Gemma 3
    five layers in six, with their own RoPE. Here a
    window of 24 tokens and a 70-token prompt: logits of a whole prefill, then greedy tokens
    through prompt chunks of 32 tokens (whose windows start in the chunk before) and decodes,
    and a second request that hits the first one's blocks."""
    hf = build_checkpoint(kind, tmp_path)
    loaded = load_model(tmp_path)
    assert (loaded.config.sliding_window, loaded.config.context_limit) == (24, 512)
    assert loaded.config.sliding_layers == SLIDING[kind]
    if not loaded.config.every_layer_slides:  # a full-attention layer needs every block: the cache gives none back
        from kvctl.daemon.server.status_body import sliding_window

        engine = Engine(loaded, EngineSettings(num_blocks=32, block_size=16))
        assert engine.cache.window is None
        assert sliding_window(loaded.config, engine.cache) == {
            "tokens": 24, "layers": len(SLIDING[kind]), "of": loaded.config.num_layers,
            "blocks_per_sequence": None, "released_blocks": 0}
    with torch.no_grad():
        expected = hf(torch.tensor([LONG_PROMPT])).logits[0, -1]
    torch.testing.assert_close(full_forward_logits(loaded, LONG_PROMPT), expected, atol=1e-4, rtol=1e-4)
    engine = Engine(loaded, EngineSettings(num_blocks=32, block_size=16, max_batch_tokens=32))
    first = engine.add_request(LONG_PROMPT, SamplingParams(max_tokens=12, ignore_eos=True))
    engine.run_until_done()
    want = hf_greedy(hf, LONG_PROMPT, 12)
    assert first.sequences[0].output_ids == want
    again = engine.add_request(LONG_PROMPT, SamplingParams(max_tokens=12, ignore_eos=True))
    engine.run_until_done()
    assert again.metrics.cached_tokens == 64 and again.sequences[0].output_ids == want


def test_kvd_serving_a_sliding_window_model_serves_the_models_positions_and_says_its_window(tmp_path, caplog):
    """What a client is told: `max_model_len` is the model's positions; a request past the
    window is served. What the operator is told: which layers slide, at start; in /admin/status,
    /metrics and kvctl status, the window, what a sequence holds under it and the blocks given back."""
    import re

    from rich.console import Console

    from .daemon_fixtures import call, settled, start_service
    from kvctl.daemon.server.app import create_app
    from kvctl.status_view import render_status

    build_checkpoint("mistral-window", tmp_path / "model")
    caplog.set_level("INFO", logger="kvd")  # for the whole test: the model may finish loading after start_service
    service = start_service(tmp_path, model=str(tmp_path / "model"), max_batch_tokens=32)
    try:
        unix = create_app(service, service.metrics, front="unix")
        assert call(unix, "GET", "/v1/models").json()["data"][0]["max_model_len"] == 512
        assert call(unix, "POST", "/tokenize", json={"prompt": "hello"}).json()["max_model_len"] == 512
        past = call(unix, "POST", "/v1/completions", json={"prompt": LONG_PROMPT, "max_tokens": 30, "ignore_eos": True})
        assert past.status_code == 200 and len(past.json()["choices"][0]["token_ids"]) == 30
        status = settled(lambda: call(unix, "GET", "/admin/status").json(), lambda s: not s["queue"]["running"])
        # 99 tokens computed when it finished: the window of the next (76..99) starts in block 4, so 0-3 had gone
        assert status["model"]["sliding_window"] == {"tokens": 24, "layers": 2, "of": 2, "blocks_per_sequence": 6,
                                                     "released_blocks": 4}
        metrics = call(unix, "GET", "/metrics").text
        assert re.search(r"^kvd_sliding_window_released_blocks_total 4\.0$", metrics, re.MULTILINE)
        console = Console(record=True, width=200)
        render_status(status, console)
        [row] = [line.split(None, 2)[2].strip() for line in console.export_text().splitlines()
                 if line.startswith("sliding window")]
        assert row == ("24 tokens, every layer: a sequence holds at most 6 blocks; 4 given back as windows passed "
                       "them (they stay cached)")
        assert any(r.getMessage() == "model: every one of its 2 layers attends to a sliding window of 24 tokens: "
                   "a sequence holds the blocks of its window, not of its whole context"
                   for r in caplog.records if r.levelname == "INFO")
    finally:
        service.shutdown(1)


@pytest.mark.parametrize("fields, window, layers", [
    ({"architectures": ["MistralForCausalLM"], "sliding_window": None}, None, ()),
    ({"architectures": ["MistralForCausalLM"], "sliding_window": 4096}, 4096, (0, 1, 2)),
    ({"architectures": ["Qwen2ForCausalLM"], "use_sliding_window": False, "sliding_window": 32768}, None, ()),
    ({"architectures": ["Qwen3ForCausalLM"], "use_sliding_window": True, "sliding_window": 4096,
      "max_window_layers": 1}, 4096, (1, 2)),
    ({"architectures": ["Qwen3ForCausalLM"], "use_sliding_window": True, "sliding_window": 4096,
      "max_window_layers": 3}, None, ()),  # no layer from max_window_layers on: every layer attends in full
    ({"architectures": ["Qwen3ForCausalLM"], "use_sliding_window": True, "sliding_window": 4096,
      "layer_types": ["full_attention"] * 3}, None, ()),  # the file's layer types decide
    ({"architectures": ["LlamaForCausalLM"], "sliding_window": 64,
      "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]}, 64, (0, 2)),
    ({"architectures": ["LlamaForCausalLM"], "sliding_window": 64}, None, ()),
    ({"architectures": ["Phi3ForCausalLM"], "sliding_window": 2047}, 2047, (0, 1, 2)),  # Phi-3 mini 4k
    ({"architectures": ["Phi3ForCausalLM"], "sliding_window": None}, None, ()),  # Phi-4
])
def test_the_sliding_window_is_read_as_transformers_reads_it(fields, window, layers):
    from kvctl.daemon.model.config import ModelConfig

    base = dict(vocab_size=300, hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=2,
                max_position_embeddings=8192)
    config = ModelConfig.from_dict({**base, **fields})
    assert (config.sliding_window, config.sliding_layers) == (window, layers)
    assert config.layer_windows() == tuple(window if i in layers else None for i in range(3))
    assert config.every_layer_slides == (len(layers) == 3)
    assert config.context_limit == 8192  # a window limits what a layer sees, not the context served


def test_layer_types_that_do_not_list_every_layer_are_named():
    from kvctl.daemon.model.config import ModelConfig

    base = dict(architectures=["LlamaForCausalLM"], vocab_size=300, hidden_size=128, intermediate_size=256,
                num_hidden_layers=3, num_attention_heads=2, sliding_window=64)
    with pytest.raises(ModelError) as refused:
        ModelConfig.from_dict({**base, "layer_types": ["sliding_attention"]})
    assert str(refused.value) == ("config.json: field 'layer_types' must list one type for each of the 3 layers "
                                  "(got ['sliding_attention'])")


@pytest.mark.parametrize("fields, message", [
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
     "config.json: rope_scaling type 'dynamic' is not supported (it rescales every position as the context grows, "
     "which K already in the cache cannot follow); supported: default, llama3, linear, yarn"),
    ({"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0]}},
     "config.json: rope_scaling type 'longrope' is not supported; supported: default, llama3, linear, yarn"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0}},
     "config.json: rope_scaling llama3 needs high_freq_factor as a positive number (got None)"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": "4"}},
     "config.json: rope_scaling yarn needs original_max_position_embeddings as a positive number (got None)"),
    ({"rope_scaling": {"type": "linear", "factor": 0}},
     "config.json: rope_scaling linear needs factor as a positive number (got 0)"),
    ({"partial_rotary_factor": 0.5},
     "config.json: partial_rotary_factor 0.5 is not supported (kvd rotates whole heads)"),
    ({"rope_scaling": "yarn"}, "config.json: field 'rope_scaling' must be an object (got 'yarn')"),
])
def test_rope_a_config_asks_for_that_kvd_cannot_follow_is_refused_by_name(fields, message):
    """Served with plain RoPE instead, such a model would answer, and answer wrongly."""
    from kvctl.daemon.model.config import ModelConfig

    base = dict(architectures=["LlamaForCausalLM"], vocab_size=300, hidden_size=128, intermediate_size=256,
                num_hidden_layers=2, num_attention_heads=2)
    with pytest.raises(ModelError) as refused:
        ModelConfig.from_dict({**base, **fields})
    assert str(refused.value) == message


def test_yarn_without_a_factor_takes_the_ratio_of_positions_and_its_mscale_pair():
    """DeepSeek-V3's configs give no factor (the positions over the original ones) and an mscale
    pair, whose ratio is the attention factor (1 when they are equal)."""
    from kvctl.daemon.model.config import ModelConfig
    from kvctl.daemon.model.rope import YarnScaling

    base = dict(architectures=["LlamaForCausalLM"], vocab_size=300, hidden_size=128, intermediate_size=256,
                num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=16384)
    config = ModelConfig.from_dict({**base, "rope_scaling": {"rope_type": "yarn", "original_max_position_embeddings": 4096,
                                                             "mscale": 1.0, "mscale_all_dim": 1.0}})
    assert config.rope_scaling == YarnScaling(4.0, 4096, 1.0)
    plain = ModelConfig.from_dict({**base, "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                            "original_max_position_embeddings": 4096}})
    assert plain.rope_scaling.attention_factor == pytest.approx(0.1 * math.log(4.0) + 1.0)


def test_a_sliding_window_that_is_not_a_positive_integer_is_named():
    from kvctl.daemon.model.config import ModelConfig

    base = dict(vocab_size=300, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                architectures=["MistralForCausalLM"])
    with pytest.raises(ModelError) as refused:
        ModelConfig.from_dict({**base, "sliding_window": "4096"})
    assert str(refused.value) == ("config.json: field 'sliding_window' must be a positive integer where layers "
                                  "slide (got '4096')")


def test_revision_changes_with_the_weights_so_old_blocks_are_unreachable(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    build_checkpoint("llama3", a, seed=0)
    build_checkpoint("llama3", b, seed=1)
    first, second = load_model(a), load_model(b)
    assert first.revision != second.revision
    assert load_model(a).revision == first.revision
    engine_a = Engine(first, EngineSettings(num_blocks=16, block_size=16))
    engine_b = Engine(second, EngineSettings(num_blocks=16, block_size=16))
    assert engine_a.namespace("t").root_key() != engine_b.namespace("t").root_key()


def test_demo_checkpoint_is_deterministic_and_loads_through_the_loader(tmp_path):
    first = ensure_demo_checkpoint(tmp_path / "one")
    second = ensure_demo_checkpoint(tmp_path / "two")
    assert (first / "model.safetensors").read_bytes() == (second / "model.safetensors").read_bytes()
    assert ensure_demo_checkpoint(tmp_path / "one") == first  # built once
    loaded = load_model(first)
    assert loaded.config.num_kv_heads < loaded.config.num_heads  # GQA
    ids = loaded.tokenizer.encode("héllo, kv")
    assert ids[0] == 256 and loaded.tokenizer.decode(ids) == "héllo, kv"
    assert loaded.revision == load_model(second).revision


def test_the_rope_table_grows_with_the_contexts_served_and_matches_a_full_one(tmp_path):
    """The table starts at 4,096 positions, doubles when a longer context comes, stops at the
    model's limit, and its rows equal those of a table built for every position at once."""
    from kvctl.daemon.model.llama import rope_table

    loaded = load_model(ensure_demo_checkpoint(tmp_path))  # 8,192 positions
    [rope] = loaded.model.ropes  # one RoPE for every layer
    assert rope.table.shape[0] == 4096
    full = rope_table(rope.inv_freq, 8192, loaded.model.dtype)
    assert rope.rows(4000).shape[0] == 4096
    grown = rope.rows(5000)
    assert grown.shape[0] == 8192
    torch.testing.assert_close(grown[[0, 4095, 4999, 8191]], full[[0, 4095, 4999, 8191]], atol=0, rtol=0)
    assert rope.rows(8192).shape[0] == 8192
