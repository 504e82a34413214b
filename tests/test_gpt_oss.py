"""gpt-oss: its config read as transformers reads it, its MXFP4 experts dequantised as
transformers dequantises them (and a quantised checkpoint served as the model they make), LoRA
refused on its router, and the quantisations kvd does not read refused by name. (Logits and greedy tokens against transformers, and its sliding
layers past their window: tests/test_model.py; batched, and served by kvd: tests/test_moe.py; the
attention sinks' kernels: tests/test_kernels_sinks.py.)"""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from safetensors.torch import load_file, save_file  # noqa: E402

from kvctl.daemon.model.config import ModelConfig, ModelError  # noqa: E402
from kvctl.daemon.model.llama import load_model  # noqa: E402
from kvctl.daemon.model.lora import load_adapters  # noqa: E402
from kvctl.daemon.model.moe import clamped_swiglu  # noqa: E402
from kvctl.kernels.mxfp4 import dequantise_mxfp4  # noqa: E402
from kvctl.daemon.model.rope import YarnScaling  # noqa: E402
from kvctl.daemon.model.weights import expected_tensors  # noqa: E402

from .lora_cases import write_adapter  # noqa: E402
from .model_cases import build_checkpoint  # noqa: E402
from .test_model import PROMPT, assert_serves_as_transformers  # noqa: E402

# gpt-oss-20b's config.json as published, less its quantization_config
GPT_OSS_20B = {
    "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0, "eos_token_id": 200002,
    "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880, "initial_context_length": 4096,
    "initializer_range": 0.02, "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 12, "max_position_embeddings": 131072,
    "model_type": "gpt_oss", "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24,
    "num_key_value_heads": 8, "num_local_experts": 32, "output_router_logits": False, "pad_token_id": 199999,
    "rms_norm_eps": 1e-05, "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                            "original_max_position_embeddings": 4096, "rope_type": "yarn",
                                            "truncate": False},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 201088}


