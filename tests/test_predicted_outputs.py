"""OpenAI's Predicted Outputs (`prediction` on a chat): the prediction's tokens drafted ahead of the
reply and kept where the model agrees, so a reply that repeats most of a given text (a file after
an edit) takes fewer steps and is the reply it would be without the prediction."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvctl.policies.speculation import PredictionLookup

from .daemon_fixtures import call, sse_events, start_service

torch = pytest.importorskip("torch")


# ---- the lookup ------------------------------------------------------------------------------
def test_a_reply_that_follows_the_prediction_is_drafted_the_prediction_s_next_tokens():
    lookup = PredictionLookup([10, 11, 12, 13, 14, 15])
    assert lookup.propose([], 3) == [10, 11, 12]  # the reply is expected to begin as the prediction does
    assert lookup.propose([10, 11], 3) == [12, 13, 14]
    assert lookup.propose([10, 11, 12, 13], 8) == [14, 15]
    assert lookup.propose([10, 11, 12, 13, 14, 15], 8) == []  # the prediction is used up
    assert lookup.propose([10], 0) == []


def test_a_reply_that_leaves_the_prediction_is_drafted_again_once_it_comes_back_to_it():
    prediction = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 9]
    lookup = PredictionLookup(prediction)
    assert lookup.propose([1, 2, 3, 4], 2) == [5, 6]
    assert lookup.propose([1, 2, 3, 4, 50], 2) == []  # 50 is not in the prediction: nothing to go on from
    assert lookup.propose([1, 2, 3, 4, 50, 1], 2) == []  # one token matched, fewer than prompt_lookup_min
    # [1, 2, 3] occurs twice: after where the reply last followed it (4 tokens in), the later one is taken
    assert lookup.propose([1, 2, 3, 4, 50, 1, 2, 3], 2) == [9]
    assert lookup.propose([1, 2, 3, 4, 50, 1, 2, 3, 9], 2) == []  # followed to its end
    # a reply that leaves it at once goes on from the first occurrence
    assert PredictionLookup(prediction).propose([50, 1, 2, 3], 3) == [4, 5, 6]
    # the longest match wins over an earlier, shorter one
    assert PredictionLookup([7, 2, 3, 0, 9, 1, 2, 3, 5], high=4).propose([60, 1, 2, 3], 2) == [5]


# ---- the engine ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    from kvctl.daemon.model.demo import ensure_demo_checkpoint
    from kvctl.daemon.model.llama import load_model

    return load_model(ensure_demo_checkpoint(tmp_path_factory.mktemp("state")))


def run(demo, params, speculation=None, **settings):
    """The reply's samples, the engine's steps and the request, run alone on a fresh engine."""
    from kvctl.daemon.engine.engine import Engine, EngineSettings

    engine = Engine(demo, EngineSettings(**{"num_blocks": 64, "block_size": 16, "speculation": speculation,
                                            **settings}))
    request = engine.add_request(demo.tokenizer.encode("def f(x):\n    return x + 1\n"), params)
    steps = 0
    while engine.has_work():
        engine.step()
        engine.cache.audit()
        steps += 1
    counts = engine.cache.state_counts()
    assert counts["free"] + counts["cached"] == engine.settings.num_blocks  # every draft slot came back
    return [s.output_ids for s in request.sequences], steps, request, engine


GREEDY_PARAMS = dict(max_tokens=40, ignore_eos=True)


def test_a_right_prediction_gives_the_same_reply_in_a_few_steps_of_nine_tokens(demo):
    from kvctl.daemon.engine.sampling import SamplingParams

    params = SamplingParams(**GREEDY_PARAMS)
    (reply,), steps, _, _ = run(demo, params)
    assert steps == 40  # a prefill step, then a token a step
    (again,), fast, request, engine = run(demo, replace(params, prediction=tuple(reply)))
    assert again == reply
    # 8 drafted a step (PREDICTION_TOKENS), each kept, and the model's own next token: 1 + 9 * 4 + 3 tokens
    assert fast == 1 + 5
    metrics = request.metrics
    assert (metrics.predicted_tokens, metrics.kept_predicted_tokens) == (8 * 4 + 2, 8 * 4 + 2)
    assert (metrics.drafted_tokens, metrics.kept_draft_tokens) == (34, 34)
    # kvd's figures of predictions' drafts, apart from prompt lookup's
    assert (engine.speculator.predicted.draft_tokens, engine.speculator.predicted.accepted_tokens) == (34, 34)
    assert engine.speculator.predicted.drafts == 5 and engine.speculator.stats.drafts == 0


def test_an_edited_prediction_drafts_around_the_edit_and_the_reply_stays_the_model_s(demo):
    from kvctl.daemon.engine.sampling import SamplingParams

    params = SamplingParams(**GREEDY_PARAMS)
    (reply,), steps, _, _ = run(demo, params)
    edited = reply[:12] + [5, 6, 7] + reply[17:]  # five tokens replaced by three
    (again,), fast, request, _ = run(demo, replace(params, prediction=tuple(edited)))
    assert again == reply and fast < steps
    metrics = request.metrics
    assert metrics.predicted_tokens > metrics.kept_predicted_tokens >= 12 + len(reply) - 17 - 8
    assert metrics.predicted_tokens - metrics.kept_predicted_tokens >= 1  # [5, ...] drafted and refused


@pytest.mark.parametrize("extra", [dict(temperature=0.9, seed=4), dict(temperature=0.8, seed=2, n=2),
                                   dict(max_tokens=25, repetition_penalty=1.3)])
def test_sampled_and_reshaped_replies_are_those_without_the_prediction(demo, extra):
    from kvctl.daemon.engine.sampling import SamplingParams

    params = SamplingParams(**{**GREEDY_PARAMS, **extra})
    plain, _, _, _ = run(demo, params)
    (greedy,), _, _, _ = run(demo, SamplingParams(**GREEDY_PARAMS))
    predicted, _, request, _ = run(demo, replace(params, prediction=tuple(greedy) * 2))
    assert predicted == plain and all(len(s) == params.max_tokens for s in predicted)
    assert request.metrics.predicted_tokens > 0


def test_speculative_config_s_k_caps_a_prediction_s_drafts_and_prompt_lookup_fills_in(demo):
    from kvctl.daemon.engine.sampling import SamplingParams
    from kvctl.policies.speculation import NgramSpeculation

    params = SamplingParams(**GREEDY_PARAMS)
    (reply,), _, _, _ = run(demo, params)
    (again,), steps, request, engine = run(demo, replace(params, prediction=tuple(reply)), NgramSpeculation(2))
    assert again == reply and steps == 1 + 13  # 3 tokens a step: 1 + 3 * 13 = 40
    assert (request.metrics.predicted_tokens, request.metrics.kept_predicted_tokens) == (26, 26)
    # no prediction: prompt lookup's drafts, none counted as the prediction's
    (plain,), _, request, _ = run(demo, params, NgramSpeculation(2))
    assert plain == reply and request.metrics.predicted_tokens == 0


def test_predictions_are_drafted_only_while_at_most_prediction_max_batch_sequences_run(demo):
    """An operator's prediction_max_batch (vLLM's disable_by_batch_size, for predictions): two samples
    running, a limit of one drafts nothing from the prediction, a limit of two drafts as before; prompt
    lookup's drafts go on past it. Each reply is the one without drafts."""
    from kvctl.daemon.engine.sampling import SamplingParams
    from kvctl.policies.speculation import NgramSpeculation

    params = SamplingParams(**GREEDY_PARAMS, n=2)
    plain, steps, _, _ = run(demo, params)
    predicted = replace(params, prediction=tuple(plain[0]))
    over, over_steps, request, engine = run(demo, predicted, prediction_max_batch=1)
    assert over == plain and over_steps == steps == 40 and request.metrics.predicted_tokens == 0
    assert engine.speculator.predicted.drafts == 0
    within, fast, request, _ = run(demo, predicted, prediction_max_batch=2)
    assert within == plain and fast < 10
    assert request.metrics.kept_predicted_tokens == request.metrics.predicted_tokens > 0
    looked_up, _, request, engine = run(demo, predicted, NgramSpeculation(2), prediction_max_batch=1)
    assert looked_up == plain and request.metrics.predicted_tokens == 0 and engine.speculator.stats.drafts > 0


