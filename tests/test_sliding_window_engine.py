"""The engine serving a model whose every layer slides a window (Mistral 7B v0.1's kind; here a
window of 24 tokens): transformers' tokens past the window, in a cache too small to hold the
sequences whole, each sequence holding at most its window's blocks, with prompt chunks,
preemptions, n > 1 and speculative drafts."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from kvctl.daemon.engine.engine import AdmissionRejected, Engine, EngineSettings  # noqa: E402
from kvctl.daemon.engine.sampling import SamplingParams  # noqa: E402
from kvctl.daemon.cache.manager import DROPPED  # noqa: E402
from kvctl.daemon.model.llama import load_model  # noqa: E402
from kvctl.policies.speculation import NgramSpeculation  # noqa: E402

from .model_cases import build_checkpoint, hf_greedy  # noqa: E402

PROMPTS = [[(i * step + first) % 300 for i in range(70)] for step, first in ((37, 5), (11, 2), (53, 9))]


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    directory = tmp_path_factory.mktemp("mistral-window")
    hf = build_checkpoint("mistral-window", directory)
    return hf, load_model(directory)


@pytest.fixture(scope="module")
def expected(mistral):
    hf, _ = mistral
    return [hf_greedy(hf, prompt, 40) for prompt in PROMPTS]


def run(engine, requests):
    """Every step, each running sequence holds at most `window_blocks` (held and reserved), and
    every entry before its window reads DROPPED."""
    cache = engine.cache
    most = 0
    while engine.has_work():
        engine.step()
        cache.audit()
        for seq_id in list(cache._seqs):
            state = cache.sequence(seq_id)
            most = max(most, state.held_blocks + len(state.reserve))
            assert state.held_blocks + len(state.reserve) <= cache.window_blocks
            assert list(state.table[:state.dropped]) == [DROPPED] * state.dropped
    return [[s.output_ids for s in r.sequences] for r in requests], most


def test_three_long_sequences_run_in_a_cache_too_small_for_one_whole_with_transformers_tokens(mistral, expected):
    """110 tokens a sequence is 7 blocks of 16; the cache has 12. With a window of 24 and prompt
    chunks of 32 a sequence holds at most ceil((24 - 1 + 32) / 16) + 2 = 6, so two run at once."""
    _, loaded = mistral
    engine = Engine(loaded, EngineSettings(num_blocks=12, block_size=16, max_batch_tokens=32))
    assert (engine.cache.window, engine.cache.window_blocks) == (24, 6)
    requests = [engine.add_request(p, SamplingParams(max_tokens=40, ignore_eos=True)) for p in PROMPTS]
    outputs, most = run(engine, requests)
    assert outputs == [[e] for e in expected]
    assert most == 6
    counts = engine.cache.state_counts()
    assert counts["free"] + counts["cached"] == 12


def test_a_request_longer_than_the_cache_is_served_when_its_window_fits(mistral):
    """220 tokens need 14 blocks of a 12-block cache: without a window that could never finish
    (never_fits); with one it holds 6 at a time."""
    hf, loaded = mistral
    engine = Engine(loaded, EngineSettings(num_blocks=12, block_size=16, max_batch_tokens=32))
    request = engine.add_request(PROMPTS[0], SamplingParams(max_tokens=150, ignore_eos=True))
    outputs, _ = run(engine, [request])
    assert outputs == [[hf_greedy(hf, PROMPTS[0], 150)]]
    # a chunk budget so large that a window and one step's tokens pass the cache is refused by that
    wide = Engine(loaded, EngineSettings(num_blocks=12, block_size=16, max_batch_tokens=256))
    with pytest.raises(AdmissionRejected) as refused:
        wide.add_request(PROMPTS[0], SamplingParams(max_tokens=150, ignore_eos=True))
    assert refused.value.kind == "never_fits"


@pytest.fixture(scope="module")
def sliding_demo(tmp_path_factory):
    """The demo checkpoint as a Mistral whose layers slide a window of 24 tokens (as `kvctl bench
    window` makes it): its random weights make it loop, so prompt lookup drafts (the tiny
    transformers model's never repeat)."""
    from kvctl.bench_window import sliding_copy
    from kvctl.daemon.model.demo import ensure_demo_checkpoint

    source = ensure_demo_checkpoint(tmp_path_factory.mktemp("state"))
    return load_model(sliding_copy(source, tmp_path_factory.mktemp("sliding-demo"), 24))


def test_preemptions_n_and_drafts_under_a_window_give_the_same_tokens(sliding_demo):
    """A cache of 10 blocks with nothing reserved for output preempts; n = 2 forks a sequence whose
    first blocks are given back; prompt-lookup drafts are written past the window and taken back.
    Every sample is the token list a roomy cache without drafts gives."""
    prompts = [sliding_demo.tokenizer.encode(text) for text in (
        "Operators pin hot prefixes such as system prompts, and the window slides past them.",
        "def f(x):\n    return x + 1\n\ndef g(x):\n    return f(x) + f(x + 1)\n")]
    params = SamplingParams(max_tokens=60, ignore_eos=True, n=2)
    roomy = Engine(sliding_demo, EngineSettings(num_blocks=64, block_size=16, max_batch_tokens=32))
    plain, _ = run(roomy, [roomy.add_request(p, params) for p in prompts])
    engine = Engine(sliding_demo, EngineSettings(num_blocks=10, block_size=16, max_batch_tokens=32,
                                                 reservation="fixed:0",
                                                 speculation=NgramSpeculation(num_speculative_tokens=4)))
    requests = [engine.add_request(p, params) for p in prompts]
    outputs, _ = run(engine, requests)
    assert outputs == plain
    assert engine.stats.preemptions > 0
    assert sum(r.metrics.kept_draft_tokens for r in requests) > 0


def test_bench_window_serves_more_at_once_with_the_same_replies(capsys, tmp_path):
    """160-token sequences are 10 blocks whole and at most 6 under a window of 24 (chunks of 32):
    a 20-block cache runs two at once keeping every block, all four giving them back, each of
    which gives back 8 blocks (token 159's window starts in block 8)."""
    import json

    from .test_cli import cli

    status, out, _ = cli(capsys, "bench", "window", "--window", "24", "--requests", "4", "--prompt-tokens", "128",
                         "--max-tokens", "32", "--max-batch-tokens", "32", "--json")
    document = json.loads(out)
    keep, give = document["keep_every_block"], document["give_back"]
    assert status == 0 and document["identical_replies"] == 4
    assert document["settings"] == {"window": 24, "requests": 4, "prompt_tokens": 128, "max_tokens": 32,
                                    "num_blocks": 20, "block_size": 16, "max_batch_tokens": 32,
                                    "blocks_per_sequence_whole": 10, "blocks_per_sequence_window": 6}
    assert (keep["most_running"], give["most_running"]) == (2, 4)
    assert (keep["blocks_given_back"], give["blocks_given_back"]) == (0, 32)
    assert (keep["preemptions"], give["preemptions"]) == (0, 0)
    assert keep["output_tokens"] == give["output_tokens"] == 128 and give["steps"] < keep["steps"]
    assert keep["most_blocks_held"] <= 20 and give["most_blocks_held"] <= 20
    assert document["ratio"]["most_running"] == 2.0

    from rich.console import Console

    from kvctl.bench_window import render

    console = Console(record=True, width=120)
    render(document, console)
    text = " ".join(console.export_text().split())
    assert "4 requests of 128 + 32 tokens, window 24, 20 blocks of 16 (demo)" in text
    assert ("A sequence needs 10 blocks kept whole, at most 6 under its window; 32 blocks given back (they stay "
            "cached); replies identical: 4 of 4") in text

    from kvctl.daemon.model.demo import ensure_demo_checkpoint

    demo = ensure_demo_checkpoint(tmp_path)
    status, _, err = cli(capsys, "bench", "window", "--model", str(demo))
    assert status == 2 and err.strip() == (f"error: model: {str(demo)!r}: no layer slides a window; a layer that "
                                           "attends in full needs every block, so there is nothing to give back")
    status, _, err = cli(capsys, "bench", "window", "--num-blocks", "20")
    assert status == 2 and err.strip() == ("error: num_blocks: 20 cannot hold one whole sequence (48 blocks), which "
                                           "the pass that keeps every block needs")


def test_a_second_turn_hits_its_window_after_the_conversations_first_blocks_were_evicted(mistral):
    """Turn 1 gives its first blocks back as it goes; they are evicted. Turn 2 (turn 1, its reply
    and 6 more tokens) still takes the blocks its next token's window reaches and computes only
    the rest, with transformers' tokens."""
    from kvctl.daemon.cache.keys import chain_keys

    hf, loaded = mistral
    engine = Engine(loaded, EngineSettings(num_blocks=32, block_size=16, max_batch_tokens=32))
    first = engine.add_request(PROMPTS[0], SamplingParams(max_tokens=20, ignore_eos=True))
    run(engine, [first])
    conversation = PROMPTS[0] + first.sequences[0].output_ids + [7, 8, 9, 10, 11, 12]  # 96 tokens
    keys = chain_keys(engine.request_namespace(first), conversation)
    assert engine.cache.lookup(keys, 96) == 5  # blocks 0-4 cached (80 tokens); token 95 is always computed
    engine.cache.pool.evict_keys(keys[:3])
    assert engine.cache.pool.match(keys) == []
    second = engine.add_request(conversation, SamplingParams(max_tokens=10, ignore_eos=True))
    outputs, _ = run(engine, [second])
    assert second.metrics.cached_tokens == 80  # position 80 attends to 57..80: blocks 3 and 4
    assert outputs == [[hf_greedy(hf, conversation, 10)]]


@pytest.mark.parametrize("tier, pushed, restored", [("host", 1, 0), ("host", 2, 2), ("disk", 2, 2)])
def test_a_second_turn_takes_back_from_a_lower_tier_only_the_blocks_its_window_reaches(
        mistral, tmp_path, tier, pushed, restored):
    """Turn 1's blocks, pushed off an 8-block device by other requests (1: blocks 0-2; 2: blocks
    0-4), wait in host memory or on disk. Turn 2 fetches and restores none of the blocks before
    its next token's window: none at all while the device holds blocks 3 and 4, those two alone
    once they left it too. (It used to restore the conversation from its root: with blocks 3 and 4
    on the device that pushed them off again, and turn 2 hit 48 tokens instead of 80.) The tokens
    are transformers'."""
    from kvctl.daemon.cache.keys import chain_keys
    from kvctl.daemon.cache.tiers import build_tiers

    hf, loaded = mistral
    engine = Engine(loaded, EngineSettings(num_blocks=8, block_size=16, max_batch_tokens=32))
    below = {"host_bytes": 1 << 22} if tier == "host" else {"disk_bytes": 1 << 22, "disk_path": tmp_path / "disk"}
    tiers, _ = build_tiers(engine, tiering="always", **below)
    first = engine.add_request(PROMPTS[0], SamplingParams(max_tokens=20, ignore_eos=True))
    run(engine, [first])
    for prompt in PROMPTS[1:1 + pushed]:
        run(engine, [engine.add_request(prompt, SamplingParams(max_tokens=20, ignore_eos=True))])
    tiers.flush()
    conversation = PROMPTS[0] + first.sequences[0].output_ids + [7, 8, 9, 10, 11, 12]  # 96 tokens
    keys = chain_keys(engine.request_namespace(first), conversation)
    on_device = [engine.cache.pool.block_of(k) is not None for k in keys[:5]]
    assert on_device == [False] * 3 + [pushed == 1] * 2
    assert [tiers.location(k) for k in keys[:5]] == [tier] * 3 + ["evicted" if pushed == 1 else tier] * 2
    second = engine.add_request(conversation, SamplingParams(max_tokens=10, ignore_eos=True))
    outputs, _ = run(engine, [second])
    assert (second.metrics.cached_tokens, second.metrics.restored_tokens) == (80, restored * 16)
    fetched = engine.stats.prefetch_staged_blocks
    assert (tiers.stats["host"].restored_blocks, fetched) == ((restored, 0) if tier == "host" else (0, restored))
    assert [engine.cache.pool.block_of(k) for k in keys[:3]] == [None] * 3  # before the window: left below
    assert outputs == [[hf_greedy(hf, conversation, 10)]]