def test_gpt_oss_20b_s_config_is_read_as_transformers_reads_it():
    c = ModelConfig.from_dict({**GPT_OSS_20B, "quantization_config": {"quant_method": "mxfp4"}})
    assert (c.architecture, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == ("gpt_oss", 24, 64, 8, 64)
    assert (c.qkv_bias, c.o_bias, c.attention_sinks, c.quantisation) == (True, True, True, "mxfp4")
    assert (c.sliding_window, c.sliding_layers) == (128, tuple(range(0, 24, 2)))
    assert (c.num_experts, c.experts_per_token, c.expert_intermediate_size, c.moe_layers) == (32, 4, 2880,
                                                                                             tuple(range(24)))
    assert (c.norm_topk_prob, c.stacked_experts, c.swiglu_limit, c.swiglu_alpha) == (True, True, 7.0, 1.702)
    assert (c.rope_theta, c.rope_scaling.factor, c.rope_scaling.truncate) == (150000.0, 32.0, False)
    assert isinstance(c.rope_scaling, YarnScaling) and c.rope_scaling.original_max_position_embeddings == 4096
    names = expected_tensors(c)
    assert [n for n in names if n.startswith("model.layers.3.")] == [
        "model.layers.3.input_layernorm.weight", "model.layers.3.post_attention_layernorm.weight",
        *(f"model.layers.3.self_attn.{x}_proj.weight" for x in "qkvo"),
        *(f"model.layers.3.self_attn.{x}_proj.bias" for x in "qkv"), "model.layers.3.self_attn.o_proj.bias",
        "model.layers.3.self_attn.sinks", "model.layers.3.mlp.router.weight", "model.layers.3.mlp.router.bias",
        *(f"model.layers.3.mlp.experts.{x}" for x in ("gate_up_proj", "gate_up_proj_bias", "down_proj",
                                                      "down_proj_bias"))]
    # transformers' defaults where a config leaves them out: layers 0, 2, 4... slide 128 tokens; YaRN x32
    bare = ModelConfig.from_dict({k: v for k, v in GPT_OSS_20B.items()
                                  if k not in ("layer_types", "sliding_window", "rope_scaling", "rope_theta",
                                               "swiglu_limit")})
    assert (bare.sliding_window, bare.sliding_layers, bare.swiglu_limit) == (128, c.sliding_layers, 7.0)
    assert (bare.rope_theta, bare.rope_scaling) == (c.rope_theta, c.rope_scaling)
    for field, value in (("swiglu_limit", 0), ("swiglu_alpha", "1.7")):
        with pytest.raises(ModelError) as refused:
            ModelConfig.from_dict({**GPT_OSS_20B, field: value})
        assert str(refused.value) == f"config.json: field {field!r} must be a positive number (got {value!r})"


def test_the_attention_biases_are_the_ones_transformers_builds():
    """attention_bias gives Q, K, V and the output projection biases (Llama, Qwen3, Gemma,
    gpt-oss); Qwen2's Q, K and V always have them and its output never; Mistral's, Mixtral's
    and Phi-3's projections have none, whatever attention_bias says."""
    base = {"vocab_size": 300, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
            "num_attention_heads": 2, "head_dim": 64, "attention_bias": True}
    biases = {arch: (c.qkv_bias, c.o_bias) for arch in ("LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen2ForCausalLM",
                                                         "MistralForCausalLM", "Phi3ForCausalLM")
              for c in [ModelConfig.from_dict({**base, "architectures": [arch]})]}
    assert biases == {"LlamaForCausalLM": (True, True), "Qwen3ForCausalLM": (True, True),
                      "Qwen2ForCausalLM": (True, False), "MistralForCausalLM": (False, False),
                      "Phi3ForCausalLM": (False, False)}
    assert ModelConfig.from_dict({**base, "architectures": ["LlamaForCausalLM"], "attention_bias": False}).o_bias is False


@pytest.mark.parametrize("config, message", [
    ({"quant_method": "fp8", "weight_block_size": [128, 128]},
     "quantization_config quant_method 'fp8' is not supported for llama (kvd reads mxfp4 (gpt_oss)); "
     "serve the unquantised checkpoint"),
    ({"quant_method": "mxfp4"},
     "quantization_config quant_method 'mxfp4' is not supported for llama (kvd reads mxfp4 (gpt_oss)); "
     "serve the unquantised checkpoint"),
    ("awq", "quantization_config quant_method None is not supported for llama (kvd reads mxfp4 (gpt_oss)); "
            "serve the unquantised checkpoint"),
], ids=["fp8", "mxfp4-llama", "not-an-object"])
def test_a_quantised_checkpoint_kvd_does_not_read_is_refused_by_name(config, message, tmp_path):
    """Before, an FP8 checkpoint's weights loaded as plain numbers, their scales never applied."""
    build_checkpoint("llama3", tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, "quantization_config": config}))
    with pytest.raises(ModelError) as refused:
        load_model(tmp_path)
    assert str(refused.value) == f"{tmp_path / 'config.json'}: {message}"
    # a multimodal checkpoint's quantization_config is its outer config's, beside its text_config
    with pytest.raises(ModelError) as refused:
        ModelConfig.from_dict({"architectures": ["Gemma3ForConditionalGeneration"], "text_config": {},
                               "quantization_config": config})
    assert str(refused.value) == "config.json: " + message.replace("for llama", "for gemma3")


