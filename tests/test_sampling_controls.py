"""Penalties, bias, min_p, min_tokens and logprobs: the arithmetic on hand-made logits, the engine's
tokens against transformers' own processors and a no-cache recomputation, and their survival of
prefix hits, preemption and forks."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")
pytest.importorskip("tokenizers")

from kvctl.daemon.engine.engine import Engine, EngineSettings  # noqa: E402
from kvctl.daemon.engine.logits import RowTokens, adjust_logits, adjust_rows  # noqa: E402
from kvctl.daemon.engine.sampling import RequestError, SamplingParams, sampling_scores  # noqa: E402
from kvctl.daemon.model.demo import ensure_demo_checkpoint  # noqa: E402
from kvctl.daemon.model.llama import load_model  # noqa: E402

from .test_model import PROMPT, full_forward_logits  # noqa: E402

INF = float("-inf")


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return load_model(ensure_demo_checkpoint(tmp_path_factory.mktemp("state")))


def run(loaded, prompts, params, num_blocks=64, **settings):
    engine = Engine(loaded, EngineSettings(num_blocks=num_blocks, block_size=16, **settings))
    each = params if isinstance(params, list) else [params] * len(prompts)  # (one for all, or one each)
    requests = [engine.add_request(list(p), q) for p, q in zip(prompts, each)]
    for _ in range(10_000):
        if not engine.has_work():
            break
        engine.step()
        engine.cache.audit()
    return engine, requests


# ---- the arithmetic ------------------------------------------------------------------------------
def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    logits = torch.tensor([1.0, -1.0, 2.0, 0.5])
    scores = adjust_logits(logits, SamplingParams(repetition_penalty=2.0), [0], [1], set())
    assert scores.tolist() == [0.5, -2.0, 2.0, 0.5]
    assert logits.tolist() == [1.0, -1.0, 2.0, 0.5]  # the batch's logits are left alone


def test_the_repetition_penalty_reads_the_prompt_s_ids_made_once_as_it_reads_them_as_a_list(demo):
    """A long prompt's set of ids was made again at every step of every sequence with a repetition
    penalty (3.5 ms a row a step for 8,000 tokens of a 128k vocabulary, this VM); the request now
    keeps them as a tensor, made at its first draw, and the penalty reads the same tokens."""
    g = torch.Generator().manual_seed(1)
    logits, prompt = torch.randn(300, generator=g), torch.randint(0, 300, (500,), generator=g).tolist()
    params = SamplingParams(repetition_penalty=1.3)
    made = torch.tensor(sorted(set(prompt)), dtype=torch.int64)
    for output in ([], [7, 7, 299], prompt[:3]):
        assert torch.equal(adjust_logits(logits, params, made, output, set()),
                           adjust_logits(logits, params, prompt, output, set()))
    engine = Engine(demo, EngineSettings(num_blocks=64, block_size=16))
    request = engine.add_request(demo.tokenizer.encode("the cache the cache " * 4),
                                 SamplingParams(max_tokens=6, repetition_penalty=1.2, ignore_eos=True))
    engine.step()
    kept = request.prompt_vocab
    engine.run_until_done()
    assert request.prompt_vocab is kept and kept.tolist() == sorted(set(request.prompt_ids))


def test_frequency_counts_each_output_occurrence_and_presence_counts_once():
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=1.0)
    scores = adjust_logits(torch.tensor([1.0, -1.0, 2.0, 0.5]), params, [0, 0, 0], [2, 2, 3], set())
    assert scores.tolist() == [1.0, -1.0, 2.0 - 2 * 0.5 - 1.0, 0.5 - 0.5 - 1.0]  # the prompt is not counted


def test_logit_bias_adds_to_the_named_tokens():
    params = SamplingParams(logit_bias=((3, 10.0), (0, -100.0)))
    assert adjust_logits(torch.tensor([1.0, -1.0, 2.0, 0.5]), params, [], [], set()).tolist() == [-99.0, -1.0, 2.0, 10.5]


def test_min_tokens_bans_eos_and_stop_token_ids_until_the_output_is_long_enough():
    logits = torch.tensor([1.0, 2.0, 3.0, 4.0])
    params = SamplingParams(max_tokens=8, min_tokens=2, stop_token_ids=(0,), logit_bias=((1, 50.0),))
    assert adjust_logits(logits, params, [], [2], {1}).tolist() == [INF, INF, 3.0, 4.0]  # a bias cannot lift a ban
    assert adjust_logits(logits, params, [], [2, 2], {1}).tolist() == [1.0, 52.0, 3.0, 4.0]
    ignoring = SamplingParams(max_tokens=8, min_tokens=2, stop_token_ids=(0,), ignore_eos=True)
    assert adjust_logits(logits, ignoring, [], [], {1}).tolist() == [INF, 2.0, 3.0, 4.0]


def _random_rows(rng, vocab: int, count: int):
    """`count` rows of settings drawn at random: each control on or off, prompts and outputs of ids."""
    rows = []
    for _ in range(count):
        fields = {}
        if rng.random() < 0.3:
            fields["allowed_token_ids"] = tuple(rng.sample(range(vocab), rng.randint(1, 20)))
        if rng.random() < 0.4:
            fields["min_tokens"] = rng.randint(0, 6)
        if rng.random() < 0.3:
            fields["stop_token_ids"] = tuple(rng.sample(range(vocab), 2))
        if rng.random() < 0.2:
            fields["ignore_eos"] = True
        if rng.random() < 0.4:
            fields["logit_bias"] = tuple((t, rng.uniform(-100, 100)) for t in rng.sample(range(vocab), 5))
        if rng.random() < 0.5:
            fields["repetition_penalty"] = rng.uniform(0.5, 2.0)
        if rng.random() < 0.5:
            fields["frequency_penalty"] = rng.uniform(-2.0, 2.0)
        if rng.random() < 0.5:
            fields["presence_penalty"] = rng.uniform(-2.0, 2.0)
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(0, 40))]
        output = [rng.randrange(vocab) for _ in range(rng.randint(0, 10))]
        rows.append((SamplingParams(**fields), prompt, output))
    return rows


def _row_tokens(params, prompt, output, device="cpu") -> RowTokens:
    made = torch.tensor(sorted(set(prompt)), dtype=torch.int64, device=device)
    return RowTokens(params, output, made if params.repetition_penalty != 1.0 else None)


def test_a_step_s_rows_adjusted_together_equal_each_adjusted_alone_value_for_value():
    """adjust_rows (every control of the step's rows in a few ops) against adjust_logits, its
    row-by-row reference: the same float32 numbers, so the same tokens are drawn."""
    import random

    rng = random.Random(0)
    eos = {1, 2}
    for _ in range(120):
        rows = _random_rows(rng, 500, rng.randint(1, 8))
        logits = torch.randn(len(rows), 500) * 3
        alone = torch.stack([adjust_logits(logits[i], params, prompt, output, eos)
                             for i, (params, prompt, output) in enumerate(rows)])
        scores = logits.clone()
        together = adjust_rows(scores, [_row_tokens(*row) for row in rows], eos)
        assert together is scores  # in place: the caller's copy of the step's rows
        assert torch.equal(together, alone), rows


def test_rows_adjusted_together_make_every_index_on_the_logits_device():
    """On the meta device (a stand-in for a GPU: an op that mixes it with a host tensor fails), every
    control runs; with a prompt's ids left on the host, the repetition penalty fails at once."""
    params = SamplingParams(repetition_penalty=1.2, frequency_penalty=0.5, presence_penalty=0.3, min_tokens=5,
                            logit_bias=((3, 1.0),), allowed_token_ids=(1, 2, 3), stop_token_ids=(4,))
    rows = [RowTokens(params, [1, 2, 3], torch.tensor([4, 5], device="meta")), RowTokens(SamplingParams(), []),
            RowTokens(SamplingParams(min_tokens=3, repetition_penalty=2.0), [7], torch.tensor([9], device="meta"))]
    assert adjust_rows(torch.zeros(3, 50, device="meta"), rows, {0}).device.type == "meta"
    with pytest.raises(RuntimeError):
        adjust_rows(torch.zeros(1, 50, device="meta"), [RowTokens(params, [1], torch.tensor([4]))], {0})
    with pytest.raises(ValueError, match=r"rows: 2 for scores of shape \(3, 50\)"):
        adjust_rows(torch.zeros(3, 50), rows[:2], {0})


def test_min_p_drops_tokens_under_that_fraction_of_the_most_likely_one():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    scores = sampling_scores(logits, SamplingParams(temperature=1.0, min_p=0.2))  # keep p >= 0.1
    assert torch.isinf(scores).tolist() == [False, False, False, True]
    hotter = sampling_scores(logits, SamplingParams(temperature=1.0, min_p=0.5))  # keep p >= 0.25
    assert torch.isinf(hotter).tolist() == [False, False, True, True]


@pytest.mark.parametrize("field, value, message", [
    ("presence_penalty", 2.5, "presence_penalty: must be a number from -2 to 2, got 2.5"),
    ("frequency_penalty", float("nan"), "frequency_penalty: must be a number from -2 to 2, got nan"),
    ("repetition_penalty", 0, r"repetition_penalty: must be a number in \(0, 10\]; 1 changes nothing, got 0"),
    ("min_p", 1.5, "min_p: must be a number from 0 to 1, got 1.5"),
    ("min_tokens", 9, r"min_tokens: must be an integer from 0 to max_tokens \(8\), got 9"),
    ("logit_bias", ((258, 1.0),), r"logit_bias: keys must be token ids in \[0, 258\), got 258"),
    ("logit_bias", ((5, 101.0),), r"logit_bias\[5\]: must be a number from -100 to 100, got 101.0"),
    ("logprobs", 21, "logprobs: must be an integer from 0 to 20, got 21"),
])
def test_each_bad_value_is_refused_naming_the_field_and_the_value(field, value, message):
    with pytest.raises(RequestError, match=message):
        SamplingParams(max_tokens=8, **{field: value}).validate(258)


# ---- the engine ----------------------------------------------------------------------------------
def test_greedy_with_repetition_penalty_and_min_tokens_equals_transformers_generate(tmp_path):
    pytest.importorskip("transformers")
    from .model_cases import build_checkpoint

    hf = build_checkpoint("llama3", tmp_path)
    loaded = load_model(tmp_path)
    eos = 7  # made EOS for both sides, and so favoured that only min_tokens holds it off
    hf.generation_config.eos_token_id = eos
    with torch.no_grad():
        bias = {(eos,): 20.0}  # transformers' sequence_bias, the same as logit_bias for one token
        expected = hf.generate(torch.tensor([PROMPT]), do_sample=False, max_new_tokens=14, repetition_penalty=1.3,
                               min_new_tokens=6, sequence_bias=bias, pad_token_id=eos)[0, len(PROMPT):].tolist()
    engine = Engine(loaded, EngineSettings(num_blocks=32, block_size=16))
    engine.eos_ids = {eos}
    request = engine.add_request(PROMPT, SamplingParams(max_tokens=14, repetition_penalty=1.3, min_tokens=6,
                                                        logit_bias=((eos, 20.0),)))
    engine.run_until_done()
    got = request.sequences[0].output_ids
    assert got == expected
    assert len(got) == 7 and got[-1] == eos and request.sequences[0].finish_reason == "stop"  # EOS once allowed


def test_a_bias_that_forces_eos_ends_the_output_at_min_tokens(demo):
    eos = demo.tokenizer.eos_token_id
    forced = SamplingParams(max_tokens=16, logit_bias=((eos, 100.0),))
    _, (short,) = run(demo, [demo.tokenizer.encode("hello")], forced)
    assert short.sequences[0].output_ids == [eos]
    _, (longer,) = run(demo, [demo.tokenizer.encode("hello")],
                       SamplingParams(max_tokens=16, min_tokens=5, logit_bias=((eos, 100.0),)))
    seq = longer.sequences[0]
    assert len(seq.output_ids) == 6 and eos not in seq.output_ids[:5] and seq.output_ids[5] == eos
    assert seq.finish_reason == "stop"


def test_frequency_and_presence_penalties_match_a_recomputation_without_the_cache(demo):
    prompt = demo.tokenizer.encode("the cache the cache the cache")
    params = SamplingParams(max_tokens=30, frequency_penalty=1.5, presence_penalty=0.5, ignore_eos=True)
    _, (request,) = run(demo, [prompt], params)
    expected: list[int] = []
    for _ in range(30):
        logits = full_forward_logits(demo, prompt + expected).clone()
        for token in set(expected):
            logits[token] -= 1.5 * expected.count(token) + 0.5
        expected.append(int(torch.argmax(logits)))
    assert request.sequences[0].output_ids == expected
    _, (plain,) = run(demo, [prompt], SamplingParams(max_tokens=30, ignore_eos=True))
    assert plain.sequences[0].output_ids != expected  # the penalties changed what greedy picks


def test_a_stop_string_ends_no_output_shorter_than_min_tokens(demo):
    prompt = demo.tokenizer.encode("count: ")
    free = SamplingParams(max_tokens=12, ignore_eos=True)
    _, (plain,) = run(demo, [prompt], free)
    text = demo.tokenizer.decode(plain.sequences[0].output_ids)
    stop = text[1:3]  # appears in the first few tokens' text
    _, (stopped,) = run(demo, [prompt], SamplingParams(max_tokens=12, ignore_eos=True, stop=(stop,)))
    assert len(stopped.sequences[0].output_ids) < 6
    _, (held,) = run(demo, [prompt], SamplingParams(max_tokens=12, ignore_eos=True, stop=(stop,), min_tokens=8))
    seq = held.sequences[0]
    assert len(seq.output_ids) >= 8 and seq.output_ids[:8] == plain.sequences[0].output_ids[:8]
    assert seq.text_end is None or seq.text_end >= len(demo.tokenizer.decode(seq.output_ids[:7]))


def test_penalised_sampling_is_unchanged_by_preemption_and_forks(demo):
    prompts = [demo.tokenizer.encode(f"request {i}: words") for i in range(4)]
    params = SamplingParams(max_tokens=40, temperature=0.9, top_p=0.95, min_p=0.05, seed=3, n=2,
                            frequency_penalty=0.7, repetition_penalty=1.2, ignore_eos=True, logprobs=2)
    roomy, wide = run(demo, prompts, params, num_blocks=128)
    tight, narrow = run(demo, prompts, params, num_blocks=14, reservation="fixed:0")
    assert tight.stats.preemptions > 0 and sum(r.metrics.recomputed_tokens for r in narrow) > 0
    for a, b in zip(wide, narrow):
        assert [s.output_ids for s in a.sequences] == [s.output_ids for s in b.sequences]
        for x, y in zip(a.sequences, b.sequences):
            assert [t[1][0][0] for t in x.logprobs] == [t[1][0][0] for t in y.logprobs]
            for (lx, _), (ly, _) in zip(x.logprobs, y.logprobs):
                assert math.isclose(lx, ly, abs_tol=1e-4)
    assert len({tuple(s.output_ids) for r in wide for s in r.sequences}) == 8  # samples differ


def every_control(loaded):
    """Eight requests, greedy and sampled, penalised, biased, limited, cut by top_p or top_k, held
    to a regex or a choice, one of them n=2: (prompts, params)."""
    pytest.importorskip("llguidance")
    from kvctl.daemon.engine.structured import Constraint

    tokens = loaded.tokenizer.encode("the cache, the blocks and the pins of the cache")
    settings = [
        dict(repetition_penalty=1.3),
        dict(temperature=0.9, seed=1, frequency_penalty=0.8, presence_penalty=0.4),
        dict(temperature=1.0, seed=2, constraint=Constraint.regex("[a-z]{3,8}", "guided_regex")),
        dict(temperature=0.8, seed=3, top_p=0.9),
        dict(temperature=1.2, seed=5, top_k=5, top_p=0.95),
        dict(),
        dict(constraint=Constraint.choice(["device", "host", "disk"], "guided_choice")),
        dict(temperature=1.0, seed=4, allowed_token_ids=tuple(tokens), logit_bias=((tokens[1], 3.0),), min_tokens=3,
             repetition_penalty=0.8, n=2),
    ]
    params = [SamplingParams(max_tokens=10, ignore_eos="constraint" not in fields, **fields) for fields in settings]
    return [loaded.tokenizer.encode(f"request {i}: where is it?") for i in range(len(params))], params


def test_requests_with_every_control_take_in_one_batch_the_tokens_each_takes_alone(demo):
    """A step adjusts its rows together (logits.adjust_rows) and masks them to their grammars
    together: greedy and sampled rows, penalised, biased, limited, shaped or plain, beside each
    other, take what each takes when it runs alone."""
    prompts, params = every_control(demo)
    _, together = run(demo, prompts, params, num_blocks=128)
    for prompt, p, batched in zip(prompts, params, together):
        _, (alone,) = run(demo, [prompt], p, num_blocks=128)
        assert [s.output_ids for s in alone.sequences] == [s.output_ids for s in batched.sequences], p
    assert demo.tokenizer.decode(together[6].sequences[0].output_ids) in ("device", "host", "disk")
    assert set(together[7].sequences[0].output_ids) <= set(prompts[7] + demo.tokenizer.encode(
        "the cache, the blocks and the pins of the cache"))


def test_the_engine_s_draws_through_a_narrow_window_are_those_of_the_whole_sort(demo, monkeypatch):
    """The demo's 258 tokens fit the default window: narrowed to 8, the cut rows of every control
    are resolved in it or sorted whole, and take the same tokens."""
    from kvctl.daemon.engine import sampling

    prompts, params = every_control(demo)
    _, wide = run(demo, prompts, params, num_blocks=128)
    monkeypatch.setattr(sampling, "WINDOW", 8)
    resolved, looked = [], sampling._window_weights

    def counted(scores, table, window, **filters):
        weights = looked(scores, table, window, **filters)
        resolved.extend(weights[2].tolist())
        return weights

    monkeypatch.setattr(sampling, "_window_weights", counted)
    _, narrow = run(demo, prompts, params, num_blocks=128)
    assert resolved.count(True) > 3 and resolved.count(False) > 3  # rows of both kinds were drawn
    assert [[s.output_ids for s in r.sequences] for r in wide] == [[s.output_ids for s in r.sequences] for r in narrow]


# ---- logprobs ------------------------------------------------------------------------------------
def test_logprobs_are_the_model_s_own_and_the_same_on_a_prefix_hit(demo):
    prompt = demo.tokenizer.encode("System: answer briefly about KV caches and blocks. Q: what is a block?")
    params = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=3)
    engine = Engine(demo, EngineSettings(num_blocks=64, block_size=16))
    cold = engine.add_request(prompt, params)
    engine.run_until_done()
    warm = engine.add_request(prompt, params)
    engine.run_until_done()
    assert warm.metrics.cached_tokens >= 64
    seq = cold.sequences[0]
    assert len(seq.logprobs) == 6
    for i, (token, (logprob, top)) in enumerate(zip(seq.output_ids, seq.logprobs)):
        expected = torch.log_softmax(full_forward_logits(demo, prompt + seq.output_ids[:i]), dim=-1)
        assert math.isclose(logprob, float(expected[token]), abs_tol=1e-4)
        assert [t for t, _ in top] == torch.topk(expected, 3).indices.tolist()
        assert top[0][0] == token and top[0][1] == logprob  # greedy takes the most likely
        assert [v for _, v in top] == sorted((v for _, v in top), reverse=True)
    hit = warm.sequences[0]
    assert hit.output_ids == seq.output_ids
    for (a, top_a), (b, top_b) in zip(seq.logprobs, hit.logprobs):
        assert math.isclose(a, b, abs_tol=1e-4) and [t for t, _ in top_a] == [t for t, _ in top_b]


