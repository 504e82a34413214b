"""Mixtures of experts (Mixtral, Qwen2-MoE, Qwen3-MoE): their config read as transformers reads
it, the routed MLP against its reference, batched serving against transformers, LoRA on their
attention (and refused on their experts), the capacity plan, and kvd serving one."""

from __future__ import annotations

import json
import math

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvctl.daemon.engine.engine import Engine, EngineSettings  # noqa: E402
from kvctl.daemon.engine.sampling import SamplingParams  # noqa: E402
from kvctl.daemon.model.config import ModelConfig, ModelError  # noqa: E402
from kvctl.daemon.model.llama import ACTIVATIONS, load_model  # noqa: E402
from kvctl.daemon.model.lora import load_adapters  # noqa: E402
from kvctl.daemon.model.moe import experts_mlp, gated, moe_mlp, moe_mlp_ref, route  # noqa: E402
from kvctl.daemon.model.weights import expected_tensors  # noqa: E402
from kvctl.daemon.server.status_body import experts  # noqa: E402

from .lora_cases import lora_tensors, write_adapter  # noqa: E402
from .model_cases import build_checkpoint, hf_greedy  # noqa: E402
from .test_model import full_forward_logits  # noqa: E402

BASE = {"vocab_size": 300, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64}


def test_the_experts_are_read_as_transformers_reads_them():
    mixtral = ModelConfig.from_dict({**BASE, "architectures": ["MixtralForCausalLM"], "num_local_experts": 8,
                                     "num_experts_per_tok": 2})
    assert (mixtral.num_experts, mixtral.experts_per_token, mixtral.expert_intermediate_size) == (8, 2, 256)
    assert (mixtral.moe_layers, mixtral.norm_topk_prob, mixtral.shared_expert_intermediate_size) == ((0, 1, 2, 3),
                                                                                                     True, 0)
    assert mixtral.experts_prefix == "block_sparse_moe." and not mixtral.qkv_bias
    # every second layer sparse, and layer 3 kept dense: layer 1 alone routes
    qwen3 = ModelConfig.from_dict({**BASE, "architectures": ["Qwen3MoeForCausalLM"], "num_experts": 128,
                                   "num_experts_per_tok": 8, "moe_intermediate_size": 768, "decoder_sparse_step": 2,
                                   "mlp_only_layers": [3], "norm_topk_prob": True})
    assert (qwen3.num_experts, qwen3.experts_per_token, qwen3.expert_intermediate_size) == (128, 8, 768)
    assert (qwen3.moe_layers, qwen3.norm_topk_prob, qwen3.qk_norm, qwen3.experts_prefix) == ((1,), True, True,
                                                                                             "mlp.")
    qwen2 = ModelConfig.from_dict({**BASE, "architectures": ["Qwen2MoeForCausalLM"], "num_experts": 60,
                                   "num_experts_per_tok": 4, "moe_intermediate_size": 1408,
                                   "shared_expert_intermediate_size": 5632})
    assert (qwen2.moe_layers, qwen2.norm_topk_prob, qwen2.shared_expert_intermediate_size, qwen2.qkv_bias) == (
        (0, 1, 2, 3), False, 5632, True)
    dense = ModelConfig.from_dict({**BASE, "architectures": ["Qwen3ForCausalLM"]})
    assert (dense.num_experts, dense.moe_layers) == (0, ())
    # what kvctl status says of them
    assert (experts(qwen3), experts(qwen2), experts(dense)) == (
        {"experts": 128, "per_token": 8, "layers": 1, "of": 4, "shared_expert": False, "weights": None},
        {"experts": 60, "per_token": 4, "layers": 4, "of": 4, "shared_expert": True, "weights": None}, None)
    names = expected_tensors(qwen2)
    assert "model.layers.0.mlp.experts.59.down_proj.weight" in names and "model.layers.0.mlp.gate_proj.weight" \
        not in names
    assert names.count("model.layers.2.mlp.shared_expert_gate.weight") == 1
    assert "model.layers.1.block_sparse_moe.experts.7.w3.weight" in expected_tensors(mixtral)


@pytest.mark.parametrize("fields, message", [
    ({"architectures": ["MixtralForCausalLM"], "num_experts_per_tok": 2},
     "field 'num_local_experts' must be an integer >= 1 (got None)"),
    ({"architectures": ["MixtralForCausalLM"], "num_local_experts": 2, "num_experts_per_tok": 3},
     "field 'num_experts_per_tok' 3 is more than the 2 experts"),
    ({"architectures": ["Qwen3MoeForCausalLM"], "num_experts": 4, "num_experts_per_tok": 2},
     "field 'moe_intermediate_size' must be an integer >= 1 (got None)"),
    ({"architectures": ["Qwen3MoeForCausalLM"], "num_experts": 4, "num_experts_per_tok": 2,
      "moe_intermediate_size": 64, "mlp_only_layers": "1"},
     "field 'mlp_only_layers' must be a list of layer numbers (got '1')"),
    ({"architectures": ["Qwen2MoeForCausalLM"], "num_experts": 4, "num_experts_per_tok": 2,
      "moe_intermediate_size": 64, "decoder_sparse_step": 0},
     "field 'decoder_sparse_step' must be an integer >= 1 (got 0)"),
])
def test_experts_kvd_cannot_read_are_named(fields, message):
    with pytest.raises(ModelError) as refused:
        ModelConfig.from_dict({**BASE, **fields})
    assert str(refused.value) == f"config.json: {message}"