def random_mxfp4(experts: int, rows: int, columns: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks and scales of an [experts, rows, columns] weight: every FP4 code, scales 2^-5..2^-2."""
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (experts, rows, columns // 32, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(122, 126, (experts, rows, columns // 32), generator=g, dtype=torch.uint8)
    return blocks, scales


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_mxfp4_dequantises_as_transformers_does(dtype):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks, scales = random_mxfp4(3, 40, 96, seed=1)
    scales[0, 0] = torch.tensor([0, 127, 254], dtype=torch.uint8)  # 2^-127, 1 and 2^127
    ours = dequantise_mxfp4(blocks, scales, dtype)
    assert ours.shape == (3, 40, 96) and ours.dtype == dtype
    # transformers hands back the unquantised checkpoint's layout, [E, columns, rows]
    assert torch.equal(ours.transpose(1, 2), convert_moe_packed_tensors(blocks, scales, dtype=dtype))
    # a byte's low nibble is the first value: 0x2F is -6 (code 15) then 1 (code 2), at scale 1
    one = dequantise_mxfp4(torch.full((1, 16), 0x2F, dtype=torch.uint8), torch.tensor([127], dtype=torch.uint8),
                           torch.float32)
    assert one[:4].tolist() == [-6.0, 1.0, -6.0, 1.0]
    # a weight of no rows, or of rows of no groups, is empty rather than an error
    assert dequantise_mxfp4(torch.zeros(0, 3, 16, dtype=torch.uint8), torch.zeros(0, 3, dtype=torch.uint8),
                            dtype).shape == (0, 96)
    assert dequantise_mxfp4(torch.zeros(2, 0, 16, dtype=torch.uint8), torch.zeros(2, 0, dtype=torch.uint8),
                            dtype).shape == (2, 0)


@pytest.mark.parametrize("blocks, scales, message", [
    (torch.zeros(2, 3, 16, dtype=torch.uint8), torch.zeros(2, 4, dtype=torch.uint8),
     "MXFP4 scales (2, 4) do not match blocks (2, 3, 16): one scale per group of 32"),
    (torch.zeros(2, 3, 8, dtype=torch.uint8), torch.zeros(2, 3, dtype=torch.uint8),
     "MXFP4 blocks must end in groups of 16 bytes, got shape (2, 3, 8)"),
    (torch.zeros(2, 3, 16), torch.zeros(2, 3, dtype=torch.uint8),
     "MXFP4 blocks and scales must be uint8, got torch.float32 and torch.uint8"),
], ids=["scales", "group", "dtype"])
def test_blocks_and_scales_that_do_not_make_one_weight_are_named(blocks, scales, message):
    with pytest.raises(ValueError) as refused:
        dequantise_mxfp4(blocks, scales, torch.float32)
    assert str(refused.value) == message


def write_mxfp4_checkpoint(hf, folder) -> None:
    """Quantise `hf`'s saved gpt-oss checkpoint in `folder` as gpt-oss's are published: each
    layer's experts as MXFP4 blocks and scales, the config saying so. `hf` is given the weights
    those make (transformers' own dequantisation), so it stays the reference."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    tensors = load_file(str(folder / "model.safetensors"))
    params = dict(hf.named_parameters())
    for layer in range(hf.config.num_hidden_layers):
        for seed, name in enumerate(("gate_up_proj", "down_proj")):
            key = f"model.layers.{layer}.mlp.experts.{name}"
            experts, columns, rows = tensors.pop(key).shape  # [E, in, out]
            blocks, scales = random_mxfp4(experts, rows, columns, seed=10 * layer + seed)
            tensors[key + "_blocks"], tensors[key + "_scales"] = blocks, scales
            with torch.no_grad():
                params[key].copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (folder / "config.json").write_text(json.dumps(config))


def test_an_mxfp4_checkpoint_is_served_as_the_weights_it_makes(tmp_path):
    """Its experts kept in MXFP4 (the default) or dequantised as they load (--dequantise-experts):
    transformers' output either way, the same logits bit for bit, in a quarter of the memory."""
    from kvctl.capacity import ModelShape

    hf = build_checkpoint("gpt-oss", tmp_path)
    write_mxfp4_checkpoint(hf, tmp_path)
    loaded = load_model(tmp_path)
    assert loaded.config.quantisation == "mxfp4" and not loaded.config.dequantise_experts
    layer = loaded.model.layers[1]
    experts, inter, hidden = loaded.config.num_experts, loaded.config.expert_intermediate_size, 128
    assert (layer.experts_gate_up.dtype, tuple(layer.experts_gate_up.shape)) == (
        torch.uint8, (experts, 2 * inter, hidden // 32, 16))
    assert tuple(layer.experts_gate_up_scales.shape) == (experts, 2 * inter, hidden // 32)
    assert (layer.experts_down.dtype, tuple(layer.experts_down_scales.shape)) == (
        torch.uint8, (experts, hidden, inter // 32))
    assert_serves_as_transformers(hf, loaded, PROMPT, 8)
    dequantised = load_model(tmp_path, dequantise_experts=True)
    assert dequantised.model.layers[1].experts_gate_up.dtype == torch.float32
    assert dequantised.model.layers[1].experts_gate_up_scales is None
    assert_serves_as_transformers(hf, dequantised, PROMPT, 8)
    from .test_model import full_forward_logits

    assert torch.equal(full_forward_logits(loaded, PROMPT), full_forward_logits(dequantised, PROMPT))
    # `kvctl capacity --model` counts the weights as kvd serves them: as published (blocks and scales as on
    # disk), or dequantised with --dequantise-experts
    kept, whole = loaded.model.weight_bytes(), dequantised.model.weight_bytes()
    assert ModelShape.from_model_dir(tmp_path).weights_bytes == kept < (tmp_path / "model.safetensors").stat().st_size
    assert ModelShape.from_model_dir(tmp_path, dequantise_experts=True).weights_bytes == whole
    # each expert weight: 17 bytes per 32 values kept, 128 dequantised to float32
    expert_values = loaded.config.num_layers * experts * 3 * inter * hidden
    assert whole - kept == expert_values * 4 - expert_values * 17 // 32
    # a checkpoint missing a layer's scales names the tensor
    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelError, match="tensor 'model.layers.1.mlp.experts.down_proj_scales' is missing"):
        load_model(tmp_path)


def test_experts_kept_in_mxfp4_sleep_wake_and_take_new_weights_as_the_rest_do(tmp_path):
    """Released to a host copy and restored (kvctl sleep, wake), or new weights copied in place
    (kvctl weights update): the blocks and scales go with every other tensor, and the model gives
    the same logits, bit for bit."""
    from kvctl.daemon.model.llama import stage_weights
    from kvctl.daemon.model.weights import load_weights

    from .test_model import full_forward_logits

    hf = build_checkpoint("gpt-oss", tmp_path)
    write_mxfp4_checkpoint(hf, tmp_path)
    loaded = load_model(tmp_path)
    before, served = full_forward_logits(loaded, PROMPT), loaded.model.weight_bytes()
    assert loaded.model.release_weights(keep_host_copy=True) == served and loaded.model.weights_released
    assert loaded.model.restore_weights() == served
    assert torch.equal(full_forward_logits(loaded, PROMPT), before)
    host = load_weights(tmp_path, loaded.config, loaded.model.dtype, torch.device("cpu"))
    assert host["model.layers.0.mlp.experts.down_proj"].dtype == torch.uint8
    copied = loaded.model.copy_weights_in(stage_weights(loaded.config, host, pin=False))
    assert copied == served and torch.equal(full_forward_logits(loaded, PROMPT), before)


def test_kvd_serve_keeps_the_experts_in_mxfp4_on_a_gpu_and_dequantises_them_on_a_cpu_unless_told(tmp_path):
    """--mxfp4-experts (KVD_MXFP4_EXPERTS, YAML mxfp4_experts): auto (the default) keeps them where a
    GPU's grouped GEMMs decode each tile, and dequantises them on a CPU, where dequantising each chosen
    expert every step would cost about 30 times its GEMM; keep and dequantise say which."""
    from kvctl.daemon.config import ConfigError, resolve

    from .daemon_fixtures import start_service

    hf = build_checkpoint("gpt-oss", tmp_path / "model")
    write_mxfp4_checkpoint(hf, tmp_path / "model")
    assert resolve({}, {"KVD_MXFP4_EXPERTS": "keep"}).mxfp4_experts == "keep"
    with pytest.raises(ConfigError) as refused:
        resolve({"mxfp4_experts": "fp16"}, {})
    assert str(refused.value) == ("mxfp4_experts: invalid value 'fp16' from --mxfp4-experts: must be one of auto, "
                                  "keep, dequantise")
    from rich.console import Console

    from kvctl.status_view import render_status

    from .daemon_fixtures import apps, call, token_table

    for setting, dtype, said in (("auto", torch.float32, "dequantised from MXFP4"),
                                 ("keep", torch.uint8, "kept in MXFP4 as published"),
                                 ("dequantise", torch.float32, "dequantised from MXFP4")):
        service = start_service(tmp_path / f"state-{setting}", model=str(tmp_path / "model"), device="cpu",
                                mxfp4_experts=setting)
        try:
            layer = service.loaded.model.layers[0]
            assert layer.experts_down.dtype == dtype and (layer.experts_down_scales is None) is (dtype != torch.uint8)
            assert service.loaded.config.dequantise_experts is (dtype != torch.uint8)
            unix, _ = apps(service, token_table(tmp_path))
            console = Console(record=True, width=160)
            render_status(call(unix, "GET", "/admin/status").json(), console)
            [row] = [line.split(None, 1)[1].strip() for line in console.export_text().splitlines()
                     if line.startswith("experts")]
            assert row == f"4 in 2 of 2 layers, 2 for each token, {said}"
            # new weights in place (an RL loop's next step) are read as the served ones are: kept or dequantised
            updated = call(unix, "POST", "/admin/weights", json={"model_path": str(tmp_path / "model")})
            assert updated.status_code == 200, updated.text
            assert service.loaded.model.layers[0].experts_down.dtype == dtype
        finally:
            service.shutdown(1)


def test_kvctl_capacity_counts_mxfp4_experts_kept_or_dequantised_as_kvd_serve_would(tmp_path, capsys, monkeypatch):
    from kvctl.capacity import ModelShape

    from .test_cli import cli

    hf = build_checkpoint("gpt-oss", tmp_path)
    write_mxfp4_checkpoint(hf, tmp_path)
    counted = {}
    for setting in ("auto", "keep", "dequantise"):
        status, out, _ = cli(capsys, "capacity", "--model", str(tmp_path), "--gpu-memory", "1GB", "--json",
                             "--mxfp4-experts", setting)
        assert status == 0
        counted[setting] = json.loads(out)["rows"][0]["weights_bytes"]
    assert counted["auto"] == counted["keep"] == ModelShape.from_model_dir(tmp_path).weights_bytes
    assert counted["dequantise"] == ModelShape.from_model_dir(tmp_path, dequantise_experts=True).weights_bytes
    assert counted["dequantise"] > counted["keep"]
    status, out, _ = cli(capsys, "capacity", "--model", str(tmp_path), "--gpu-memory", "1GB", "--json")
    assert json.loads(out)["mxfp4_experts"] == "kept"
    monkeypatch.setenv("COLUMNS", "200")
    status, out, _ = cli(capsys, "capacity", "--model", str(tmp_path), "--gpu-memory", "1GB")
    assert "The experts are counted in MXFP4, as kvd keeps them on a GPU (4.25 bits a weight)" in out
    status, out, _ = cli(capsys, "capacity", "--model", str(tmp_path), "--gpu-memory", "1GB", "--mxfp4-experts",
                         "dequantise")
    assert "The experts are counted dequantised to the model's dtype (kvd serve --mxfp4-experts dequantise)" in out
    status, _, err = cli(capsys, "capacity", "--model", str(tmp_path), "--mxfp4-experts", "fp8")
    assert status == 2
    assert err.strip() == "error: mxfp4_experts: unknown value 'fp8'; choose from auto, keep, dequantise"


def test_the_clamped_swiglu_clamps_the_gate_above_and_up_both_ways():
    glu = clamped_swiglu(limit=2.0, alpha=1.5)
    gate = torch.tensor([-3.0, 0.5, 5.0])
    up = torch.tensor([-4.0, 1.0, 4.0])
    g = torch.tensor([-3.0, 0.5, 2.0])  # the gate clamped above only
    u = torch.tensor([-2.0, 1.0, 2.0])
    torch.testing.assert_close(glu(gate, up), (u + 1) * g * torch.sigmoid(1.5 * g))


def test_an_adapter_of_the_router_or_the_experts_is_refused_and_one_of_the_attention_is_read(tmp_path):
    build_checkpoint("gpt-oss", tmp_path / "model")
    loaded = load_model(tmp_path / "model")
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    g = torch.Generator().manual_seed(0)
    key = "base_model.model.model.layers.1.mlp.router"
    folder = write_adapter(tmp_path / "router", ("router",), rank=2, model_config=config, tensors={
        key + ".lora_A.weight": torch.randn(2, 128, generator=g), key + ".lora_B.weight": torch.randn(4, 2, generator=g)})
    with pytest.raises(ModelError) as refused:
        load_adapters((("x", str(folder)),), loaded, "gpt-oss")
    assert str(refused.value) == (
        f"{folder / 'adapter_model.safetensors'}: tensor '{key}.lora_A.weight' adapts layer 1's MLP, a mixture of "
        "experts; kvd adapts a MoE layer's attention only")
    key = "base_model.model.model.layers.0.self_attn.o_proj"
    folder = write_adapter(tmp_path / "o", ("o_proj",), rank=2, model_config=config, tensors={
        key + ".lora_A.weight": torch.randn(2, 256, generator=g), key + ".lora_B.weight": torch.randn(128, 2, generator=g)})
    adapter = load_adapters((("o", str(folder)),), loaded, "gpt-oss")["o"]
    assert set(adapter.layers[0]) == {"o"} and not adapter.layers[1]


def test_gpt_oss_s_norm_applies_its_weight_in_float32_before_casting_back():
    """transformers' GptOssRMSNorm: (weight * normalised in float32).to(bfloat16), one rounding;
    Llama's casts the normalised values to bfloat16 first, then multiplies (two roundings)."""
    from kvctl.daemon.model.llama import rms_norm

    g = torch.Generator().manual_seed(0)
    x = (torch.randn(64, 128, generator=g) * 3).to(torch.bfloat16)
    weight = torch.rand(128, generator=g).to(torch.bfloat16) + 0.5
    normalised = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5)
    assert torch.equal(rms_norm(x, weight, 1e-5, "float32"), (weight * normalised).to(torch.bfloat16))
    assert torch.equal(rms_norm(x, weight, 1e-5, "llama"), weight * normalised.to(torch.bfloat16))
    assert not torch.equal(rms_norm(x, weight, 1e-5, "float32"), rms_norm(x, weight, 1e-5, "llama"))
    assert ModelConfig.from_dict(GPT_OSS_20B).norm_style == "float32"


def test_kvd_splits_a_harmony_reply_into_thinking_and_answer_whole_and_streamed(tmp_path, monkeypatch):
    """--reasoning-parser openai_gptoss on a gpt-oss checkpoint whose tokenizer holds harmony's
    markers as special tokens (as gpt-oss's does): decoded text keeps them for the parser, and the
    analysis channel becomes `reasoning`, the final one `content`, whole and streamed alike. The
    reply is scripted (the tiny model's weights are random); everything after the draw runs as served."""
    from .scripted_draws import script_draws
    from kvctl.daemon.server.reasoning import HARMONY

    from .daemon_fixtures import apps, call, sse_events, start_service, token_table
    from .model_cases import harmony_checkpoint

    hf = harmony_checkpoint(tmp_path / "model")
    template = tmp_path / "harmony.jinja"
    template.write_text("{% for m in messages %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endfor %}"
                        "<|start|>assistant", encoding="utf-8")
    reply = ("<|channel|>analysis<|message|>Count the blocks.<|end|><|start|>assistant<|channel|>final<|message|>"
             "Four.<|return|>")
    script = hf.encode(reply, add_special_tokens=False).ids
    assert [hf.id_to_token(i) for i in script].count("<|channel|>") == 2  # each marker one special token
    script_draws(monkeypatch, lambda logits, params, seed, index, step: script[step] if step < len(script) else 2)
    service = start_service(tmp_path / "state", model=str(tmp_path / "model"), chat_template=str(template),
                            reasoning_parser="openai_gptoss")
    try:
        assert sorted(service.loaded.tokenizer.kept_specials) == sorted(HARMONY)
        unix, _ = apps(service, token_table(tmp_path))
        ask = {"messages": [{"role": "user", "content": "How many blocks?"}], "max_tokens": 64}
        whole = call(unix, "POST", "/v1/chat/completions", json=ask).json()["choices"][0]
        assert whole["token_ids"] == script and whole["finish_reason"] == "stop"  # <|return|> ended it
        message = whole["message"]
        assert (message["reasoning"], message["reasoning_content"], message["content"]) == (
            "Count the blocks.", "Count the blocks.", "Four.")
        events = sse_events(call(unix, "POST", "/v1/chat/completions", json={**ask, "stream": True}))
        deltas = [e["choices"][0]["delta"] for e in events[:-1] if e["choices"]]
        assert "".join(d.get("reasoning") or "" for d in deltas) == "Count the blocks."
        assert "".join(d.get("content") or "" for d in deltas) == "Four."
    finally:
        service.shutdown(1)