def test_logprobs_zero_reports_the_token_alone_and_no_request_without_them_pays(demo):
    prompt = demo.tokenizer.encode("hello there")
    _, (zero,) = run(demo, [prompt], SamplingParams(max_tokens=3, ignore_eos=True, logprobs=0))
    assert [top for _, top in zero.sequences[0].logprobs] == [(), (), ()]
    assert all(lp <= 0 for lp, _ in zero.sequences[0].logprobs)
    _, (none,) = run(demo, [prompt], SamplingParams(max_tokens=3, ignore_eos=True))
    assert none.sequences[0].logprobs == [] and none.sequences[0].output_ids == zero.sequences[0].output_ids


def test_logprobs_reported_for_a_batch_at_once_are_each_request_s_own(demo):
    """The step reports the logprobs of every sample that asks, in one go: each request gets what
    it gets alone (its own alternatives, n > 1 samples each their own token), and one that does
    not ask gets none."""
    from kvctl.policies.speculation import NgramSpeculation

    prompts = [demo.tokenizer.encode(t) for t in ("blocks of the cache " * 3, "a pinned prefix", "evict it")]
    asks = [SamplingParams(max_tokens=16, ignore_eos=True, logprobs=2),
            SamplingParams(max_tokens=16, temperature=0.9, seed=4, n=2, ignore_eos=True, logprobs=4),
            SamplingParams(max_tokens=16, temperature=0.9, seed=5, ignore_eos=True)]

    def replies(engine, requests):
        engine.run_until_done()
        return [[(s.output_ids, s.logprobs) for s in r.sequences] for r in requests]

    for speculation in (None, NgramSpeculation(2)):
        engine = Engine(demo, EngineSettings(num_blocks=64, block_size=16, speculation=speculation))
        together = replies(engine, [engine.add_request(p, a) for p, a in zip(prompts, asks)])
        assert speculation is None or engine.speculator.stats.drafts > 0  # (verdicts report theirs too)
        for prompt, ask, mine in zip(prompts, asks, together):
            alone = Engine(demo, EngineSettings(num_blocks=64, block_size=16, speculation=speculation))
            [theirs] = replies(alone, [alone.add_request(prompt, ask)])
            assert [ids for ids, _ in mine] == [ids for ids, _ in theirs]
            for (_, lps), (_, lps_alone) in zip(mine, theirs):
                assert len(lps) == (0 if ask.logprobs is None else 16)
                for (value, top), (value_alone, top_alone) in zip(lps, lps_alone):
                    assert math.isclose(value, value_alone, abs_tol=1e-4) and len(top) == ask.logprobs
                    assert [t for t, _ in top] == [t for t, _ in top_alone]
        [first, second] = together[1]
        assert first[0] != second[0] and all(top[0][1] >= lp for lp, top in first[1])


