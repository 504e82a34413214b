"""The engine on the demo checkpoint: batching, prefix reuse, chunking, preemption, forks,
cancellation, admission, and a many-request soak that ends with every block back."""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")
pytest.importorskip("tokenizers")

from kvctl.daemon.engine.engine import (AdmissionRejected, Engine, EngineSettings,  # noqa: E402
                                       TokenEvent)
from kvctl.daemon.engine.requests import SeqStatus  # noqa: E402
from kvctl.daemon.engine.sampling import RequestError, SamplingParams  # noqa: E402
from kvctl.daemon.model.demo import ensure_demo_checkpoint  # noqa: E402
from kvctl.daemon.model.llama import load_model  # noqa: E402

from .conftest import FakeClock  # noqa: E402
from .test_model import full_forward_logits  # noqa: E402

GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.9, top_k=50, seed=11, ignore_eos=True)


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return load_model(ensure_demo_checkpoint(tmp_path_factory.mktemp("state")))


def prompt(demo, text):
    return demo.tokenizer.encode(text)


def run(demo, prompts, params, **settings):
    engine = Engine(demo, EngineSettings(**{"num_blocks": 64, "block_size": 16, **settings}))
    requests = [engine.add_request(p, params) for p in prompts]
    for _ in range(10_000):
        if not engine.has_work():
            break
        engine.step()
        engine.cache.audit()
    return engine, [[s.output_ids for s in r.sequences] for r in requests]


def all_blocks_back(engine):
    engine.cache.audit()
    counts = engine.cache.state_counts()
    return counts["free"] + counts["cached"] == engine.settings.num_blocks


PROMPTS = ["The paged cache keeps blocks of sixteen tokens.",
           "Operators pin hot prefixes such as system prompts.",
           "A short one.",
           "Continuous batching mixes prefills and decodes in one step of the loop."]


def test_paged_decoding_equals_no_cache_recomputation(demo):
    ids = prompt(demo, PROMPTS[0])
    _, [[out]] = run(demo, [ids], GREEDY)
    for step, token in enumerate(out):
        assert int(torch.argmax(full_forward_logits(demo, ids + out[:step]))) == token


def test_batched_requests_equal_requests_run_alone(demo):
    prompts = [prompt(demo, t) for t in PROMPTS]
    _, together = run(demo, prompts, SAMPLED)
    alone = [run(demo, [p], SAMPLED)[1][0] for p in prompts]
    assert together == alone


def test_prefix_hit_produces_the_same_tokens_as_a_cold_request(demo):
    ids = prompt(demo, PROMPTS[3])  # 71 tokens: four full blocks cacheable
    engine = Engine(demo, EngineSettings(num_blocks=64, block_size=16))
    cold = engine.add_request(ids, SAMPLED)
    engine.run_until_done()
    warm = engine.add_request(ids, SAMPLED)
    engine.run_until_done()
    assert (cold.metrics.cached_tokens, warm.metrics.cached_tokens) == (0, 64)
    assert warm.sequences[0].output_ids == cold.sequences[0].output_ids
    assert all_blocks_back(engine)


def test_tenants_do_not_share_cached_prefixes(demo):
    ids = prompt(demo, PROMPTS[3])
    engine = Engine(demo, EngineSettings(num_blocks=64, block_size=16))
    engine.add_request(ids, GREEDY, tenant="acme")
    engine.run_until_done()
    other = engine.add_request(ids, GREEDY, tenant="globex")
    engine.run_until_done()
    assert other.metrics.cached_tokens == 0


def test_chunked_prefill_equals_unchunked(demo):
    prompts = [prompt(demo, t) for t in PROMPTS]
    _, chunked = run(demo, prompts, SAMPLED, max_batch_tokens=7)
    _, whole = run(demo, prompts, SAMPLED, max_batch_tokens=1024)
    assert chunked == whole


def test_preempt_and_resume_equals_uninterrupted(demo):
    prompts = [prompt(demo, t) for t in PROMPTS]
    params = SamplingParams(max_tokens=40, temperature=0.8, seed=5, ignore_eos=True)
    tight, interrupted = run(demo, prompts, params, num_blocks=12, reservation="fixed:0")
    _, calm = run(demo, prompts, params, num_blocks=128)
    assert tight.stats.preemptions > 0
    assert sum(r.metrics.recomputed_tokens for r in tight.requests.values()) > 0
    assert interrupted == calm
    assert all_blocks_back(tight)


