"""A checkpoint's generation_config.json: the EOS tokens it adds end replies, and its sampling
defaults are what a request that leaves a field out gets (vLLM's --generation-config auto)."""

from __future__ import annotations

import json
import re
import shutil

import pytest

torch = pytest.importorskip("torch")

from kvctl.daemon.engine.engine import Engine, EngineSettings  # noqa: E402
from kvctl.daemon.engine.sampling import SamplingParams  # noqa: E402
from kvctl.daemon.model.config import ModelError  # noqa: E402
from kvctl.daemon.model.demo import ensure_demo_checkpoint  # noqa: E402
from kvctl.daemon.model.generation_config import GenerationConfig, read_generation_config  # noqa: E402
from kvctl.daemon.model.llama import load_model  # noqa: E402

from .daemon_fixtures import apps, call, start_service, token_table  # noqa: E402

PROMPT = [256, 72, 111, 119, 32, 100, 111, 101, 115, 32, 97, 32, 112, 105, 110, 32, 119, 111, 114, 107, 63]


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return ensure_demo_checkpoint(tmp_path_factory.mktemp("state"))


@pytest.fixture(scope="module")
def greedy(demo):
    """The demo model's greedy reply to PROMPT, written on past any EOS."""
    engine = Engine(load_model(demo), EngineSettings(num_blocks=32, block_size=16))
    request = engine.add_request(PROMPT, SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.0))
    engine.run_until_done()
    return request.sequences[0].output_ids


def checkpoint_with(demo, tmp_path, generation: dict | str):
    model = tmp_path / "model"
    shutil.copytree(demo, model)
    (model / "generation_config.json").write_text(generation if isinstance(generation, str) else json.dumps(generation))
    return model


def test_what_kvd_reads_of_the_file_under_each_setting(demo, tmp_path):
    assert read_generation_config(demo) == GenerationConfig()  # none there: nothing
    model = checkpoint_with(demo, tmp_path, {"eos_token_id": [257, 7], "temperature": 0.6, "top_p": 0.95,
                                             "top_k": -1, "do_sample": True, "max_new_tokens": 100})
    auto = read_generation_config(model)
    assert (auto.source, auto.eos_token_ids) == (str(model / "generation_config.json"), (257, 7))
    assert auto.sampling == {"temperature": 0.6, "top_p": 0.95, "top_k": 0}  # -1 is "no cut"; the rest unused
    off = read_generation_config(model, "none")
    assert (off.eos_token_ids, off.sampling) == ((257, 7), {})  # where answers end still holds
    elsewhere = tmp_path / "ops"
    elsewhere.mkdir()
    (elsewhere / "generation_config.json").write_text(json.dumps({"temperature": 0.2, "eos_token_id": 9}))
    assert read_generation_config(model, str(elsewhere)).sampling == {"temperature": 0.2}
    assert read_generation_config(model, str(elsewhere / "generation_config.json")).eos_token_ids == (9,)
    with pytest.raises(ModelError) as missing:
        read_generation_config(model, str(tmp_path / "nowhere"))
    assert str(missing.value) == f"generation_config: {str(tmp_path / 'nowhere')!r} holds no generation_config.json"


@pytest.mark.parametrize("text, message", [
    ("{", "not valid JSON"),
    ("[1]", "expected a JSON object, got list"),
    ('{"eos_token_id": "</s>"}', "field 'eos_token_id' must be a token id or a list of them (got '</s>')"),
    ('{"top_k": 2.5}', "field 'top_k' must be a whole number (got 2.5)"),
    ('{"temperature": true}', "field 'temperature' must be a number (got True)"),
])
def test_a_file_kvd_cannot_use_is_named_with_its_field(demo, tmp_path, text, message):
    model = checkpoint_with(demo, tmp_path, text)
    with pytest.raises(ModelError) as refused:
        read_generation_config(model)
    assert str(refused.value).startswith(f"{model / 'generation_config.json'}: ") and message in str(refused.value)


def test_a_default_no_request_could_use_stops_the_load(demo, tmp_path):
    model = checkpoint_with(demo, tmp_path, {"temperature": -1})
    with pytest.raises(ModelError) as refused:
        load_model(model)
    assert str(refused.value) == f"{model / 'generation_config.json'}: temperature: must be between 0 and 100, got -1"
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": 999}))
    with pytest.raises(ModelError, match="eos_token_id 999 is outside the vocabulary of 258"):
        load_model(model)


def test_the_file_s_eos_token_ends_a_reply_and_its_defaults_fill_what_a_request_leaves_out(demo, greedy, tmp_path,
                                                                                          caplog):
    """The greedy reply's third token is made an EOS token, as an instruct checkpoint's
    generation_config.json names its end-of-turn token; top_k 1 as the default makes sampling
    greedy unless a request asks for its own top_k."""
    eos = greedy[2]
    ends = greedy[:greedy.index(eos) + 1]
    model = checkpoint_with(demo, tmp_path, {"eos_token_id": [257, eos], "top_k": 1, "temperature": 1.0})
    with caplog.at_level("INFO", logger="kvd"):
        service = start_service(tmp_path, model=str(model))
    try:
        assert f"sampling defaults from {model / 'generation_config.json'} for requests that leave them out: temperature 1.0, " \
               "top_k 1 (generation_config: none keeps kvd's own)" in caplog.text
        unix, _ = apps(service, token_table(tmp_path))

        def complete(**body):
            answer = call(unix, "POST", "/v1/completions", json={"prompt": PROMPT, "max_tokens": 10, "seed": 7, **body})
            return answer.json()["choices"][0]

        defaulted = complete()
        assert (defaulted["token_ids"], defaulted["finish_reason"]) == (ends, "stop")
        assert complete(ignore_eos=True)["token_ids"] == greedy  # top_k 1 from the file: greedy whatever the seed
        sampled = complete(top_k=0, ignore_eos=True)["token_ids"]  # the request's own top_k wins
        assert sampled != greedy and sampled == complete(top_k=0, ignore_eos=True)["token_ids"]
        status = call(unix, "GET", "/admin/status").json()
        assert status["model"]["sampling_defaults"] == {"source": str(model / "generation_config.json"),
                                                        "values": {"temperature": 1.0, "top_k": 1}}
        from rich.console import Console

        from kvctl.status_view import render_status

        console = Console(width=200, record=True)
        render_status(status, console)
        assert re.search(r"sampling +temperature 1\.0, top_k 1 unless a request says otherwise \(\S+generation_"
                         r"config\.json\)", console.export_text())
    finally:
        service.shutdown(1)


def test_generation_config_none_keeps_kvd_s_own_defaults_but_not_the_wrong_end(demo, greedy, tmp_path):
    eos = greedy[2]
    model = checkpoint_with(demo, tmp_path, {"eos_token_id": eos, "top_k": 1})
    service = start_service(tmp_path, model=str(model), generation_config="none")
    try:
        unix, _ = apps(service, token_table(tmp_path))
        sampled = call(unix, "POST", "/v1/completions", json={"prompt": PROMPT, "max_tokens": 10, "seed": 7,
                                                              "ignore_eos": True}).json()["choices"][0]["token_ids"]
        assert sampled != greedy  # no top_k 1 from the file
        ended = call(unix, "POST", "/v1/completions", json={"prompt": PROMPT, "max_tokens": 10,
                                                            "temperature": 0}).json()["choices"][0]
        assert (ended["token_ids"], ended["finish_reason"]) == (greedy[:greedy.index(eos) + 1], "stop")
        assert call(unix, "GET", "/admin/status").json()["model"]["sampling_defaults"]["values"] == {}
    finally:
        service.shutdown(1)