# ---- prompt logprobs -----------------------------------------------------------------------------
def prompt_reference(loaded, prompt):
    """Each prompt token's logprob given the tokens before it, recomputed without the cache."""
    return [torch.log_softmax(full_forward_logits(loaded, prompt[:i]), dim=-1) for i in range(1, len(prompt))]


@pytest.mark.parametrize("chunk", [256, 16, 7])
def test_prompt_logprobs_cover_every_position_even_where_the_prefix_is_cached(demo, chunk):
    prompt = demo.tokenizer.encode("System: answer briefly about KV caches and their blocks. Q: why pin a prefix?")
    engine = Engine(demo, EngineSettings(num_blocks=64, block_size=16, max_batch_tokens=chunk))
    warm = engine.add_request(prompt, SamplingParams(max_tokens=2, ignore_eos=True))
    engine.run_until_done()
    scored = engine.add_request(prompt, SamplingParams(max_tokens=2, ignore_eos=True, prompt_logprobs=2))
    engine.run_until_done()
    engine.cache.audit()
    assert warm.metrics.cached_tokens == 0 and scored.metrics.cached_tokens == 0  # every position computed
    assert len(scored.prompt_logprobs) == len(prompt) - 1
    for token, expected, (logprob, rank, top) in zip(prompt[1:], prompt_reference(demo, prompt),
                                                     scored.prompt_logprobs):
        assert math.isclose(logprob, float(expected[token]), abs_tol=1e-4)
        assert rank == int((expected > expected[token]).sum()) + 1
        assert [t for t, _ in top] == torch.topk(expected, 2).indices.tolist()
    assert scored.sequences[0].output_ids == warm.sequences[0].output_ids
    after = engine.add_request(prompt, SamplingParams(max_tokens=1, ignore_eos=True))
    engine.run_until_done()
    assert after.metrics.cached_tokens == (len(prompt) - 1) // 16 * 16  # what is cached still serves others