def test_n_samples_share_the_prompt_blocks_and_are_reproducible(demo):
    ids = prompt(demo, PROMPTS[1])
    params = SamplingParams(max_tokens=10, temperature=1.0, n=3, seed=123, ignore_eos=True)
    engine = Engine(demo, EngineSettings(num_blocks=64, block_size=16))
    request = engine.add_request(ids, params)
    while len(request.sequences) < 3:
        engine.step()
    prompt_blocks = len(ids) // 16 + 1
    tables = [engine.cache.block_table(s.seq_id)[:len(ids) // 16] for s in request.sequences]
    assert tables[0] == tables[1] == tables[2]  # one prefill, three samples
    assert engine.cache.state_counts()["shared"] >= prompt_blocks - 1
    engine.run_until_done()
    first = [s.output_ids for s in request.sequences]
    _, [second] = run(demo, [ids], params)
    assert first == second
    assert len({tuple(o) for o in first}) > 1  # the samples differ
    assert all_blocks_back(engine)


def test_stop_token_ids_and_stop_strings(demo):
    ids = prompt(demo, PROMPTS[0])
    _, [[greedy]] = run(demo, [ids], GREEDY)
    stop_id = greedy[5]
    first = greedy.index(stop_id)
    engine, [[out]] = run(demo, [ids], SamplingParams(max_tokens=24, ignore_eos=True,
                                                       stop_token_ids=(stop_id,)))
    assert out == greedy[:first + 1]
    text = demo.tokenizer.decode(greedy)
    stop = text[8:11]
    engine = Engine(demo, EngineSettings(num_blocks=64, block_size=16))
    request = engine.add_request(ids, SamplingParams(max_tokens=24, ignore_eos=True, stop=(stop,)))
    engine.run_until_done()
    seq = request.sequences[0]
    assert seq.finish_reason == "stop" and engine.text_of(seq) == text[:text.find(stop)]


def test_cancel_while_queued_prefilling_or_decoding_returns_every_block(demo):
    engine = Engine(demo, EngineSettings(num_blocks=64, block_size=16, max_batch_tokens=8, max_running=2))
    long = prompt(demo, PROMPTS[3] * 3)
    decoding = engine.add_request(prompt(demo, PROMPTS[2]), GREEDY)
    prefilling = engine.add_request(long, GREEDY)
    queued = engine.add_request(long, GREEDY)
    for _ in range(3):
        engine.step()
    assert decoding.sequences[0].status is SeqStatus.DECODE
    assert prefilling.sequences[0].status is SeqStatus.PREFILL
    assert queued.sequences[0].status is SeqStatus.WAITING
    for request in (queued, prefilling, decoding):
        assert engine.cancel(request.request_id) == [
            TokenEvent(request.request_id, 0, None, "cancelled")]
        engine.cache.audit()
        assert engine.cancel(request.request_id) == []
    assert not engine.has_work()
    assert [r.sequences[0].finish_reason for r in (decoding, prefilling, queued)] == ["cancelled"] * 3
    assert all_blocks_back(engine)


def test_rejections_say_which_limit_and_allocate_nothing(demo):
    engine = Engine(demo, EngineSettings(num_blocks=4, block_size=16, max_queue=1, max_running=1))
    before = engine.cache.state_counts()
    with pytest.raises(AdmissionRejected) as info:
        engine.add_request(list(range(60)), SamplingParams(max_tokens=10))
    assert str(info.value).endswith("needs 5 blocks for its prompt and output reservation but the "
                                    "cache has 4; it can never fit")
    assert engine.cache.state_counts() == before
    engine.add_request(list(range(20)), SamplingParams(max_tokens=4))  # waits in the queue
    with pytest.raises(AdmissionRejected, match=r"admission queue full \(1 of 1 waiting\)"):
        engine.add_request(list(range(20)), SamplingParams(max_tokens=4))
    assert engine.cache.state_counts() == before


def test_a_request_the_whole_cache_could_never_hold_at_its_longest_is_refused_whatever_it_reserves(demo):
    # reserving less than max_tokens (fixed:N, p95) once let such a request in: after its prompt and
    # 108 tokens it was preempted, and waited at the head of the queue for room that never came
    engine = Engine(demo, EngineSettings(num_blocks=8, block_size=16, reservation="fixed:0"))
    before = engine.cache.state_counts()
    with pytest.raises(AdmissionRejected) as info:
        engine.add_request(list(range(3, 23)), SamplingParams(max_tokens=200, ignore_eos=True), request_id="long")
    assert str(info.value) == ("request long: its prompt and max_tokens (200) need 14 blocks but the cache has 8; "
                               "it could never finish (its output reservation, 0 tokens, fits): lower max_tokens")
    assert info.value.kind == "never_fits" and engine.stats.rejections == {"never_fits": 1}
    assert engine.cache.state_counts() == before
    request = engine.add_request(list(range(3, 23)), SamplingParams(max_tokens=108, ignore_eos=True))
    engine.run_until_done()  # 128 tokens: the whole cache, and no more
    assert len(request.sequences[0].output_ids) == 108 and all_blocks_back(engine)


def test_a_tenant_s_own_request_limit_overrides_the_default_both_ways(demo):
    engine = Engine(demo, EngineSettings(num_blocks=64, block_size=16, max_running=1, max_tenant_requests=2,
                                         tenant_request_limits=(("free", 1), ("paid", 3))))
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    engine.add_request(list(range(20)), params, tenant="free")
    with pytest.raises(AdmissionRejected) as info:
        engine.add_request(list(range(20, 40)), params, tenant="free", request_id="req-free2")
    assert str(info.value) == "request req-free2: tenant 'free' has 1 requests in flight (tenant_request_limits[free] 1)"
    for i in range(3):  # above the default of 2
        engine.add_request(list(range(40 + 20 * i, 60 + 20 * i)), params, tenant="paid")
    with pytest.raises(AdmissionRejected, match=r"tenant 'paid' has 3 requests in flight \(tenant_request_limits"):
        engine.add_request(list(range(100, 120)), params, tenant="paid")
    engine.add_request(list(range(120, 140)), params, tenant="other")
    engine.add_request(list(range(140, 160)), params, tenant="other")
    with pytest.raises(AdmissionRejected, match=r"\(max_tenant_requests 2\)"):  # no limit of its own
        engine.add_request(list(range(160, 180)), params, tenant="other")
    engine.run_until_done()
    engine.cache.audit()


def test_one_tenant_cannot_hold_more_than_its_share_of_requests_in_flight(demo):
    engine = Engine(demo, EngineSettings(num_blocks=64, block_size=16, max_running=1, max_tenant_requests=2))
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    first = engine.add_request(list(range(20)), params, tenant="acme")
    engine.add_request(list(range(20, 40)), params, tenant="acme")
    before = engine.cache.state_counts()
    with pytest.raises(AdmissionRejected) as info:
        engine.add_request(list(range(40, 60)), params, tenant="acme", request_id="req-third")
    assert (info.value.kind, str(info.value)) == (
        "tenant_limit", "request req-third: tenant 'acme' has 2 requests in flight (max_tenant_requests 2)")
    assert engine.cache.state_counts() == before and engine.stats.rejections == {"tenant_limit": 1}
    engine.add_request(list(range(60, 80)), params, tenant="globex")  # another tenant's share is its own
    engine.run_until_done()
    assert first.finished
    engine.add_request(list(range(40, 60)), params, tenant="acme")  # done ones free the share
    engine.run_until_done()
    assert all_blocks_back(engine)


@pytest.mark.parametrize("params, message", [
    (SamplingParams(max_tokens=0), "max_tokens: must be an integer >= 1, got 0"),
    (SamplingParams(top_p=0.0), "top_p: must be in (0, 1], got 0.0"),
    (SamplingParams(n=0), "n: must be an integer from 1 to 64, got 0"),
    (SamplingParams(temperature=-1), "temperature: must be between 0 and 100, got -1"),
    (SamplingParams(stop_token_ids=(999,)), "stop_token_ids: must be token ids in [0, 258), got 999"),
    (SamplingParams(max_tokens=9000), "max_tokens: prompt (3) + max_tokens (9000) exceeds the model's 8192"),
])
def test_request_validation_names_the_field(demo, params, message):
    engine = Engine(demo, EngineSettings(num_blocks=8, block_size=16))
    with pytest.raises(RequestError) as info:
        engine.add_request([1, 2, 3], params)
    assert str(info.value).startswith(message)
    with pytest.raises(RequestError, match=r"prompt: token ids must lie in \[0, 258\), found 300"):
        engine.add_request([1, 300], SamplingParams())


def test_priority_queue_admits_higher_priority_first(demo):
    engine = Engine(demo, EngineSettings(num_blocks=64, block_size=16, max_running=1,
                                         queue_order="priority"))
    low = engine.add_request([1, 2, 3], SamplingParams(max_tokens=2), priority=0)
    high = engine.add_request([4, 5, 6], SamplingParams(max_tokens=2), priority=5)
    engine.step()
    assert high.sequences[0].status is not SeqStatus.WAITING
    assert low.sequences[0].status is SeqStatus.WAITING
    engine.run_until_done()


SHARED = list(range(1, 33))  # two blocks
ONCE = SamplingParams(max_tokens=1, ignore_eos=True)


def hold_the_slot_over_a_cached_prefix(engine) -> None:
    """Cache SHARED (a prompt of it, run to its end), then start a request that holds the one slot
    for a few steps: what comes next waits."""
    engine.add_request(SHARED + [40], ONCE)
    engine.run_until_done()
    engine.add_request([50] * 5, SamplingParams(max_tokens=4, ignore_eos=True))
    engine.step()


def admitted_in_turn(engine, clock, waiting: dict) -> list[str]:
    """Step `engine` to its end, 10 ms a step: the names of `waiting`'s requests in the order they went in."""
    seen = []
    while engine.has_work():
        engine.step()
        clock.advance(0.01)
        seen += [name for name, r in waiting.items() if r.metrics.admitted is not None and name not in seen]
    return seen


@pytest.mark.parametrize("order, gap, max_queue_wait, admitted", [
    ("fifo", 0.0, 0.0, ["B", "C", "D"]),
    ("lpm", 0.0, 0.0, ["C", "B", "D"]),  # C's prompt opens with two cached blocks
    ("lpm", 29.9, 0.0, ["C", "B", "D"]),
    ("lpm", 30.0, 0.0, ["B", "C", "D"]),  # B has waited LPM_PATIENCE_SECONDS: it goes first
    ("lpm", 30.0, 40.0, ["C", "B", "D"]),  # with a max_queue_wait, that bounds the wait instead
])
def test_lpm_admits_the_longest_cached_prefix_first_until_a_request_has_waited_its_patience(
        demo, order, gap, max_queue_wait, admitted):
    """One slot, busy; B (a prompt nobody shares) queues, `gap` seconds later C (opening with a
    cached prompt) and D (nobody's). fifo admits them as they came; lpm takes C first, unless B has
    waited its patience by then (without a max_queue_wait)."""
    clock = FakeClock(100.0)
    engine = Engine(demo, EngineSettings(num_blocks=64, block_size=16, max_running=1, queue_order=order,
                                         max_queue_wait=max_queue_wait), clock=clock)
    shared, once = SHARED, ONCE
    hold_the_slot_over_a_cached_prefix(engine)
    waiting = {"B": engine.add_request(list(range(100, 140)), once)}
    clock.advance(gap)
    waiting |= {"C": engine.add_request(shared + [41, 42], once), "D": engine.add_request(list(range(150, 190)), once)}
    names = {id(r): name for name, r in waiting.items()}
    # what `kvctl requests` shows of the queue: the order the next pass tries, and the blocks each holds
    assert [(names[id(seq.request)], hits) for seq, hits in engine.admission_queue()] == [
        (name, 2 if name == "C" else 0) for name in admitted]
    seen = admitted_in_turn(engine, clock, waiting)
    assert seen == admitted
    assert engine.stats.admitted_ahead == (1 if admitted[0] == "C" else 0)  # C, while B waited
    assert [waiting[name].metrics.passed_over for name in "BCD"] == ([1, 0, 0] if admitted[0] == "C" else [0, 0, 0])
    assert [waiting[name].metrics.cached_tokens for name in "BCD"] == [0, 32, 0]
    assert not any(r.rejected for r in waiting.values())


@pytest.mark.parametrize("order", ["fifo", "lpm"])
def test_the_work_ahead_of_a_prompt_counts_what_lpm_would_try_first(demo, order):
    """Waiting: B (40 tokens, none cached), C (34 tokens, 32 cached), D (40, none). Ahead of a new
    prompt: all of their uncached tokens (82) first come, first served; under lpm, only those of
    the requests holding as many cached blocks as it does, until they have waited 30 s."""
    clock = FakeClock(100.0)
    engine = Engine(demo, EngineSettings(num_blocks=64, block_size=16, max_running=1, queue_order=order), clock=clock)
    shared, once = SHARED, ONCE
    hold_the_slot_over_a_cached_prefix(engine)  # its prompt computed
    for prompt_ids in (list(range(100, 140)), shared + [41, 42], list(range(150, 190))):
        engine.add_request(prompt_ids, once)
    ahead = {cached: engine.tokens_ahead(cached) for cached in (None, 0, 1, 2, 3)}
    assert ahead == ({None: 82, 0: 82, 1: 2, 2: 2, 3: 0} if order == "lpm" else dict.fromkeys(ahead, 82))
    assert engine.queue_figures(2)["tokens_ahead"] == ahead[2]
    # what waits by the blocks each holds, for a router's view (not said first come, first served)
    assert engine.queue_figures().get("lpm_waiting") == ([[2, 2], [0, 80]] if order == "lpm" else None)
    clock.advance(30.0)  # every one has waited lpm's patience: they go first, whatever it holds
    assert engine.tokens_ahead(3) == 82
    assert engine.queue_figures().get("lpm_waiting") == ([] if order == "lpm" else None)


@pytest.mark.parametrize("order", ["fifo", "priority"])
def test_the_work_ahead_of_a_request_counts_only_the_places_a_priority_queue_would_try_first(demo, order):
    """Waiting: A (40 tokens, engine priority -5: place 5), B (40, place 0), C (34, place -10).
    Ahead of a request at place -10: only C's tokens; at 0: B's and C's; at 5, or not said: all.
    First come, first served, all of them whatever its place."""
    engine = Engine(demo, EngineSettings(num_blocks=64, block_size=16, max_running=1, queue_order=order),
                    clock=FakeClock(100.0))
    engine.add_request([50] * 5, SamplingParams(max_tokens=4, ignore_eos=True))
    engine.step()  # it holds the slot, its prompt computed
    once = SamplingParams(max_tokens=1, ignore_eos=True)
    for prompt_ids, priority in ((list(range(100, 140)), -5), (list(range(150, 190)), 0), (list(range(1, 35)), 10)):
        engine.add_request(prompt_ids, once, priority=priority if order == "priority" else 0)
    ahead = {priority: engine.tokens_ahead(priority=priority) for priority in (None, 10, 0, -5)}
    assert ahead == ({None: 114, 10: 34, 0: 74, -5: 114} if order == "priority" else dict.fromkeys(ahead, 114))
    assert engine.queue_figures(0, priority=0)["tokens_ahead"] == ahead[0]
    # what waits by place, lowest first, for a router's view (not said first come, first served)
    assert engine.queue_figures().get("priority_waiting") == (
        [[-10, 34], [0, 40], [5, 40]] if order == "priority" else None)
    engine.run_until_done()


@pytest.mark.parametrize("order, admitted", [
    ("fifo", ["B", "L", "C", "H"]),
    ("priority", ["H", "B", "C", "L"]),
    ("lpm", ["L", "C", "B", "H"]),  # L and C open with the two cached blocks
    ("priority+lpm", ["H", "C", "B", "L"]),  # H's place first; at place 0, C (cached) before B; L's place last
])
def test_priority_lpm_orders_by_place_then_by_cached_prefix_within_one(demo, order, admitted):
    """One slot, busy. Waiting, as they came: B (nobody's prompt, place 0), L (opening with two cached
    blocks, place 5), C (the same opening, place 0), H (nobody's, place -5). Under priority+lpm the
    places hold, and within place 0 the cached prompt goes first."""
    clock = FakeClock(100.0)
    engine = Engine(demo, EngineSettings(num_blocks=64, block_size=16, max_running=1, queue_order=order),
                    clock=clock)
    shared, once = SHARED, ONCE
    hold_the_slot_over_a_cached_prefix(engine)
    ranked = order in ("priority", "priority+lpm")
    waiting = {name: engine.add_request(prompt_ids, once, priority=priority if ranked else 0)
               for name, prompt_ids, priority in (("B", list(range(100, 140)), 0), ("L", shared + [43, 44], -5),
                                                  ("C", shared + [41, 42], 0), ("H", list(range(150, 190)), 5))}
    names = {id(r): name for name, r in waiting.items()}
    assert [names[id(seq.request)] for seq, _ in engine.admission_queue()] == admitted
    if order == "priority+lpm":
        # ahead of a newcomer at place 0 holding 2 blocks: H (a better place) and C (2 blocks, before it)
        assert engine.tokens_ahead(2, priority=0) == 40 + 2
        assert engine.tokens_ahead(0, priority=0) == 40 + 2 + 40  # B too: it came first, holding as few
        assert engine.tokens_ahead(0, priority=5) == 40  # at H's place: H alone
        assert engine.tokens_ahead(2, priority=-5) == 40 + 2 + 40 + 2  # at the last place: every one
        # for a router's view: by place, then the blocks each holds (most first)
        assert engine.queue_figures()["priority_lpm_waiting"] == [[-5, 0, 40], [0, 2, 2], [0, 0, 40], [5, 2, 2]]
        assert "priority_waiting" not in engine.queue_figures() and "lpm_waiting" not in engine.queue_figures()
        clock.advance(30.0)  # each has waited lpm's patience: at its place, it goes first whatever it holds
        assert engine.queue_figures()["priority_lpm_waiting"] == [[-5, None, 40], [0, None, 42], [5, None, 2]]
        assert engine.tokens_ahead(2, priority=0) == 40 + 42
        assert [names[id(seq.request)] for seq, _ in engine.admission_queue()] == ["H", "B", "C", "L"]
        clock.advance(-30.0)
    seen = admitted_in_turn(engine, clock, waiting)
    assert seen == admitted


def test_under_lpm_a_preempted_request_goes_first_whatever_it_holds(demo):
    """A request admitted once and preempted since waits on past max_queue_wait (it is never timed
    out); under lpm it goes before prompts that hold more of the cache, as it does first come, first
    served, instead of waiting while they keep coming."""
    clock = FakeClock(100.0)
    engine = Engine(demo, EngineSettings(num_blocks=64, block_size=16, max_running=1, queue_order="lpm",
                                         max_queue_wait=60.0), clock=clock)
    shared = list(range(1, 33))
    once = SamplingParams(max_tokens=1, ignore_eos=True)
    engine.add_request(shared + [40], once)
    engine.run_until_done()
    fresh = engine.add_request(list(range(100, 110)), SamplingParams(max_tokens=8, ignore_eos=True))
    engine.step()  # admitted: its prompt (less than a block: nothing cached) computed
    [seq] = fresh.sequences
    engine._preempt(seq)  # as a full cache would
    assert seq.status is SeqStatus.WAITING and fresh.metrics.admitted is not None
    sharing = engine.add_request(shared + [41, 42], once)
    assert [entry[1].request for entry in engine._admission_order()] == [fresh, sharing]
    # it is ahead of a prompt holding 2 blocks, and not among what lpm may put after one
    assert engine.tokens_ahead(2) == len(fresh.prompt_ids) + len(seq.output_ids) + 2
    assert engine.lpm_waiting() == [[2, 2]]
    engine.run_until_done()
    assert fresh.metrics.preemptions == 1 and len(fresh.sequences[0].output_ids) == 8


def test_accounting_with_a_fake_clock(demo):
    clock = FakeClock(100.0)
    engine = Engine(demo, EngineSettings(num_blocks=64, block_size=16), clock=clock)
    request = engine.add_request(prompt(demo, PROMPTS[0]), SamplingParams(max_tokens=3, ignore_eos=True))
    clock.advance(0.5)
    while engine.has_work():
        engine.step()
        clock.advance(0.25)
    m = request.metrics
    assert (m.time_queued, m.ttft) == (0.5, 0.5)
    assert m.inter_token_latencies == [0.25, 0.25]


@pytest.mark.parametrize("quick", [0, 24], ids=["mixed", "quick-prefill"])
def test_many_requests_with_random_arrivals_cancellations_and_preemption(demo, quick):
    rng = random.Random(7)
    engine = Engine(demo, EngineSettings(num_blocks=20, block_size=16, max_batch_tokens=48,
                                         max_running=6, max_queue=8, reservation="fixed:4",
                                         quick_prefill_tokens=quick))
    outcomes = {}
    for step in range(400):
        if step < 250 and rng.random() < 0.35:
            ids = [rng.randrange(256) for _ in range(rng.randint(1, 120))]
            params = SamplingParams(max_tokens=rng.randint(1, 40), temperature=rng.choice([0.0, 0.7]),
                                    n=rng.choice([1, 1, 2]), seed=rng.randrange(1000), ignore_eos=True)
            try:
                request = engine.add_request(ids, params)
                outcomes[request.request_id] = request
            except AdmissionRejected as rejected:
                assert rejected.request.rejected and "request" in rejected.request.rejected
                outcomes[rejected.request.request_id] = rejected.request
        if outcomes and rng.random() < 0.05:
            engine.cancel(rng.choice(sorted(outcomes)))
        engine.step()
        engine.cache.audit()
    engine.run_until_done()
    assert engine.stats.preemptions > 0
    assert ("quick" in engine.stats.steps) is bool(quick)
    assert any(r.rejected for r in outcomes.values())
    for request in outcomes.values():
        assert request.finished
        if not request.rejected and not request.cancelled:
            for seq in request.sequences:
                assert seq.finish_reason == "length"
                assert len(seq.output_ids) == request.params.max_tokens
    assert all_blocks_back(engine)


@pytest.mark.parametrize("dtype, scales", [("auto", None), ("int8", {0: ([0.05], [0.05]), 1: ([0.05], [0.05])})])
def test_triton_kernel_path_gives_the_same_tokens_as_the_torch_path(demo, dtype, scales):
    """The engine's CUDA path (Triton write_kv, prefill and decode kernels; here under
    TRITON_INTERPRET=1 on the CPU) against the batched torch path, chunked prefill included."""
    pytest.importorskip("triton")
    import os

    if os.environ.get("TRITON_INTERPRET") == "1":
        model = demo
    elif torch.cuda.is_available():
        model = load_model(demo.path, device="cuda")  # both paths on the GPU
    else:
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    prompts = [prompt(model, "Hello there, paged world of caches"), prompt(model, "A second prompt here")]
    outputs = []
    try:
        for use_triton in (False, True):
            model.model.use_triton = use_triton
            engine = Engine(model, EngineSettings(num_blocks=64, block_size=16, max_batch_tokens=24,
                                                  cache_dtype=dtype), scales=scales)
            requests = [engine.add_request(p, SamplingParams(max_tokens=6, ignore_eos=True)) for p in prompts]
            engine.run_until_done()
            engine.cache.audit()
            outputs.append([r.sequences[0].output_ids for r in requests])
    finally:
        model.model.use_triton = model.model.device.type == "cuda"
    assert outputs[0] == outputs[1]


def test_decodes_sharing_a_cached_system_prompt_equal_each_request_alone(demo):
    """Concurrent decodes over the same cached prefix blocks take the cascade path (the prefix
    attended once per group); their tokens equal those of each request run alone, cold."""
    system = prompt(demo, "You are the support assistant of a KV cache daemon; answer briefly. " * 2)
    questions = [prompt(demo, q) for q in ("How do pins work?", "What is a block?", "Why evict?",
                                            "Where do tiers live?")]
    engine = Engine(demo, EngineSettings(num_blocks=64, block_size=16))
    engine.add_request(system + questions[0], SamplingParams(max_tokens=1, ignore_eos=True))
    engine.run_until_done()
    together = [engine.add_request(system + q, SAMPLED) for q in questions]
    engine.run_until_done()
    full = (len(system + questions[0]) - 1) // 16 * 16  # the warm prompt itself, all but its last token's block
    assert [r.metrics.cached_tokens for r in together] == [full] + [len(system) // 16 * 16] * 3
    alone = [run(demo, [system + q], SAMPLED)[1][0][0] for q in questions]
    assert [r.sequences[0].output_ids for r in together] == alone
    assert all_blocks_back(engine)


def test_the_stacked_system_prompts_are_copied_once_while_decodes_take_new_blocks(demo):
    """Two system prompts, two decodes over each: their prefixes are attended from one stacked
    copy, named by the pool's content keys. When decodes take new blocks the grouping is
    planned again, but the copy is kept (the stacked blocks still hold the same content), and
    the tokens equal each request run alone."""
    from kvctl.kernels import torch_paged

    systems = [prompt(demo, "You are the support assistant of a KV cache daemon; answer briefly. " * 2),
               prompt(demo, "You summarise operator runbooks for a serving fleet, in one line. " * 2)]
    questions = [prompt(demo, q) for q in ("How do pins work?", "What is a block?")]
    engine = Engine(demo, EngineSettings(num_blocks=96, block_size=16))
    for system in systems:
        engine.add_request(system, SamplingParams(max_tokens=1, ignore_eos=True))
    engine.run_until_done()
    copies = []
    real = torch_paged._stacked_rows

    def counting(stack, k_cache, v_cache):
        if k_cache.data_ptr() not in stack.copies:
            copies.append(k_cache.data_ptr())
        return real(stack, k_cache, v_cache)

    torch_paged._stacked_rows = counting
    try:
        requests = [engine.add_request(s + q, SAMPLED) for s in systems for q in questions]
        plans = []
        while engine.has_work():
            engine.step()
            plan = engine.model._plans[None].decode
            if plan is not None and plan.stack is not None:
                plans.append(plan)
    finally:
        torch_paged._stacked_rows = real
    pool = engine.cache.pool
    stack = plans[0].stack
    assert stack.contents == tuple(tuple(pool.blocks[b].key for b in row) for row in stack.blocks.tolist())
    assert len({id(p.groups) for p in plans}) > 1  # planned again as decodes took blocks...
    assert all(p.stack.copies is stack.copies for p in plans)  # ...with one copy throughout
    assert len(copies) == len(engine.kv_caches)  # once per layer
    alone = [run(demo, [s + q], SAMPLED)[1][0][0] for s in systems for q in questions]
    assert [r.sequences[0].output_ids for r in requests] == alone
    assert all_blocks_back(engine)


def test_requests_arriving_together_compute_a_shared_prefix_once(demo):
    """The second of two requests with the same system prompt waits while the first computes
    it, then reuses its blocks; a different request behind it is admitted at once."""
    system = prompt(demo, "Shared instructions for every question in this group of requests. " * 2)
    first, second = system + prompt(demo, "First?"), system + prompt(demo, "Second?")
    other = prompt(demo, "An unrelated prompt that shares nothing with the others at all.")
    engine = Engine(demo, EngineSettings(num_blocks=64, block_size=16, max_batch_tokens=32))
    a, b, c = (engine.add_request(p, SAMPLED) for p in (first, second, other))
    engine.step()
    assert [r.sequences[0].status for r in (a, b, c)] == [SeqStatus.PREFILL, SeqStatus.WAITING, SeqStatus.PREFILL]
    engine.run_until_done()
    assert (a.metrics.cached_tokens, b.metrics.cached_tokens, c.metrics.cached_tokens) == (0, len(system) // 16 * 16, 0)
    assert [r.sequences[0].output_ids for r in (a, b, c)] == [run(demo, [p], SAMPLED)[1][0][0]
                                                            for p in (first, second, other)]
    assert all_blocks_back(engine)


def count_hashing(monkeypatch) -> list[int]:
    """The lengths of the token lists the engine hashes from now on, in order."""
    from kvctl.daemon.engine import engine as engine_module

    hashed: list[int] = []

    class CountingHasher(engine_module.PrefixHasher):
        def feed(self, token_ids):
            hashed.append(len(token_ids))
            return super().feed(token_ids)

    monkeypatch.setattr(engine_module, "PrefixHasher", CountingHasher)
    return hashed


def test_a_waiting_prompt_is_hashed_once_not_every_step(demo, monkeypatch):
    """The head of the queue waits for room for several steps: its block keys are computed
    once and reused at admission, and its tokens are the same as a request run alone."""
    hashed = count_hashing(monkeypatch)
    engine = Engine(demo, EngineSettings(num_blocks=12, block_size=16))
    first = engine.add_request(prompt(demo, PROMPTS[3]), SamplingParams(max_tokens=40, ignore_eos=True))
    second_ids = prompt(demo, PROMPTS[1])  # its prompt and reservation fit only once the first is done
    second = engine.add_request(second_ids, SamplingParams(max_tokens=60, ignore_eos=True))
    waited = 0
    while second.sequences[0].status is SeqStatus.WAITING:
        engine.step()
        waited += 1
    assert waited > 5
    assert hashed.count(len(second_ids)) == 1
    engine.run_until_done()
    _, alone = run(demo, [second_ids], SamplingParams(max_tokens=60, ignore_eos=True))
    assert [s.output_ids for s in second.sequences] == alone[0]
    assert first.sequences[0].finish_reason == "length" and all_blocks_back(engine)


def test_tokens_between_slices_prompt_and_output_without_joining_them():
    from kvctl.daemon.engine.requests import Request, RequestMetrics, Sequence

    request = Request("r", [10, 11, 12, 13], SamplingParams(max_tokens=4), 0, "default", 0, 0, RequestMetrics(0.0))
    seq = Sequence("r/0", request, 0, output_ids=[20, 21, 22])
    for begin in range(8):
        for end in range(begin, 8):
            assert seq.tokens_between(begin, end) == seq.all_tokens[begin:end]


def test_steps_are_counted_and_timed_by_kind(demo):
    """A prompt alone is a prefill step, decodes alone are decode steps, and a prompt chunk
    beside decodes makes a mixed step; each kind's time is summed for the busy figure."""
    clock = iter(range(1000)).__next__
    engine = Engine(demo, EngineSettings(num_blocks=64, block_size=16), clock=lambda: float(clock()))
    engine.add_request(prompt(demo, PROMPTS[0]), SamplingParams(max_tokens=4, ignore_eos=True))
    engine.step()  # the whole prompt, and its first token
    engine.step()
    assert engine.stats.steps == {"prefill": 1, "decode": 1}
    engine.add_request(prompt(demo, PROMPTS[1]), SamplingParams(max_tokens=2, ignore_eos=True))
    engine.step()  # the second prompt beside the first request's decode
    engine.run_until_done()
    assert engine.stats.steps == {"prefill": 1, "decode": 2, "mixed": 1}
    # a prompt cached but for its last token: a one-token chunk is still a prefill step
    ids = prompt(demo, PROMPTS[0])
    ids = ids[:len(ids) // 16 * 16 + 1]
    engine.add_request(ids, SamplingParams(max_tokens=1, ignore_eos=True))
    engine.step()
    assert engine.stats.steps["prefill"] == 2
    assert set(engine.stats.step_seconds) == {"prefill", "decode", "mixed"}
    assert all(seconds > 0 for seconds in engine.stats.step_seconds.values())


def test_keys_hashed_before_the_lock_are_used_and_keys_for_other_ids_are_not(demo, monkeypatch):
    """A caller (the service) hashes a prompt before taking the engine's lock and hands the keys
    in: the step does not hash it again and the request hits the cache as it would have. Keys
    computed for other ids of the same length are ignored, so they can never cause a false hit."""

    engine = Engine(demo, EngineSettings(num_blocks=64, block_size=16))
    system = prompt(demo, "You are the support assistant of a KV cache daemon; answer briefly. " * 2)
    warm = engine.add_request(system + prompt(demo, "Q0"), SamplingParams(max_tokens=2, ignore_eos=True))
    engine.run_until_done()
    ids = system + prompt(demo, "How do pins work?")
    keys = engine.prefix_keys("default", ids)
    hashed = count_hashing(monkeypatch)
    request = engine.add_request(ids, SamplingParams(max_tokens=3, ignore_eos=True), prefix_keys=keys)
    engine.run_until_done()
    assert len(ids) not in hashed  # the step used the keys it was given
    assert warm.metrics.cached_tokens == 0 and request.metrics.cached_tokens == len(system) // 16 * 16
    _, [[alone]] = run(demo, [ids], SamplingParams(max_tokens=3, ignore_eos=True))
    assert request.sequences[0].output_ids == alone
    other = [t ^ 1 for t in ids]  # same length, other tokens
    stranger = engine.add_request(other, SamplingParams(max_tokens=1, ignore_eos=True), prefix_keys=keys)
    engine.run_until_done()
    assert stranger.metrics.cached_tokens == 0 and len(other) in hashed
    assert all_blocks_back(engine)


def test_a_short_prompt_gets_a_step_of_its_own_ahead_of_the_decodes_never_two_in_a_row(demo):
    """quick_prefill_tokens: a prompt with at most that many tokens left (here the remainder after
    a cached system prompt) runs alone ahead of the decodes, so its first token comes in a step
    that carries no decode; the decodes are never held back two steps in a row; a longer
    remainder joins the decodes' step. The tokens are the same as with every prompt mixed in."""
    system = prompt(demo, PROMPTS[3])[:64]  # four full blocks, cached once the first request has run
    texts = [" one", " two", " three", " four", " and a remainder longer than sixteen tokens"]

    def schedule(quick):
        engine = Engine(demo, EngineSettings(num_blocks=64, block_size=16, quick_prefill_tokens=quick))
        names, steps = {}, []

        def add(index):
            names[engine.add_request(system + prompt(demo, texts[index]), GREEDY).request_id] = "ABCDE"[index]

        def step():
            steps.append("".join(sorted(names[e.request_id] for e in engine.step())))

        add(0)
        step()  # A's prompt
        step()  # A decodes
        add(1)
        step()
        step()
        add(2)
        step()
        add(3)
        step()
        add(4)
        step()
        engine.run_until_done()
        outputs = {names[r.request_id]: r.sequences[0].output_ids for r in engine.requests.values()}
        return steps, outputs, engine

    quick_steps, quick_out, engine = schedule(16)
    assert quick_steps == ["A", "A",
                           "B", "AB",  # B alone (4 tokens left), then the decodes with B's
                           "C", "ABCD",  # C alone; D waits for the decodes' step: not two quick in a row
                           "ABCDE"]  # E has 43 tokens left: with the decodes
    assert engine.stats.steps["prefill"] == 1 and engine.stats.steps["quick"] == 2  # A's prompt; B's and C's
    mixed_steps, mixed_out, _ = schedule(0)
    assert mixed_steps == ["A", "A", "AB", "AB", "ABC", "ABCD", "ABCDE"]
    assert quick_out == mixed_out and all(len(tokens) == GREEDY.max_tokens for tokens in quick_out.values())
    with pytest.raises(ValueError, match="quick_prefill_tokens: must be >= 0, got -1"):
        Engine(demo, EngineSettings(num_blocks=64, block_size=16, quick_prefill_tokens=-1))


def test_the_engine_predicts_a_new_requests_wait_from_the_prompt_tokens_ahead_of_it(demo):
    engine = Engine(demo, EngineSettings(num_blocks=64, block_size=16, max_batch_tokens=32, max_running=1,
                                         quick_prefill_tokens=0))
    first, second = list(range(1, 101)), list(range(101, 171))  # 100 and 70 tokens, nothing shared
    engine.add_request(first, GREEDY)
    engine.add_request(second, GREEDY)
    assert engine.tokens_ahead() == 170 and engine.predicted_wait() is None  # nothing measured yet
    engine.step()  # the first is admitted and computes 32 of its tokens
    assert engine.prefill_rate.samples == 1
    assert engine.tokens_ahead() == (100 - 32) + 70
    assert engine.predicted_wait() == pytest.approx(138 / engine.prefill_rate.rate)
    # a waiting request whose prefix is cached brings only what it lacks
    while engine.has_work():
        engine.step()
    engine.add_request(first[:64] + [200] * 10, GREEDY)  # 64 of its tokens are cached
    engine.add_request(first[:64] + [201] * 10, GREEDY)
    assert engine.tokens_ahead() == 2 * 10


def test_a_finished_request_counts_the_blocks_it_held_and_those_reserved_it_never_wrote(demo):
    ids = list(range(40, 72))  # 32 tokens: two whole blocks
    _, [[greedy]] = run(demo, [ids], SamplingParams(max_tokens=40, ignore_eos=True))
    stop_id = greedy[4]
    made = greedy.index(stop_id) + 1  # its output, to the first stop token
    engine = Engine(demo, EngineSettings(num_blocks=64, block_size=16))  # reservation fraction:1.0
    stopped = engine.add_request(ids, SamplingParams(max_tokens=40, ignore_eos=True, stop_token_ids=(stop_id,)))
    engine.run_until_done()
    assert len(stopped.sequences[0].output_ids) == made
    # it reserved for 32 + 40 tokens, 5 blocks; it wrote its prompt and its output but the last token
    written = -(-(32 + made - 1) // 16)
    assert (engine.stats.finished_blocks, engine.stats.reserved_unused_blocks) == (5, 5 - written)
    whole = engine.add_request(ids, SamplingParams(max_tokens=16, ignore_eos=True))  # 48 tokens: 3 blocks, all written
    engine.run_until_done()
    assert whole.sequences[0].finish_reason == "length"
    assert (engine.stats.finished_blocks, engine.stats.reserved_unused_blocks) == (5 + 3, 5 - written)
    cancelled = engine.add_request(ids, SamplingParams(max_tokens=40, ignore_eos=True))
    engine.step()
    engine.step()
    engine.cancel(cancelled.request_id)
    engine.run_until_done()
    assert (engine.stats.finished_blocks, engine.stats.reserved_unused_blocks) == (5 + 3, 5 - written)
    assert all_blocks_back(engine)
