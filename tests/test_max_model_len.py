"""max_model_len (vLLM's --max-model-len): the longest context kvd serves, below the model's own."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from kvctl.daemon.config import ConfigError, resolve  # noqa: E402
from kvctl.daemon.engine.engine import Engine, EngineSettings  # noqa: E402
from kvctl.daemon.engine.sampling import ContextLengthExceeded, SamplingParams  # noqa: E402
from kvctl.daemon.model.demo import ensure_demo_checkpoint  # noqa: E402
from kvctl.daemon.model.llama import load_model  # noqa: E402

from .daemon_fixtures import apps, call, start_service, token_table  # noqa: E402

PROMPT = list(range(20))


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return load_model(ensure_demo_checkpoint(tmp_path_factory.mktemp("state")))  # 8,192 positions


def test_the_engine_serves_contexts_up_to_max_model_len_and_names_it_past_it(demo):
    engine = Engine(demo, EngineSettings(num_blocks=32, block_size=16, max_model_len=24))
    assert engine.context_limit == 24
    request = engine.add_request(PROMPT, SamplingParams(max_tokens=4, ignore_eos=True))
    engine.run_until_done()
    assert len(request.sequences[0].output_ids) == 4
    with pytest.raises(ContextLengthExceeded) as refused:
        engine.add_request(PROMPT, SamplingParams(max_tokens=5))
    assert str(refused.value) == "max_tokens: prompt (20) + max_tokens (5) exceeds max_model_len 24"
    assert Engine(demo, EngineSettings(num_blocks=32)).context_limit == 8192


def test_a_max_model_len_past_what_the_model_serves_is_refused(demo):
    with pytest.raises(ValueError) as refused:
        Engine(demo, EngineSettings(num_blocks=32, max_model_len=8193))
    assert str(refused.value) == ("max_model_len: 8193 is more than kvd can serve of this model: the model's 8192 "
                                  "positions")


@pytest.mark.parametrize("value", ["0", "1.5", "many"])
def test_a_max_model_len_that_is_not_a_count_is_refused_naming_it(value):
    with pytest.raises(ConfigError) as refused:
        resolve({"max_model_len": value}, {})
    assert str(refused.value).startswith(f"max_model_len: invalid value {value!r} from --max-model-len: must be")


def test_kvd_says_its_max_model_len_and_a_chat_without_max_tokens_reserves_only_up_to_it(tmp_path):
    """On a 8,192-position model each chat that leaves max_tokens out would reserve some 8,000
    tokens of cache; capped at 256, it reserves what its context has left of 256."""
    service = start_service(tmp_path, num_blocks=64, max_model_len=256)
    try:
        unix, _ = apps(service, token_table(tmp_path))
        assert call(unix, "GET", "/v1/models").json()["data"][0]["max_model_len"] == 256
        assert call(unix, "GET", "/admin/status").json()["model"]["max_model_len"] == 256
        counted = call(unix, "POST", "/tokenize", json={"prompt": "hi"}).json()
        assert counted["max_model_len"] == 256
        chat = call(unix, "POST", "/v1/chat/completions",
                    json={"messages": [{"role": "user", "content": "Tell me everything."}], "ignore_eos": True})
        usage = chat.json()["usage"]
        assert chat.json()["choices"][0]["finish_reason"] == "length"
        assert usage["prompt_tokens"] + usage["completion_tokens"] == 256
        long = call(unix, "POST", "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x" * 300}]})
        assert long.status_code == 413
        assert long.json()["error"]["message"].endswith("which leaves no room for a reply in max_model_len 256")
    finally:
        service.shutdown(1)
    uncapped = start_service(tmp_path / "uncapped", num_blocks=64)  # the model's 8,192 tokens: it never fits
    try:
        unix, _ = apps(uncapped, token_table(tmp_path))
        refused = call(unix, "POST", "/v1/chat/completions",
                       json={"messages": [{"role": "user", "content": "Tell me everything."}]})
        assert (refused.status_code, refused.json()["error"]["code"]) == (400, "cache_capacity_exceeded")
    finally:
        uncapped.shutdown(1)