def test_a_prediction_s_token_ids_are_checked_by_the_engine(demo):
    from kvctl.daemon.engine.sampling import RequestError, SamplingParams

    with pytest.raises(RequestError) as refused:
        SamplingParams(prediction=(3, 10**9)).validate(demo.config.vocab_size)
    assert str(refused.value) == f"prediction: must be token ids in [0, {demo.config.vocab_size}), got 1000000000"


# ---- at kvd ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    from kvctl.daemon.server.app import create_app

    service = start_service(tmp_path_factory.mktemp("kvd"), num_blocks=128)
    yield service, create_app(service, service.metrics, front="unix")
    service.shutdown(1)


MESSAGES = [{"role": "user", "content": "Rename x to y in: def f(x):\n    return x + 1"}]


def chat(app, **body):
    answer = call(app, "POST", "/v1/chat/completions", json={
        "messages": MESSAGES, "max_tokens": 30, "temperature": 0, "ignore_eos": True, **body})
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_a_chat_with_a_prediction_says_how_many_of_its_tokens_were_accepted(daemon):
    from kvctl.daemon.engine.engine import Engine, EngineSettings
    from kvctl.daemon.engine.sampling import SamplingParams

    service, app = daemon
    plain = chat(app, return_token_ids=True)
    assert "completion_tokens_details" not in plain["usage"]  # no prediction: as before
    text, ids = plain["choices"][0]["message"]["content"], plain["choices"][0]["token_ids"]
    answer = chat(app, prediction={"type": "content", "content": text})
    assert answer["choices"][0]["message"]["content"] == text and answer["choices"][0]["token_ids"] == ids
    # the figures of the same prompt run with the text's tokens (no special token) as its prediction
    engine = Engine(service.loaded, EngineSettings(num_blocks=64, block_size=16))
    predicted = tuple(service.loaded.tokenizer.encode(text, add_special_tokens=False))
    alone = engine.add_request(plain["prompt_token_ids"], SamplingParams(max_tokens=30, ignore_eos=True,
                                                                        prediction=predicted))
    while engine.has_work():
        engine.step()
    assert alone.sequences[0].output_ids == ids
    kept, drafted = alone.metrics.kept_predicted_tokens, alone.metrics.predicted_tokens
    assert kept > 0
    assert answer["usage"]["completion_tokens_details"] == {"accepted_prediction_tokens": kept,
                                                            "rejected_prediction_tokens": drafted - kept}
    # as text parts; a wrong prediction: its drafts are rejected, the reply is the same
    parts = chat(app, prediction={"type": "content", "content": [{"type": "text", "text": text}]})
    assert parts["choices"][0]["message"]["content"] == text and parts["usage"] == answer["usage"]
    wrong = chat(app, prediction={"type": "content", "content": "Something else entirely, " * 4})
    assert wrong["choices"][0]["message"]["content"] == text
    assert wrong["usage"]["completion_tokens_details"]["accepted_prediction_tokens"] < kept
    # kvd's figures: every chat's drafts from its prediction, in /admin/status, kvctl status and /metrics
    details = [a["usage"]["completion_tokens_details"] for a in (answer, parts, wrong)]
    accepted = sum(d["accepted_prediction_tokens"] for d in details)
    rejected = sum(d["rejected_prediction_tokens"] for d in details)
    figures = call(app, "GET", "/admin/status").json()["speculation"]
    assert (figures["prediction"]["accepted_tokens"], figures["prediction"]["draft_tokens"]) == (
        accepted, accepted + rejected)
    assert figures["drafts"] == 0 and figures["config"] is None  # prompt lookup's: none here
    metrics = call(app, "GET", "/metrics").text
    assert f"kvd_prediction_accepted_tokens_total {float(accepted)}" in metrics
    assert f"kvd_prediction_draft_tokens_total {float(accepted + rejected)}" in metrics
    assert "kvd_spec_decode_draft_tokens_total 0.0" in metrics
    from rich.console import Console

    from kvctl.status_view import render_status

    shown = Console(width=200, record=True)
    render_status(call(app, "GET", "/admin/status").json(), shown)
    said = " ".join(shown.export_text().split())
    assert f"predictions {accepted:,} of {accepted + rejected:,} tokens drafted from requests' predictions kept" in said
    assert "speculation" not in said
    # streamed: the last chunk's usage says the same
    events = sse_events(call(app, "POST", "/v1/chat/completions", json={
        "messages": MESSAGES, "max_tokens": 30, "temperature": 0, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True}, "prediction": {"type": "content", "content": text}}))
    assert events[-2]["usage"]["completion_tokens_details"] == answer["usage"]["completion_tokens_details"]
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-2]) == text


