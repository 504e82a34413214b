"""Speculative decoding in the engine and at kvd: the same replies as without it, in fewer steps,
with the draft's slots given back and its figures in /status, /metrics and kvctl status."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")
pytest.importorskip("tokenizers")

from kvctl.daemon.engine.engine import Engine, EngineSettings  # noqa: E402
from kvctl.daemon.engine.sampling import SamplingParams  # noqa: E402
from kvctl.daemon.model.demo import ensure_demo_checkpoint  # noqa: E402
from kvctl.daemon.model.llama import load_model  # noqa: E402
from kvctl.policies.speculation import NgramSpeculation  # noqa: E402

TEXTS = ["The paged cache keeps blocks of sixteen tokens.",
         "def f(x):\n    return x + 1\n\ndef g(x):\n    return f(x)",
         "A short one.",
         "Operators pin hot prefixes such as system prompts. " * 4]


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return load_model(ensure_demo_checkpoint(tmp_path_factory.mktemp("state")))


def generate(demo, params, speculation=None, prompts=None, **settings):
    """Each request's samples' tokens, and the engine, after running every step with an audit."""
    engine = Engine(demo, EngineSettings(**{"num_blocks": 128, "block_size": 16, "speculation": speculation,
                                            **settings}))
    prompts = prompts or [demo.tokenizer.encode(t) for t in TEXTS]
    requests = [engine.add_request(p, params) for p in prompts]
    steps = 0
    while engine.has_work():
        engine.step()
        engine.cache.audit()
        steps += 1
        assert steps < 5000, "the engine is still busy"
    counts = engine.cache.state_counts()
    assert counts["free"] + counts["cached"] == engine.settings.num_blocks  # every draft slot came back
    engine.steps_run = steps
    return [[s.output_ids for s in r.sequences] for r in requests], engine


def indexed_keys(engine):
    return sorted(b.key for b in engine.cache.pool.blocks if b.key is not None)


GREEDY = SamplingParams(max_tokens=80, ignore_eos=True)


@pytest.mark.parametrize("k, block_size", [(1, 16), (4, 16), (4, 8), (8, 32)])
def test_greedy_replies_are_the_same_in_fewer_steps(demo, k, block_size):
    plain, base = generate(demo, GREEDY, block_size=block_size)
    fast, engine = generate(demo, GREEDY, NgramSpeculation(k), block_size=block_size)
    assert fast == plain
    assert engine.steps_run < base.steps_run
    figures = engine.speculator.stats
    assert figures.drafts > 0 and 0 < figures.accepted_tokens <= figures.draft_tokens <= k * figures.drafts
    assert figures.emitted_tokens == figures.accepted_tokens + figures.drafts
    per_position = figures.accepted_per_position
    assert sum(per_position) == figures.accepted_tokens and per_position == sorted(per_position, reverse=True)
    requests = list(engine.requests.values())  # each request's own share of the totals
    assert sum(r.metrics.drafted_tokens for r in requests) == figures.draft_tokens
    assert sum(r.metrics.kept_draft_tokens for r in requests) == figures.accepted_tokens
    # the prefix index holds what it holds without speculation: no block of a rejected guess
    assert indexed_keys(engine) == indexed_keys(base)


def test_preempted_sequences_with_drafts_recompute_to_the_same_replies(demo):
    settings = {"num_blocks": 36, "block_size": 8, "reservation": "fixed:0", "max_batch_tokens": 64}
    plain, base = generate(demo, GREEDY, **settings)
    fast, engine = generate(demo, GREEDY, NgramSpeculation(4), **settings)
    assert base.stats.preemptions > 0 and engine.stats.preemptions > 0
    assert fast == plain


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=60, temperature=0.7, seed=10, ignore_eos=True),  # (a draw some drafts match)
    SamplingParams(max_tokens=60, temperature=0.3, top_k=20, top_p=0.9, seed=5, n=2, ignore_eos=True),
    SamplingParams(max_tokens=60, repetition_penalty=1.1, frequency_penalty=0.2, ignore_eos=True),
    SamplingParams(max_tokens=60, logit_bias=((5, 2.0),), min_tokens=20),
], ids=["sampled", "sampled-n2", "penalised", "biased"])
def test_sampled_and_reshaped_requests_keep_their_replies_with_drafts(demo, params):
    # each kept draft token is the sequence's own draw at its position (the same seeded number,
    # after the same tokens): a sampled reply is the one it is without speculation
    plain, base = generate(demo, params)
    same, engine = generate(demo, params, NgramSpeculation(4))
    assert same == plain
    figures = engine.speculator.stats
    assert figures.drafts > 0 and figures.accepted_tokens > 0 and engine.steps_run <= base.steps_run


def test_a_reply_held_to_a_shape_keeps_it_with_drafts_drawn_with_the_step_s_other_rows(demo, monkeypatch):
    # (seed 7's reply ends inside a draft's verdict: its grammar, complete after a token the draft
    # holds, ends the verdict there, and the reply with it.) Each verdict's rows, masked as the
    # grammar would be after the draft's tokens before them, are drawn in the step's one draw.
    from dataclasses import replace as replaced

    from kvctl.daemon.engine import engine as engine_module
    from kvctl.daemon.engine.structured import Constraint

    draws = []
    real = engine_module.draw_tokens
    monkeypatch.setattr(engine_module, "draw_tokens", lambda scores, d: draws.append(len(d)) or real(scores, d))
    shape = Constraint.regex("(ab|cd){3,30}", "guided_regex")
    thinking = replaced(Constraint.json_schema({"type": "object"}, "response_format"), after="</think>",
                        opens="<think>")
    cases = [(SamplingParams(max_tokens=50, constraint=shape), "abcd", "(ab|cd){3,30}"),
             (SamplingParams(max_tokens=50, temperature=0.8, seed=7, constraint=shape), "abcd", "(ab|cd){3,30}"),
             (SamplingParams(max_tokens=40, temperature=0.8, seed=3, n=2, constraint=thinking), TEXTS[3], None)]
    for params, prompt, pattern in cases:
        plain, _ = generate(demo, params, prompts=[demo.tokenizer.encode(prompt)])
        del draws[:]
        same, engine = generate(demo, params, NgramSpeculation(4), prompts=[demo.tokenizer.encode(prompt)])
        assert same == plain
        if pattern is not None:
            assert re.fullmatch(pattern, demo.tokenizer.decode(same[0][0]))
        assert engine.speculator.stats.drafts > 0 and len(draws) <= engine.steps_run
        assert sum(draws) > len(draws)  # (some draws carried a verdict's rows)
    assert engine.speculator.stats.accepted_tokens > 0


def test_max_tokens_and_a_stop_token_end_the_reply_exactly_where_they_would(demo):
    [[full]], _ = generate(demo, GREEDY, prompts=[demo.tokenizer.encode(TEXTS[0])])
    stop = full[30]
    first = full.index(stop)
    for params, expected in ((replace(GREEDY, max_tokens=37), full[:37]),
                             (replace(GREEDY, stop_token_ids=(stop,)), full[:first + 1])):
        [[reply]], engine = generate(demo, params, NgramSpeculation(6), prompts=[demo.tokenizer.encode(TEXTS[0])])
        assert reply == expected
        assert engine.speculator.stats.drafts > 0


def test_logprobs_and_n_samples_are_those_without_speculation(demo):
    params = SamplingParams(max_tokens=40, logprobs=2, n=2, ignore_eos=True)
    prompts = [demo.tokenizer.encode(TEXTS[1])]
    plain_engine = Engine(demo, EngineSettings(num_blocks=64, block_size=16))
    fast_engine = Engine(demo, EngineSettings(num_blocks=64, block_size=16, speculation=NgramSpeculation(4)))
    [plain] = plain_engine.generate(prompts, params)
    [fast] = fast_engine.generate(prompts, params)
    assert fast_engine.speculator.stats.drafts > 0
    for a, b in zip(plain.sequences, fast.sequences):
        assert a.output_ids == b.output_ids
        for (lp_a, alt_a), (lp_b, alt_b) in zip(a.logprobs, b.logprobs):
            assert lp_b == pytest.approx(lp_a, abs=1e-4)
            assert [t for t, _ in alt_b] == [t for t, _ in alt_a]


def test_logprobs_of_verdicts_and_other_rows_asked_in_one_call_reach_their_own_sequences(demo, monkeypatch):
    """Requests with and without logprobs (2, none, 0, 3 alternatives), sampled or held to a shape,
    in one batch with drafts: each sequence reports its own tokens' logprobs as without speculation,
    from one logprob call a step at most."""
    from kvctl.daemon.engine import engine as engine_module
    from kvctl.daemon.engine.structured import Constraint

    calls = []
    real = engine_module._token_logprobs
    monkeypatch.setattr(engine_module, "_token_logprobs", lambda logits, asked: calls.append(len(asked)) or
                        real(logits, asked))
    shape = Constraint.regex("(ab|cd|the cache ){3,200}", "guided_regex")
    asks = [SamplingParams(max_tokens=30, logprobs=2, ignore_eos=True),
            SamplingParams(max_tokens=30, temperature=0.7, seed=4, ignore_eos=True),
            SamplingParams(max_tokens=30, logprobs=0, temperature=0.7, seed=5, ignore_eos=True),
            SamplingParams(max_tokens=30, logprobs=3, constraint=shape, temperature=0.5, seed=6)]
    prompts = [demo.tokenizer.encode(t) for t in TEXTS]
    replies = []
    for speculation in (None, NgramSpeculation(4)):
        engine = Engine(demo, EngineSettings(num_blocks=128, block_size=16, speculation=speculation))
        requests = [engine.add_request(p, params) for p, params in zip(prompts, asks)]
        del calls[:]
        steps = 0
        while engine.has_work():
            engine.step()
            steps += 1
        assert len(calls) <= steps
        replies.append([(s.output_ids, s.logprobs) for r in requests for s in r.sequences])
    assert engine.speculator.stats.accepted_tokens > 0
    for (ids_a, lps_a), (ids_b, lps_b), params in zip(*replies, asks):
        assert ids_a == ids_b and len(lps_a) == len(lps_b) == (0 if params.logprobs is None else len(ids_a))
        for (lp_a, alt_a), (lp_b, alt_b) in zip(lps_a, lps_b):
            assert lp_b == pytest.approx(lp_a, abs=1e-4) and len(alt_b) == params.logprobs
            assert [t for t, _ in alt_b] == [t for t, _ in alt_a]


def test_no_drafts_while_more_sequences_run_than_disable_by_batch_size(demo):
    seen = []
    engine = Engine(demo, EngineSettings(num_blocks=128, block_size=16,
                                         speculation=NgramSpeculation(4, disable_by_batch_size=2)))
    draft = engine.speculator.draft

    def recorded(seq, running, budget):
        seen.append((running, draft(seq, running, budget)))
        return seen[-1][1]

    engine.speculator.draft = recorded
    for text, max_tokens in zip(TEXTS[:3], (20, 30, 80)):
        engine.add_request(demo.tokenizer.encode(text), replace(GREEDY, max_tokens=max_tokens))
    engine.run_until_done()
    assert {running for running, _ in seen} == {1, 2, 3}
    assert all(not d for running, d in seen if running > 2)
    assert any(d for running, d in seen if running <= 2)


def test_speculation_can_be_turned_off_and_on_between_steps_and_its_totals_carry_on(demo):
    engine = Engine(demo, EngineSettings(num_blocks=128, block_size=16, speculation=NgramSpeculation(4)))
    request = engine.add_request(demo.tokenizer.encode(TEXTS[0]), GREEDY)
    for _ in range(40):
        engine.step()
    drafts = engine.speculator.stats.drafts
    assert drafts > 0
    engine.speculator.configure(None)
    for _ in range(10):
        engine.step()
    assert engine.speculator.stats.drafts == drafts
    engine.speculator.configure(NgramSpeculation(6, prompt_lookup_max=3))
    engine.run_until_done()
    assert engine.speculator.stats.drafts > drafts and len(engine.speculator.stats.accepted_per_position) == 6
    [[plain]], _ = generate(demo, GREEDY, prompts=[demo.tokenizer.encode(TEXTS[0])])
    assert request.sequences[0].output_ids == plain


def test_kvctl_requests_shows_a_request_s_kept_drafts():
    from rich.console import Console

    from kvctl.requests_cmd import render_requests

    row = {"request_id": "req-000000000001", "tenant": "acme", "api": "completions", "state": "decode",
           "age_seconds": 1.5, "queued_seconds": 0.1, "prompt_tokens": 120, "cached_tokens": 96, "restored_tokens": 0,
           "output_tokens": 37, "max_tokens": 64, "n": 1, "preemptions": 0, "blocks": 9, "priority": 0,
           "cohort": None, "shape": None, "drafted_tokens": 1200, "kept_draft_tokens": 912}
    console = Console(record=True, width=160)
    console.print(render_requests({"requests": [row], "running": 1, "waiting": 0}))
    line = " ".join(console.export_text().splitlines()[1].split())
    assert line == "req-000000000001 acme completions decode, 912 of 1,200 drafted kept 1.50 s 120 96 37/64 9"
    console = Console(record=True, width=160)
    console.print(render_requests({"requests": [{**row, "drafted_tokens": 0, "kept_draft_tokens": 0}],
                                   "running": 1, "waiting": 0}))
    assert console.export_text().splitlines()[1].split()[3] == "decode"


# ---- at kvd ---------------------------------------------------------------------------------------
def sample(text: str, name: str, labels: str = "") -> float:
    shown = f"{name}{{{labels}}}" if labels else name
    match = re.search(rf"^{re.escape(shown)} (\S+)$", text, re.MULTILINE)
    assert match, f"{shown} not exported"
    return float(match.group(1))


def test_kvd_serves_speculation_reports_it_and_reloads_it(tmp_path, demo):
    pytest.importorskip("fastapi")
    from rich.console import Console

    from kvctl.status_view import render_status, speculation_line

    from .daemon_fixtures import apps, call, settled, start_service, token_table

    service = start_service(tmp_path, num_blocks=64, metrics_aliases="vllm",
                            speculative_config='{"method": "ngram", "num_speculative_tokens": 4}')
    try:
        unix, _ = apps(service, token_table(tmp_path))
        body = {"prompt": TEXTS[1], "max_tokens": 48, "temperature": 0, "ignore_eos": True}
        answer = call(unix, "POST", "/v1/completions", json=body)
        assert answer.status_code == 200, answer.text
        [[expected]], _ = generate(demo, replace(GREEDY, max_tokens=48), prompts=[demo.tokenizer.encode(TEXTS[1])])
        assert answer.json()["choices"][0]["text"] == demo.tokenizer.decode(expected)
        streamed = call(unix, "POST", "/v1/completions", json={**body, "stream": True})
        chunks = [line for line in streamed.text.splitlines() if line.startswith("data: {")]
        assert "".join(json.loads(c[6:])["choices"][0]["text"] for c in chunks) == demo.tokenizer.decode(expected)
        status = settled(lambda: call(unix, "GET", "/admin/status").json(),
                         lambda s: s["speculation"]["drafts"] > 0 and not s["queue"]["running"])
        spec = status["speculation"]
        assert spec["config"] == {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
                                  "prompt_lookup_min": 2, "disable_by_batch_size": None}
        assert spec["emitted_tokens"] == spec["accepted_tokens"] + spec["drafts"]
        text = call(unix, "GET", "/metrics").text
        model = f'model_name="{service.model_name}"'
        assert sample(text, "kvd_spec_decode_drafts_total") == spec["drafts"]
        assert sample(text, "kvd_spec_decode_draft_tokens_total") == spec["draft_tokens"]
        assert sample(text, "kvd_spec_decode_accepted_tokens_total") == spec["accepted_tokens"] > 0
        assert sample(text, "kvd_spec_decode_accepted_tokens_per_pos_total", 'position="0"') == \
            spec["accepted_per_position"][0]
        assert sample(text, "vllm:spec_decode_num_accepted_tokens_total", model) == spec["accepted_tokens"]
        assert sample(text, "vllm:spec_decode_num_accepted_tokens_per_pos_total", f'{model},position="3"') == \
            spec["accepted_per_position"][3]
        console = Console(record=True, width=200)
        render_status(status, console)
        [row] = [line.split(None, 1)[1].strip() for line in console.export_text().splitlines()
                 if line.startswith("speculation")]
        assert row == (f"ngram, up to 4 draft tokens after a 2-4 token match; {spec['accepted_tokens']:,} of "
                       f"{spec['draft_tokens']:,} drafted tokens kept ({spec['acceptance_rate']:.0%}), "
                       f"{spec['mean_accepted_length']:.2f} tokens a step where a draft ran")
        result = service.reload(replace(service.config, speculative_config=None))
        assert list(result["changed"]) == ["speculative_config"] and result["changed"]["speculative_config"] is None
        assert service.engine.settings.speculation is None and service.engine.speculator.config is None
        off = call(unix, "GET", "/admin/status").json()["speculation"]
        assert off["config"] is None and off["drafts"] == spec["drafts"]
        assert speculation_line(off) == (f"off; {spec['accepted_tokens']:,} of {spec['draft_tokens']:,} drafted "
                                         f"tokens kept ({spec['acceptance_rate']:.0%}), "
                                         f"{spec['mean_accepted_length']:.2f} tokens a step where a draft ran")
        again = call(unix, "POST", "/v1/completions", json=body)
        assert again.json()["choices"][0]["text"] == demo.tokenizer.decode(expected)
        assert call(unix, "GET", "/admin/status").json()["speculation"]["drafts"] == spec["drafts"]
    finally:
        service.shutdown(1)


def test_speculative_config_refusal_names_the_setting_and_the_key():
    from kvctl.daemon.config import ConfigError, resolve

    with pytest.raises(ConfigError) as info:
        resolve({"speculative_config": '{"num_speculative_tokens": 40}'}, env={})
    assert str(info.value) == ("speculative_config: invalid value '{\"num_speculative_tokens\": 40}' from "
                               "--speculative-config: num_speculative_tokens: must be an integer from 1 to 16, got 40")
    config = resolve({}, env={"KVD_SPECULATIVE_CONFIG": '{"num_speculative_tokens": 3, "prompt_lookup_max": 3}'})
    assert json.loads(config.speculative_config) == {"method": "ngram", "num_speculative_tokens": 3,
                                                     "prompt_lookup_max": 3, "prompt_lookup_min": 2,
                                                     "disable_by_batch_size": None}


def test_bench_speculation_prints_both_runs_side_by_side(tmp_path, capsys):
    from .test_cli import cli

    prompts = tmp_path / "prompts.txt"
    prompts.write_text(json.dumps(TEXTS[1]) + "\n\n" + TEXTS[3] + "\n")
    status, out, err = cli(capsys, "bench", "speculation", "--prompts", str(prompts), "--max-tokens", "40",
                           "--repeats", "1", "--concurrency", "2", "--json")
    assert status == 0, err
    document = json.loads(out)
    assert document["settings"] == {"requests": 2, "max_tokens": 40, "concurrency": 2, "repeats": 1, "temperature": 0.0,
                                    "speculative_config": {"method": "ngram", "num_speculative_tokens": 4,
                                                           "prompt_lookup_max": 4, "prompt_lookup_min": 2,
                                                           "disable_by_batch_size": None},
                                    "prediction": "none"}
    assert document["identical_replies"] == 2 and document["model"] == "demo"
    base, fast = document["baseline"], document["speculative"]
    assert base["output_tokens"] == fast["output_tokens"] == 80
    assert fast["steps"] < base["steps"] and document["ratio"]["steps"] == fast["steps"] / base["steps"]
    assert fast["speculation"]["drafts"] > 0 and "speculation" not in base
    status, out, _ = cli(capsys, "bench", "speculation", "--prompts", str(prompts), "--max-tokens", "8",
                         "--repeats", "1")
    assert status == 0 and "replies identical to the baseline's: 2 of 2" in " ".join(out.split())
    status, out, _ = cli(capsys, "bench", "speculation", "--prompts", str(prompts), "--max-tokens", "40",
                         "--repeats", "1", "--temperature", "0.5", "--json")
    sampled = json.loads(out)
    assert status == 0 and sampled["settings"]["temperature"] == 0.5 and sampled["identical_replies"] == 2
    status, _, err = cli(capsys, "bench", "speculation", "--speculative-config", '{"method": "medusa"}')
    assert status == 2 and "method: kvd serves ngram (prompt lookup) only, got 'medusa'" in " ".join(err.split())
    empty = tmp_path / "empty.txt"
    empty.write_text("\n")
    status, _, err = cli(capsys, "bench", "speculation", "--prompts", str(empty))
    assert status == 2 and f"prompts: {str(empty)!r} holds no prompt" in " ".join(err.split())


def test_a_rollout_turns_speculation_on_for_its_cohort_and_completing_it_makes_it_everyone_s(tmp_path, demo):
    pytest.importorskip("fastapi")
    from .daemon_fixtures import apps, call, settled, start_service, token_table

    service = start_service(tmp_path, num_blocks=64)  # no speculative_config of its own
    try:
        unix, _ = apps(service, token_table(tmp_path))
        refused = call(unix, "POST", "/admin/rollouts", json={
            "policy": {"settings": {"speculative_config": {"num_speculative_tokens": 99}}}, "cohort": "50%"})
        assert refused.status_code == 400 and refused.json()["error"]["message"] == (
            "policy.settings.speculative_config: num_speculative_tokens: must be an integer from 1 to 16, got 99")
        body = {"policy": {"name": "spec-4", "settings": {"speculative_config": {"num_speculative_tokens": 4}}},
                "cohort": "100%", "stops": ["tpot_p95_seconds > 100 * baseline"]}
        started = call(unix, "POST", "/admin/rollouts", json=body).json()
        completion = {"prompt": TEXTS[1], "max_tokens": 32, "temperature": 0, "ignore_eos": True}
        [[expected]], _ = generate(demo, replace(GREEDY, max_tokens=32), prompts=[demo.tokenizer.encode(TEXTS[1])])
        for _ in range(3):
            answer = call(unix, "POST", "/v1/completions", json=completion)
            assert answer.json()["choices"][0]["text"] == demo.tokenizer.decode(expected)
        status = settled(lambda: call(unix, "GET", f"/admin/rollouts/{started['id']}").json(),
                         lambda s: s["cohort"]["requests"] == 3)
        assert status["cohort"]["tpot_p50_seconds"] > 0 and status["baseline"]["tpot_p50_seconds"] is None
        drafts = service.engine.speculator.stats.drafts
        assert drafts > 0 and service.engine.settings.speculation is None  # the cohort's own, not the engine's
        done = call(unix, "POST", f"/admin/rollouts/{started['id']}/complete").json()
        canonical = json.dumps({"disable_by_batch_size": None, "method": "ngram", "num_speculative_tokens": 4,
                                "prompt_lookup_max": 4, "prompt_lookup_min": 2}, sort_keys=True)
        assert done["applied"] == {"speculative_config": {"value": canonical, "was": None}}
        assert done["settings_in_effect"] == {"speculative_config": True}
        assert done["keep"]["speculative_config"].startswith(f"set speculative_config: {canonical} in kvd's config")
        assert service.engine.settings.speculation == NgramSpeculation(4)
        assert service.config.sources["speculative_config"] == f"rollout {started['id']}"
        assert call(unix, "POST", "/v1/completions", json=completion).status_code == 200
        assert service.engine.speculator.stats.drafts > drafts  # everyone's now
        # and a cohort can be held off it: null turns speculation off for its requests alone
        off = call(unix, "POST", "/admin/rollouts", json={
            "policy": {"name": "no-spec", "settings": {"speculative_config": None}}, "cohort": "100%"}).json()
        drafts = service.engine.speculator.stats.drafts
        assert call(unix, "POST", "/v1/completions", json=completion).status_code == 200
        assert service.engine.speculator.stats.drafts == drafts
        call(unix, "POST", f"/admin/rollouts/{off['id']}/rollback")
    finally:
        service.shutdown(1)