@pytest.mark.parametrize("top_k, normalise", [(1, True), (2, True), (2, False), (4, False)])
def test_the_routed_mlp_equals_every_expert_weighed_by_the_router(top_k, normalise):
    g = torch.Generator().manual_seed(top_k)
    x = torch.randn(37, 32, generator=g)
    router, gate_up, down = torch.randn(6, 32, generator=g), torch.randn(6, 48, 32, generator=g) * 0.2, \
        torch.randn(6, 32, 24, generator=g) * 0.2
    silu = gated(ACTIVATIONS["silu"])
    torch.testing.assert_close(moe_mlp(x, router, gate_up, down, top_k, normalise, silu),
                               moe_mlp_ref(x, router, gate_up, down, top_k, normalise, silu), atol=1e-5, rtol=1e-5)
    weights, experts = route(x, router, top_k, normalise)
    probs = torch.softmax(x @ router.T, dim=-1)
    assert experts.tolist() == torch.topk(probs, top_k, dim=-1).indices.tolist()
    expected = torch.topk(probs, top_k, dim=-1).values
    torch.testing.assert_close(weights, expected / expected.sum(-1, keepdim=True) if normalise else expected)


def test_an_expert_no_token_chose_does_not_run():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(9, 16, generator=g)
    gate_up, down = torch.randn(4, 20, 16, generator=g), torch.randn(4, 16, 10, generator=g)
    gate_up[3] = math.nan  # expert 3 would poison every row it ran over
    weights = torch.full((9, 2), 0.5)
    experts = torch.tensor([[0, 1], [1, 2], [2, 0]] * 3)
    out = experts_mlp(x, weights, experts, gate_up, down, gated(ACTIVATIONS["silu"]))
    assert torch.isfinite(out).all()
    row = 4  # experts 1 and 2, half each
    halves = [torch.nn.functional.linear(torch.nn.functional.silu(a) * b, down[e])
              for e in (1, 2) for a, b in [torch.nn.functional.linear(x[row], gate_up[e]).chunk(2)]]
    torch.testing.assert_close(out[row], 0.5 * halves[0] + 0.5 * halves[1])


@pytest.mark.parametrize("kind", ["mixtral", "qwen3-moe", "qwen2-moe", "gpt-oss"])
def test_a_batch_of_requests_gets_transformers_greedy_tokens_each(kind, tmp_path):
    """Rows of many sequences in one step route each on its own: three prompts decoded together
    (and one sharing another's cached prefix) give what transformers gives each alone. (gpt-oss:
    each sunk by its own heads' sinks, a prompt past its sliding layer's window of 24.)"""
    hf = build_checkpoint(kind, tmp_path)
    loaded = load_model(tmp_path)
    assert loaded.config.moe_layers == ((0,) if kind == "qwen3-moe" else (0, 1))
    prompts = [list(range(5, 45)), [7, 250, 64, 9, 12, 180, 44, 3], list(range(5, 37)) + [99, 98, 97]]
    engine = Engine(loaded, EngineSettings(num_blocks=32, block_size=16))
    requests = [engine.add_request(p, SamplingParams(max_tokens=10, ignore_eos=True)) for p in prompts]
    engine.run_until_done()
    assert [r.sequences[0].output_ids for r in requests] == [hf_greedy(hf, p, 10) for p in prompts]
    again = engine.add_request(prompts[0], SamplingParams(max_tokens=10, ignore_eos=True))
    engine.run_until_done()
    assert again.metrics.cached_tokens == 32 and again.sequences[0].output_ids == requests[0].sequences[0].output_ids