def test_predicted_outputs_ignore_serves_a_chat_with_a_prediction_as_one_without(daemon):
    """The operator's `predicted_outputs: ignore` (live on a reload): nothing is drafted from a
    prediction and the usage has no completion_tokens_details; a bad prediction is still a 400."""
    from dataclasses import replace as replaced

    from kvctl.daemon.config import ConfigError, resolve
    from kvctl.daemon.server.reload_ops import LIVE_SETTINGS

    service, app = daemon
    text = chat(app)["choices"][0]["message"]["content"]
    before = call(app, "GET", "/admin/status").json()["speculation"]["prediction"]["draft_tokens"]
    service.reload(replaced(service.config, predicted_outputs="ignore"), actor="test")
    try:
        ignored = chat(app, prediction={"type": "content", "content": text})
        assert ignored["choices"][0]["message"]["content"] == text
        assert "completion_tokens_details" not in ignored["usage"]
        assert call(app, "GET", "/admin/status").json()["speculation"]["prediction"]["draft_tokens"] == before
        bad = call(app, "POST", "/v1/chat/completions", json={"messages": MESSAGES, "prediction": "the file"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "prediction"
    finally:
        service.reload(replaced(service.config, predicted_outputs="honour"), actor="test")
    assert "completion_tokens_details" in chat(app, prediction={"type": "content", "content": text})["usage"]
    assert {"predicted_outputs", "prediction_max_batch"} <= set(LIVE_SETTINGS)
    service.reload(replaced(service.config, prediction_max_batch=4), actor="test")
    try:
        assert service.engine.speculator.prediction_max_batch == 4
        chat(app, prediction={"type": "content", "content": text})  # (one sequence: drafted)
        status = call(app, "GET", "/admin/status").json()
        assert status["speculation"]["prediction"]["max_batch"] == 4
        from rich.console import Console

        from kvctl.status_view import render_status

        shown = Console(width=240, record=True)
        render_status(status, shown)
        assert "tokens a step where one ran; drafted while at most 4 sequences run" in " ".join(
            shown.export_text().split())
    finally:
        service.reload(replaced(service.config, prediction_max_batch=None), actor="test")
    assert service.engine.speculator.prediction_max_batch is None
    with pytest.raises(ConfigError) as refused:
        resolve({"prediction_max_batch": 0}, env={})
    assert str(refused.value) == "prediction_max_batch: invalid value 0 from --prediction-max-batch: must be >= 1"
    with pytest.raises(ConfigError) as refused:
        resolve({"predicted_outputs": "off"}, env={})
    assert str(refused.value) == ("predicted_outputs: invalid value 'off' from --predicted-outputs: must be honour "
                                  "or ignore")


@pytest.mark.parametrize("prediction, param, message", [
    ("the file", "prediction", "prediction: must be an object {\"type\": \"content\", \"content\": ...}, got str"),
    ({"type": "text", "content": "x"}, "prediction.type", "prediction.type: must be content, got 'text'"),
    ({"content": "x"}, "prediction.type", "prediction.type: must be content, got None"),
    ({"type": "content", "content": "x", "text": "y"}, "prediction.text",
     "prediction.text: not a field of a prediction (type, content)"),
    ({"type": "content", "content": 5}, "prediction.content",
     "prediction.content: must be a string or a list of text parts, got int"),
    ({"type": "content", "content": [{"type": "image_url"}]}, "prediction.content[0].type",
     "prediction.content[0].type: kvd takes text parts only ({\"type\": \"text\", \"text\": ...}), got 'image_url'"),
])
def test_a_bad_prediction_is_a_400_naming_the_field(daemon, prediction, param, message):
    _, app = daemon
    refused = call(app, "POST", "/v1/chat/completions", json={"messages": MESSAGES, "prediction": prediction})
    assert refused.status_code == 400
    assert (refused.json()["error"]["param"], refused.json()["error"]["message"]) == (param, message)


def test_bench_speculation_measures_predictions_beside_the_same_requests_without(tmp_path, capsys):
    import json

    from kvctl.bench_speculation import edited

    from .test_cli import cli

    assert edited(list(range(30)), 100) == list(range(10)) + [11, 12, 13] + list(range(13, 30))
    assert edited([5, 6], 7) == [6, 6] and edited([6], 7) == [0]  # (a tenth of a short reply is one token)
    status, out, err = cli(capsys, "bench", "speculation", "--prediction", "edited", "--speculative-config", "none",
                           "--max-tokens", "30", "--repeats", "1", "--json")
    assert status == 0, err
    document = json.loads(out)
    assert document["settings"]["prediction"] == "edited" and document["settings"]["speculative_config"] is None
    assert document["identical_replies"] == 4
    base, fast = document["baseline"], document["speculative"]
    assert base["output_tokens"] == fast["output_tokens"] == 120 and fast["steps"] < base["steps"]
    predicted = fast["prediction"]
    assert 0 < predicted["accepted_tokens"] < predicted["draft_tokens"] and fast["speculation"]["drafts"] == 0
    status, out, _ = cli(capsys, "bench", "speculation", "--prediction", "reply", "--max-tokens", "30",
                         "--repeats", "1")
    assert status == 0 and "each request given its reply as a prediction: " in " ".join(out.split())
    status, _, err = cli(capsys, "bench", "speculation", "--prediction", "file")
    assert status == 2 and "prediction: must be none, reply or edited, got 'file'" in " ".join(err.split())
    status, _, err = cli(capsys, "bench", "speculation", "--speculative-config", "none")
    assert status == 2 and "give a speculation to measure" in " ".join(err.split())