def test_a_scored_prompt_s_blocks_are_shared_from_then_on_and_preemption_records_each_position_once(demo):
    prompts = [demo.tokenizer.encode(f"scored prompt number {i}, long enough to need a few blocks") for i in range(3)]
    params = SamplingParams(max_tokens=40, temperature=0.8, seed=2, ignore_eos=True, prompt_logprobs=0)
    tight, squeezed = run(demo, prompts, params, num_blocks=12, reservation="fixed:0", max_batch_tokens=16)
    roomy, calm = run(demo, prompts, params, num_blocks=128)
    assert tight.stats.preemptions > 0
    for a, b, prompt in zip(squeezed, calm, prompts):
        assert len(a.prompt_logprobs) == len(b.prompt_logprobs) == len(prompt) - 1
        assert [r for _, r, _ in a.prompt_logprobs] == [r for _, r, _ in b.prompt_logprobs]
        assert all(top == () for _, _, top in a.prompt_logprobs)
        assert [s.output_ids for s in a.sequences] == [s.output_ids for s in b.sequences]
    again = roomy.add_request(prompts[0], SamplingParams(max_tokens=1))
    roomy.run_until_done()
    assert again.metrics.cached_tokens == (len(prompts[0]) - 1) // 16 * 16


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_controls_and_logprobs_run_on_the_gpu_as_on_the_cpu(demo):
    """Indices made for the penalties, bias and prompt logprobs live on the logits' device."""
    gpu = load_model(demo.path, device="cuda")
    prompt = demo.tokenizer.encode("the cache the cache, scored on a GPU")
    params = SamplingParams(max_tokens=12, min_tokens=4, frequency_penalty=1.0, presence_penalty=0.5,
                            repetition_penalty=1.2, logit_bias=((demo.tokenizer.eos_token_id, 5.0),),
                            logprobs=2, prompt_logprobs=2)
    (_, (on_cpu,)), (_, (on_gpu,)) = run(demo, [prompt], params), run(gpu, [prompt], params)
    assert on_gpu.sequences[0].output_ids == on_cpu.sequences[0].output_ids
    for (a, _), (b, _) in zip(on_cpu.sequences[0].logprobs, on_gpu.sequences[0].logprobs):
        assert math.isclose(a, b, abs_tol=1e-3)
    assert len(on_gpu.prompt_logprobs) == len(prompt) - 1
    for (a, _, _), (b, _, _) in zip(on_cpu.prompt_logprobs, on_gpu.prompt_logprobs):
        assert math.isclose(a, b, abs_tol=1e-3)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_every_control_and_grammar_runs_in_one_batch_on_the_gpu_as_on_the_cpu(demo):
    """The step's adjusted rows, grammar masks (made on the host) and draws, on the GPU, with and
    without prompt-lookup speculation: the tokens the CPU takes."""
    from kvctl.policies.speculation import NgramSpeculation

    gpu = load_model(demo.path, device="cuda")
    prompts, params = every_control(demo)
    _, on_cpu = run(demo, prompts, params, num_blocks=128)
    for speculation in (None, NgramSpeculation(2)):
        _, on_gpu = run(gpu, prompts, params, num_blocks=128, speculation=speculation)
        for a, b in zip(on_cpu, on_gpu):
            assert [s.output_ids for s in a.sequences] == [s.output_ids for s in b.sequences], a.params