def test_a_lora_adapter_adapts_a_moe_model_s_attention_as_peft_does_and_refuses_its_experts(tmp_path):
    peft = pytest.importorskip("peft")
    from dataclasses import replace

    from kvctl.capacity import ModelShape, lora_bytes

    hf = build_checkpoint("qwen3-moe", tmp_path / "model")  # layer 0 routes, layer 1 is dense
    loaded = load_model(tmp_path / "model")
    # by the projections' names PEFT adapts layer 0's experts too (its target_parameters): refused
    everywhere = peft.get_peft_model(build_checkpoint("qwen3-moe", tmp_path / "again"), peft.LoraConfig(
        init_lora_weights=False, r=4, lora_alpha=8,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    everywhere.save_pretrained(tmp_path / "experts")
    with pytest.raises(ModelError) as refused:
        load_adapters((("x", str(tmp_path / "experts")),), loaded, "moe")
    assert str(refused.value).endswith("adapts layer 0's MLP, a mixture of experts; kvd adapts a MoE layer's "
                                       "attention only")
    torch.manual_seed(0)
    tuned = peft.get_peft_model(hf, peft.LoraConfig(init_lora_weights=False, lora_dropout=0.0, r=4, lora_alpha=8,
                                                    target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])).eval()
    tuned.save_pretrained(tmp_path / "adapter")
    loaded.adapters = load_adapters((("x", str(tmp_path / "adapter")),), loaded, "moe")
    adapter = loaded.adapters["x"]
    assert set(adapter.layers[0]) == set(adapter.layers[1]) == {"qkv", "o"}
    prompt = [5, 17, 200, 33, 33, 101, 7, 250, 64, 9, 12, 180, 44, 3, 98, 120, 77, 31, 2, 150]
    with torch.no_grad():
        expected = tuned(torch.tensor([prompt])).logits[0, -1]
    torch.testing.assert_close(full_forward_logits(loaded, prompt, lora=[(adapter, None)]), expected,
                               atol=1e-4, rtol=1e-4)
    # every projection kvd adapts: attention in both layers, the MLP of dense layer 1 (what capacity plans)
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    attention, mlp = ("q_proj", "k_proj", "v_proj", "o_proj"), ("gate_proj", "up_proj", "down_proj")
    folder = write_adapter(tmp_path / "every", attention + mlp, rank=4, tensors={
        **lora_tensors(attention, 4, layers=[0, 1], config=config), **lora_tensors(mlp, 4, 2, layers=[1],
                                                                                   config=config)})
    every = load_adapters((("every", str(folder)),), loaded, "moe")["every"]
    assert set(every.layers[0]) == {"qkv", "o"} and set(every.layers[1]) == {"qkv", "o", "gate_up", "down"}
    shape = ModelShape.from_model_dir(tmp_path / "model")
    assert shape.moe_layers == 1 and lora_bytes(replace(shape, dtype="float32"), 4) == every.nbytes


def test_an_adapter_of_a_moe_layer_s_mlp_is_refused_by_name(tmp_path):
    build_checkpoint("qwen3-moe", tmp_path / "model")
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    folder = write_adapter(tmp_path / "adapter", ("gate_proj",), rank=2,
                           tensors=lora_tensors(("q_proj", "gate_proj"), 2, layers=[0], config=config))
    loaded = load_model(tmp_path / "model")
    with pytest.raises(ModelError) as refused:
        load_adapters((("x", str(folder)),), loaded, "moe")
    assert str(refused.value) == (
        f"{folder / 'adapter_model.safetensors'}: tensor 'base_model.model.model.layers.0.mlp.gate_proj.lora_A.weight' "
        "adapts layer 0's MLP, a mixture of experts; kvd adapts a MoE layer's attention only")


@pytest.mark.parametrize("kind, architecture, window", [
    ("mixtral", "mixtral", None),
    # gpt-oss's layer 1 attends in full, so every block is kept
    ("gpt-oss", "gpt_oss", {"tokens": 24, "layers": 1, "of": 2, "blocks_per_sequence": None, "released_blocks": 0}),
])
def test_kvd_serves_a_mixture_of_experts_and_caches_its_prefixes(kind, architecture, window, tmp_path):
    from rich.console import Console

    from kvctl.status_view import render_status

    from .daemon_fixtures import apps, call, start_service, token_table

    hf = build_checkpoint(kind, tmp_path / "model")
    service = start_service(tmp_path / "state", model=str(tmp_path / "model"))
    try:
        unix, _ = apps(service, token_table(tmp_path))
        prompt = list(range(5, 55))
        body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
        first, second = (call(unix, "POST", "/v1/completions", json=body).json() for _ in range(2))
        assert first["choices"][0]["text"] == second["choices"][0]["text"]
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 48
        status = call(unix, "GET", "/admin/status").json()
        assert (status["model"]["architecture"], status["model"]["sliding_window"]) == (architecture, window)
        assert status["model"]["experts"] == {"experts": 4, "per_token": 2, "layers": 2, "of": 2,
                                              "shared_expert": False, "weights": None}
        console = Console(record=True, width=120)
        render_status(status, console)
        [row] = [line.split(None, 1)[1].strip() for line in console.export_text().splitlines()
                 if line.startswith("experts")]
        assert row == "4 in 2 of 2 layers, 2 for each token"
        assert first["choices"][0]["text"] == service.loaded.tokenizer.decode(hf_greedy(hf, prompt, 6))
    finally:
        service.shutdown(deadline=2)
