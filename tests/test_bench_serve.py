"""kvctl bench serve and kvctl capacity: workloads, figures, a short run, hand-computed capacity."""

from __future__ import annotations

import asyncio
import json

import pytest

from kvctl.bench_figures import RequestRecord, figures, percentile, ratios
from kvctl.capacity import ModelShape, bytes_per_token, plan
from kvctl.daemon.replay.trace import TraceRequest, write_trace
from kvctl.workloads import from_trace, hash_block_tokens, multi_turn, shared_prefix

from .test_cli import cli


async def drive_over_socket(app, tmp_path, work, concurrency: int, api: str | None = None,
                            replies: str = "synthetic"):
    """`work` sent to `app` served on a real Unix socket, by the bench's own HTTP client."""
    import aiohttp
    import uvicorn

    from kvctl.bench_serve import drive_kvd

    path = str(tmp_path / "bench.sock")
    server = uvicorn.Server(uvicorn.Config(app, uds=path, log_level="warning", lifespan="off"))
    serving = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    try:
        async with aiohttp.ClientSession(base_url="http://kvd", connector=aiohttp.UnixConnector(path=path)) as session:
            return await drive_kvd(session, work, concurrency=concurrency, rate=None, seed=0, api=api,
                                   replies=replies)
    finally:
        server.should_exit = True
        await serving


def test_shared_prefix_shapes():
    work = shared_prefix(groups=3, system_tokens=40, questions=5, question_tokens=7, max_tokens=9)
    assert len(work) == 15 and all(len(r.prompt) == 47 and r.max_tokens == 9 for r in work)
    by_group = {}
    for r in work:
        by_group.setdefault(r.group, []).append(r.prompt)
    assert len(by_group) == 3
    for prompts in by_group.values():
        assert len({tuple(p[:40]) for p in prompts}) == 1  # one system prompt per group
        assert len({tuple(p[40:]) for p in prompts}) == 5  # distinct questions
    assert [r.group for r in work[:3]] == ["group-0", "group-1", "group-2"]  # first of each group first


def test_multi_turn_extends_the_previous_turn():
    work = multi_turn(conversations=2, turns=3, user_tokens=5, reply_tokens=4)
    first, second, third = work[:3]
    assert (len(first.prompt), len(second.prompt), len(third.prompt)) == (5, 14, 23)
    assert second.prompt[:5] == first.prompt and third.prompt[:14] == second.prompt
    assert (first.after, second.after, third.after) == (None, 0, 1)
    assert work[3].after is None and work[3].group == "conversation-1"


def test_chat_workloads_have_the_same_shapes_as_messages_of_text():
    from kvctl.workloads import as_text

    tokens = shared_prefix(groups=3, system_tokens=40, questions=5, question_tokens=7, max_tokens=9)
    chats = shared_prefix(groups=3, system_tokens=40, questions=5, question_tokens=7, max_tokens=9, chat=True)
    assert [(c.group, c.max_tokens, c.prompt) for c in chats] == [(t.group, 9, []) for t in tokens]
    for chat, plain in zip(chats, tokens):
        assert chat.messages == [{"role": "system", "content": as_text(plain.prompt[:40])},
                                 {"role": "user", "content": as_text(plain.prompt[40:])}]
    assert len(chats[0].messages[0]["content"]) == 40 and len(chats[0].messages[1]["content"]) == 7
    assert as_text([0, 1, 2, 3, 4, 5, 6, 27]) == "abcdef b"  # a space after every sixth letter
    turns = multi_turn(conversations=2, turns=3, user_tokens=5, reply_tokens=4, chat=True)
    first, second, third = turns[:3]
    assert [m["role"] for m in third.messages] == ["user", "assistant", "user", "assistant", "user"]
    assert third.messages[:3] == second.messages and second.messages[:1] == first.messages
    assert [len(m["content"]) for m in third.messages] == [5, 4, 5, 4, 5]
    assert (first.after, second.after, third.after, turns[3].after) == (None, 0, 1, None)


def test_a_chat_bench_run_against_kvd_and_its_baseline_render_the_same_prompts(tmp_path):
    """The chat workload through /v1/chat/completions: the system prompt's blocks are shared within
    a group, and transformers' baseline renders each chat into the prompt kvd served."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from kvctl.bench_serve import run_transformers_baseline

    from .daemon_fixtures import apps, blocks_all_back, start_service, token_table

    service = start_service(tmp_path, num_blocks=128)
    try:
        unix, _ = apps(service, token_table(tmp_path))
        work = shared_prefix(groups=2, system_tokens=64, questions=2, question_tokens=8, max_tokens=3, chat=True)

        records = asyncio.run(drive_over_socket(unix, tmp_path, work, concurrency=1))
        assert [r.status for r in records] == ["ok"] * 4
        rendered = [service.chat_prompt(r.messages) for r in work]
        assert [r.prompt_tokens for r in records] == [len(ids) for ids in rendered]
        # the second question of each group hits its system prompt's whole blocks
        shared = next(i for i, (a, b) in enumerate(zip(rendered[0], rendered[2])) if a != b) // 16 * 16
        assert [r.cached_tokens for r in records] == [0, 0, shared, shared] and shared >= 64
        model = service.status()["model"]
        base = run_transformers_baseline(model["path"], work, batch=2, device=model["device"], dtype=model["dtype"])
        assert [r.prompt_tokens for r in base] == [len(ids) for ids in rendered]
        assert blocks_all_back(service)
    finally:
        service.shutdown(1)


def test_a_trace_is_not_a_chat(capsys):
    status, _, err = cli(capsys, "bench", "serve", "--workload", "trace:/nowhere.jsonl", "--api", "chat")
    assert status == 2 and "api: a trace's prompts are token ids; drive it with --api completions" in err
    status, _, err = cli(capsys, "bench", "serve", "--api", "grpc")
    assert status == 2 and "api: unknown value 'grpc'; use completions, chat, responses or conversations" in err
    status, _, err = cli(capsys, "bench", "serve", "--workload", "trace:/nowhere.jsonl", "--api", "responses")
    assert status == 2 and "api: a trace's prompts are token ids; drive it with --api completions" in err


def test_trace_prompts_share_exactly_the_tokens_their_hash_ids_say(tmp_path):
    path = tmp_path / "t.jsonl"
    write_trace(path, [TraceRequest(0.0, 1024, 5, (7, 8)), TraceRequest(500.0, 1300, 9, (7, 8, 9)),
                       TraceRequest(900.0, 600, 3, (7, 11))])
    a, b, c = from_trace(str(path), time_scale=2.0, block_tokens=16)
    assert (len(a.prompt), len(b.prompt), len(c.prompt)) == (32, 41, 19)
    assert b.prompt[:32] == a.prompt  # same ids 7, 8: same tokens
    assert c.prompt[:16] == a.prompt[:16] and c.prompt[16:19] != a.prompt[16:19]
    assert a.prompt[:16] == hash_block_tokens(7, 16, 256)
    assert (a.arrival, b.arrival, c.arrival) == (0.0, 1.0, 1.8)
    assert (a.max_tokens, b.max_tokens) == (5, 9)


def test_percentiles_and_figures_on_a_synthetic_latency_set():
    assert percentile([5, 1, 4, 2, 3], 0.5) == 3
    assert percentile(list(range(1, 101)), 0.95) == 95 and percentile(list(range(1, 101)), 0.99) == 99
    records = [
        RequestRecord(0, start=0.0, prompt_tokens=100, cached_tokens=0, token_times=[1.0, 1.5, 2.0], end=2.0),
        RequestRecord(1, start=0.0, prompt_tokens=100, cached_tokens=80, token_times=[0.2, 0.4, 0.6], end=0.6),
        RequestRecord(2, start=1.0, prompt_tokens=100, cached_tokens=80, token_times=[1.2, 1.4, 1.6], end=1.6),
        RequestRecord(3, start=1.0, status="rejected"),
    ]
    f = figures(records)
    assert (f["completed"], f["rejections"], f["output_tokens"]) == (3, 1, 9)
    assert f["seconds"] == 2.0 and f["output_tokens_per_second"] == 4.5
    assert f["ttft_p50_s"] == pytest.approx(0.2) and f["ttft_p95_s"] == pytest.approx(1.0)
    assert f["itl_p50_s"] == pytest.approx(0.2) and f["e2e_p95_s"] == pytest.approx(2.0)
    assert f["cached_token_ratio"] == pytest.approx(160 / 300)
    assert f["ttft_cached_over_uncached"] == pytest.approx(0.2 / 1.0)
    assert ratios(f, {**f, "output_tokens_per_second": 1.5})["output_tokens_per_second"] == 3.0
    # the report shows a ratio for every figure, the tails as well as the medians; not for the counts
    assert set(ratios(f, f)) == {name for name in f if name.endswith("_s") or "ratio" in name or "over" in name
                                 or name.endswith("_per_second")}
    # a kvd that reports cached_tokens to admins only (report_cached_tokens: admin), benched as a user:
    # the cache's figures are not known, rather than a ratio of 0
    records[1].cached_tokens = None
    hidden = figures(records)
    assert (hidden["cached_token_ratio"], hidden["ttft_cached_over_uncached"]) == (None, None)
    assert hidden["output_tokens_per_second"] == 4.5


def test_figures_across_repeated_runs_are_medians_with_their_range():
    from kvctl.bench_figures import across_runs

    runs = [{"output_tokens_per_second": 1800.0, "ttft_cached_over_uncached": 0.25, "aborts": 0},
            {"output_tokens_per_second": 1200.0, "ttft_cached_over_uncached": None, "aborts": 0},
            {"output_tokens_per_second": 2100.0, "ttft_cached_over_uncached": 0.19, "aborts": 1},
            {"output_tokens_per_second": 1500.0, "ttft_cached_over_uncached": 0.21, "aborts": 0}]
    middle, spread = across_runs(runs)
    assert middle == {"output_tokens_per_second": 1650.0, "ttft_cached_over_uncached": 0.21, "aborts": 0.0}
    assert spread == {"output_tokens_per_second": [1200.0, 2100.0], "ttft_cached_over_uncached": [0.19, 0.25],
                      "aborts": [0, 1]}
    assert across_runs([None, None]) == (None, None)  # no baseline in any run
    middle, spread = across_runs([{"ttft_cached_over_uncached": None}])
    assert middle == {"ttft_cached_over_uncached": None} and spread == {}


def test_bench_serve_refuses_a_repeat_below_one(capsys, tmp_path):
    status, _, err = cli(capsys, "bench", "serve", "--repeat", "0")
    assert status == 2 and "repeat: must be >= 1, got 0" in err


@pytest.mark.parametrize("value", ["0", "-3"])
def test_bench_serve_refuses_requests_below_one_instead_of_running_the_default(capsys, value):
    status, _, err = cli(capsys, "bench", "serve", "--requests", value)  # it ran 32 requests for 0
    assert status == 2 and err.strip() == f"error: requests: must be >= 1, got {value}"


@pytest.mark.parametrize("flag,value", [("--groups", "0"), ("--system-tokens", "-1"), ("--question-tokens", "0")])
def test_bench_serve_names_the_shared_prefix_size_it_refuses(capsys, flag, value):
    status, _, err = cli(capsys, "bench", "serve", flag, value)
    name = flag[2:].replace("-", "_")
    assert status == 2 and err.strip() == f"error: {name}: must be >= 1, got {value}"


def test_bench_workloads_make_exactly_the_requests_asked_for():
    from kvctl.bench_serve import build_workload

    def build(spec, requests, **sizes):
        return build_workload(spec, requests=requests, max_tokens=4, time_scale=1.0, seed=0, block_tokens=16,
                              system_tokens=8, question_tokens=2, **sizes)

    thirty = build("shared-prefix", 30)  # 30 over 4 groups: it made 28 (7 questions each)
    assert len(thirty) == 30
    assert [sum(r.group == f"group-{g}" for r in thirty) for g in range(4)] == [8, 8, 7, 7]
    assert [r.prompt for r in thirty] == [r.prompt for r in build("shared-prefix", 32)[:30]]
    assert [r.group for r in build("shared-prefix", 2)] == ["group-0", "group-1"]  # it made 4
    assert len(build("shared-prefix", None)) == 32 and len(build("shared-prefix", 5, groups=5)) == 5
    ten = build("multi-turn", 10)  # it made 8: two conversations of 4 turns
    assert [(r.group, r.after) for r in ten[8:]] == [("conversation-2", None), ("conversation-2", 8)]
    assert len(ten) == 10 and len(build("multi-turn", 3)) == 3 and len(build("multi-turn", None)) == 16


def test_engine_figures_from_two_status_reports():
    from kvctl.bench_figures import engine_figures

    before = {"steps": {"decode": {"count": 10, "seconds": 0.02}, "prefill": {"count": 2, "seconds": 0.05}}}
    after = {"steps": {"decode": {"count": 110, "seconds": 0.32}, "mixed": {"count": 4, "seconds": 0.04},
                       "prefill": {"count": 2, "seconds": 0.05}}}
    got = engine_figures(before, after, wall_seconds=0.5)
    assert got["steps"] == {"decode": 100, "mixed": 4, "prefill": 0}
    assert got["busy_fraction"] == pytest.approx((0.30 + 0.04) / 0.5)
    assert got["decode_step_mean_s"] == pytest.approx(0.003)
    assert got["threads"] is None and got["cpus_shared_fraction"] is None  # a GPU daemon: no CPU share
    assert engine_figures({}, after, 0.5) is None  # a daemon that does not report steps
    shared_before = {**before, "cpu_share": {"looks": 10, "shared_looks": 2}}
    shared_after = {**after, "engine_threads": 1, "cpu_share": {"looks": 14, "shared_looks": 5}}
    got = engine_figures(shared_before, shared_after, wall_seconds=0.5)
    assert got["threads"] == 1 and got["cpus_shared_fraction"] == pytest.approx(3 / 4)
    assert engine_figures(shared_after, shared_after, 0.5)["cpus_shared_fraction"] is None  # no look in the run
    assert engine_figures(after, after, 0.5)["decode_step_mean_s"] is None  # no decode step in the run


def test_compare_says_when_two_runs_are_not_like_for_like():
    from kvctl.bench_serve import comparability_notes

    settings = {"requests": 32, "max_tokens": 32, "seed": 0, "system_tokens": 1024, "repeat": 1}
    stored = {"settings": settings, "model": {"revision": "a" * 64}, "kvd": {"cached_token_ratio": 0.85}}
    same = {"settings": {**settings, "repeat": 5}, "model": {"revision": "a" * 64}, "kvd": {"cached_token_ratio": 0.87}}
    assert comparability_notes(same, stored) == []  # --repeat and a ratio within 0.05 change nothing
    warm = {"settings": {**settings, "max_tokens": 16}, "model": {"revision": "b" * 64},
            "kvd": {"cached_token_ratio": 0.98}}
    assert comparability_notes(warm, stored) == [
        "workload settings differ: max_tokens 32 -> 16",
        f"model revision differs: {'a' * 12} -> {'b' * 12}",
        "the cache was warmer this time (cached-token ratio 0.850 -> 0.980): the prompts' prefixes were cached "
        "before the run; compare runs on a freshly started kvd, or with another --seed"]
    cold = {**same, "kvd": {"cached_token_ratio": 0.5}}
    assert "colder this time (cached-token ratio 0.850 -> 0.500): the prompts' prefixes were not cached" \
        in comparability_notes(cold, stored)[0]


def test_the_report_says_a_trace_s_output_lengths_are_capped_not_fixed(capsys):
    from kvctl.bench_serve import _print_report

    for workload, title, replies in (("trace:t.jsonl", "16 requests, up to 32 tokens each", "synthetic"),
                                     ("shared-prefix", "16 requests, 32 tokens each", "synthetic"),
                                     ("multi-turn", "16 requests, 32 tokens each, model replies", "model")):
        document = {"workload": workload, "settings": {"requests": 16, "max_tokens": 32, "replies": replies},
                    "kvd": {}, "baseline": None, "ratio": {}}
        _print_report(document, None)
        assert capsys.readouterr().out.splitlines()[0] == f"bench serve: {workload}, {title}"  # one line


def test_the_report_shows_counts_as_counts_and_a_ratio_beside_every_figure(capsys, monkeypatch):
    from kvctl.bench_serve import _print_report

    monkeypatch.setenv("COLUMNS", "100")
    kvd = {"output_tokens_per_second": 300.0, "ttft_p99_s": 0.5, "e2e_p50_s": 1.0, "rejections": 2, "aborts": 0.5}
    base = {"output_tokens_per_second": 100.0, "ttft_p99_s": 1.0, "e2e_p50_s": 4.0, "rejections": 0, "aborts": 0}
    _print_report({"workload": "shared-prefix", "settings": {"requests": 4, "max_tokens": 8}, "kvd": kvd,
                   "baseline": base, "ratio": ratios(kvd, base)}, None)
    rows = {line.split("│")[1].strip(): [cell.strip() for cell in line.split("│")[2:-1]]
            for line in capsys.readouterr().out.splitlines() if line.startswith("│")}
    assert rows["output_tokens_per_second"] == ["300.00", "100.00", "3.00x"]
    assert rows["ttft_p99_s"] == ["500.0 ms", "1000.0 ms", "0.50x"]
    assert rows["e2e_p50_s"] == ["1000.0 ms", "4000.0 ms", "0.25x"]
    assert rows["rejections"] == ["2", "0", "-"] and rows["aborts"] == ["0.5", "0", "-"]


def test_capacity_matches_hand_computed_llama3_figures():
    llama8b = ModelShape(layers=32, kv_heads=8, head_dim=128)
    llama70b = ModelShape(layers=80, kv_heads=8, head_dim=128)
    assert bytes_per_token(llama8b, "bfloat16") == 2 * 32 * 8 * 128 * 2 == 131_072
    assert bytes_per_token(llama8b, "fp8_e4m3") == 65_536
    assert bytes_per_token(llama70b, "bfloat16") == 327_680
    assert bytes_per_token(llama8b, "int8-token") == 2 * 32 * 8 * (128 + 4)
    h200 = 141 * 10**9
    row = plan(llama8b, gpu_memory=h200, cache_dtype="bfloat16", block_size=16, context=8192, reserve=0.1,
               workspace=2**30, weights_bytes=16 * 10**9)
    budget = h200 - 16 * 10**9 - 2**30 - int(0.1 * h200)
    assert row["cache_bytes"] == budget
    assert row["blocks"] == budget // (131_072 * 16)
    assert row["sequences_at_context"] == row["blocks"] // 512
    row70 = plan(llama70b, gpu_memory=2 * h200, cache_dtype="fp8_e4m3", block_size=16, context=32768,
                 reserve=0.1, workspace=2**30, weights_bytes=140 * 10**9)
    assert row70["blocks"] == (2 * h200 - 140 * 10**9 - 2**30 - int(0.2 * h200)) // (163_840 * 16)


def test_capacity_of_a_model_whose_every_layer_slides_counts_its_windows_blocks(capsys, tmp_path):
    """Mistral 7B v0.1: 32 layers of 8 KV heads of 128, every one sliding a 4,096-token window. A
    32k-token sequence holds at most ceil((4,095 + 256) / 16) + 2 = 274 blocks as kvd keeps it, not
    2,048; a model with one full-attention layer keeps every block."""
    mistral = ModelShape(layers=32, kv_heads=8, head_dim=128, sliding_window=4096)
    h200 = 141 * 10**9
    row = plan(mistral, gpu_memory=h200, cache_dtype="bfloat16", block_size=16, context=32768, reserve=0.1,
               workspace=2**30, weights_bytes=14_483_464_192)
    assert row["sequences_at_context"] == row["blocks"] // 274
    assert plan(mistral, gpu_memory=h200, cache_dtype="bfloat16", block_size=16, context=2048, workspace=2**30,
                weights_bytes=0)["sequences_at_context"] == (h200 - 2**30 - int(0.1 * h200)) // 2**21 // 128
    config = {"architectures": ["MistralForCausalLM"], "vocab_size": 32000, "hidden_size": 4096,
              "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
              "num_key_value_heads": 8, "sliding_window": 4096, "max_position_embeddings": 32768}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert ModelShape.from_model_dir(tmp_path).sliding_window == 4096
    status, out, _ = cli(capsys, "capacity", "--model", str(tmp_path), "--gpu-memory", "141GB", "--weights-bytes",
                         "14483464192", "--workspace", "1GiB", "--context", "32768", "--dtype", "bfloat16", "--json")
    document = json.loads(out)
    assert status == 0 and document["sliding_window"] == {"tokens": 4096, "batch_tokens": 256,
                                                          "blocks_per_sequence": 274,
                                                          "blocks_per_sequence_without": 2048}
    assert document["rows"][0]["sequences_at_context"] == row["sequences_at_context"]
    status, out, _ = cli(capsys, "capacity", "--layers", "32", "--kv-heads", "8", "--head-dim", "128",
                         "--sliding-window", "4096", "--batch-tokens", "2048", "--gpu-memory", "141GB",
                         "--context", "32768", "--dtype", "bfloat16")
    assert status == 0 and ("Every layer slides a window of 4,096 tokens: a sequence of 32,768 tokens holds at "
                            "most 386 blocks at once (its window and 2,048 batch tokens), not 2,048.") in " ".join(
        out.split())
    mixed = {**config, "architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True, "max_window_layers": 16}
    (tmp_path / "config.json").write_text(json.dumps(mixed))
    mixed_shape = ModelShape.from_model_dir(tmp_path)  # 16 full-attention layers keep every block
    assert (mixed_shape.sliding_window, mixed_shape.mixed_window) == (None, (4096, 16))
    status, _, err = cli(capsys, "capacity", "--layers", "32", "--kv-heads", "8", "--head-dim", "128",
                         "--sliding-window", "0", "--gpu-memory", "141GB")
    assert status == 2 and err.strip() == "error: sliding_window: must be a whole number of at least 1, got 0"


def test_capacity_takes_lora_adapters_out_of_the_cache_at_what_kvd_holds_of_each(capsys, tmp_path):
    """Llama-3-8B, rank 16 on every projection: per layer 16 x (7 x 4096 + 4 x 4096 + 6 x 1024 +
    5 x 14336) bf16 values as kvd packs them (B block-diagonal: 1.5x PEFT's 80 MiB file)."""
    from kvctl.capacity import lora_bytes
    from kvctl.daemon.model.demo import ensure_demo_checkpoint

    llama8b = ModelShape(layers=32, kv_heads=8, head_dim=128, hidden_size=4096, intermediate_size=14336, heads=32)
    assert lora_bytes(llama8b, 16) == 32 * 16 * (7 * 4096 + 4 * 4096 + 6 * 1024 + 5 * 14336) * 2 == 125_829_120
    h200 = 141 * 10**9
    row = plan(llama8b, gpu_memory=h200, cache_dtype="bfloat16", block_size=16, context=8192, reserve=0.1,
               workspace=2**30, weights_bytes=16 * 10**9, lora_bytes=8 * 125_829_120)
    assert row["cache_bytes"] == h200 - 16 * 10**9 - 8 * 125_829_120 - 2**30 - int(0.1 * h200)
    assert row["lora_bytes"] == 8 * 125_829_120
    with pytest.raises(ValueError, match=r"^lora_rank: needs the model's hidden_size"):
        lora_bytes(ModelShape(layers=32, kv_heads=8, head_dim=128), 16)

    demo = ensure_demo_checkpoint(tmp_path)
    status, out, _ = cli(capsys, "capacity", "--model", str(demo), "--gpu-memory", "1GiB", "--workspace", "0",
                         "--loras", "3", "--lora-rank", "4", "--dtype", "float32", "--json")
    document = json.loads(out)
    each = lora_bytes(ModelShape.from_model_dir(demo), 4)
    assert status == 0 and document["loras"] == {"count": 3, "rank": 4, "bytes_each": each}
    [row] = document["rows"]
    assert row["lora_bytes"] == 3 * each
    assert row["cache_bytes"] == 2**30 - row["weights_bytes"] - 3 * each - int(0.1 * 2**30)
    status, _, err = cli(capsys, "capacity", "--model", str(demo), "--gpu-memory", "1GiB", "--loras", "3")
    assert status == 2 and err.strip() == "error: loras: give --loras N with --lora-rank R (both or neither)"
    status, _, err = cli(capsys, "capacity", "--layers", "2", "--kv-heads", "1", "--head-dim", "64",
                         "--gpu-memory", "1GiB", "--loras", "1", "--lora-rank", "8")
    assert status == 2 and err.strip() == ("error: lora_rank: needs the model's hidden_size, intermediate_size "
                                           "and attention heads (--model DIR)")


def test_capacity_command_compares_dtypes(capsys, tmp_path):
    status, out, _ = cli(capsys, "capacity", "--layers", "32", "--kv-heads", "8", "--head-dim", "128",
                         "--gpu-memory", "141GB", "--weights-bytes", "16GB", "--workspace", "1GiB",
                         "--dtype", "bfloat16,fp8_e4m3", "--json")
    assert status == 0
    rows = json.loads(out)["rows"]
    assert [r["cache_dtype"] for r in rows] == ["bfloat16", "fp8_e4m3"]
    budget = 141 * 10**9 - 16 * 10**9 - 2**30 - int(0.1 * 141 * 10**9)
    assert [r["blocks"] for r in rows] == [budget // (131_072 * 16), budget // (65_536 * 16)]
    status, out, _ = cli(capsys, "capacity", "--layers", "32", "--kv-heads", "8", "--head-dim", "128",
                         "--gpu-memory", "141GB", "--weights-bytes", "16GB", "--workspace", "1GiB",
                         "--dtype", "fp8", "--json")  # vLLM's name for fp8_e4m3
    assert status == 0 and [r["cache_dtype"] for r in json.loads(out)["rows"]] == ["fp8_e4m3"]
    status, _, err = cli(capsys, "capacity", "--layers", "32", "--gpu-memory", "1GB")
    assert status == 2 and "give --model DIR, or --layers, --kv-heads and --head-dim" in err
    status, _, err = cli(capsys, "capacity", "--layers", "2", "--kv-heads", "1", "--head-dim", "64",
                         "--gpu-memory", "lots")
    assert status == 2 and "gpu_memory: invalid size 'lots'" in err


def test_capacity_compares_the_model_s_own_dtype_first_as_kvd_would_hold_it(capsys, tmp_path):
    """With --model and no --dtype the table began with bfloat16 for a float32 or float16 checkpoint."""
    from kvctl.daemon.model.demo import ensure_demo_checkpoint

    demo = ensure_demo_checkpoint(tmp_path)  # a float32 checkpoint
    status, out, _ = cli(capsys, "capacity", "--model", str(demo), "--gpu-memory", "1GiB", "--json")
    rows = json.loads(out)["rows"]
    assert status == 0 and [r["cache_dtype"] for r in rows] == ["float32", "fp8_e4m3", "int8"]
    assert rows[0]["bytes_per_token"] == 2 * 2 * 1 * 64 * 4  # layers, KV heads, head dim of the demo
    status, out, _ = cli(capsys, "capacity", "--layers", "32", "--kv-heads", "8", "--head-dim", "128",
                         "--gpu-memory", "141GB", "--json")  # no model: bfloat16, as most checkpoints are
    assert [r["cache_dtype"] for r in json.loads(out)["rows"]] == ["bfloat16", "fp8_e4m3", "int8"]


def test_capacity_of_a_lower_tier_matches_the_payloads_kvd_writes(capsys):
    torch = pytest.importorskip("torch")
    from kvctl.capacity import tier_plan
    from kvctl.daemon.cache.tiers import BlockLayout

    llama8b = ModelShape(layers=32, kv_heads=8, head_dim=128)
    layout = BlockLayout((torch.bfloat16,) * 32, 16, 8, 128, "")
    t = tier_plan(llama8b, tier_bytes=512 * 2**30, cache_dtype="bfloat16", block_size=16)
    assert (t["block_bytes"], t["compressed_block_bytes"]) == (layout.stored_bytes("none"), layout.stored_bytes("int8"))
    assert t["blocks"] == 512 * 2**30 // layout.stored_bytes("none") and t["tokens"] == t["blocks"] * 16
    assert t["compressed_tokens"] == 512 * 2**30 // layout.stored_bytes("int8") * 16
    quantised = tier_plan(llama8b, tier_bytes=2**30, cache_dtype="fp8_e4m3", block_size=16)
    fp8 = BlockLayout((torch.float8_e4m3fn,) * 32, 16, 8, 128, "")
    assert quantised["block_bytes"] == fp8.stored_bytes("none") and quantised["compressed_tokens"] is None
    status, out, _ = cli(capsys, "capacity", "--layers", "32", "--kv-heads", "8", "--head-dim", "128",
                         "--gpu-memory", "141GB", "--weights-bytes", "16GB", "--dtype", "bfloat16,int8",
                         "--tier-bytes", "512GiB")
    text = " ".join(out.split())
    assert status == 0
    assert (f"a lower tier of 512.0 GiB holds {t['tokens']:,} tokens of bfloat16 stored whole, "
            f"{t['compressed_tokens']:,} compressed (tier_compress int8 or fp8_e4m3: "
            f"{t['compressed_block_bytes']:,} bytes a block against {t['block_bytes']:,})") in text
    assert text.endswith(f"a lower tier of 512.0 GiB holds {512 * 2**30 // (65_536 * 16 + 268) * 16:,} tokens of int8")  # header 218 + 32 + 2 + 8, checksum 8
    status, _, err = cli(capsys, "capacity", "--layers", "32", "--kv-heads", "8", "--head-dim", "128",
                         "--gpu-memory", "141GB", "--tier-bytes", "0")
    assert status == 2 and "tier_bytes: must be at least 1, got 0" in err


@pytest.mark.parametrize("flags, message", [
    (["--layers", "0"], "error: layers: must be a whole number of at least 1, got 0"),
    (["--kv-heads", "-8"], "error: kv_heads: must be a whole number of at least 1, got -8"),
    (["--block-size", "0"], "error: block_size: must be at least 1, got 0"),
    (["--context", "0"], "error: context: must be at least 1, got 0"),
    (["--weights-bytes", "-5"], "error: weights_bytes: must not be negative, got -5"),
    (["--reserve", "1.5"], "error: reserve: must be in [0, 1), got 1.5"),
])
def test_capacity_refuses_impossible_shapes_and_budgets_by_name(capsys, flags, message):
    shape = {"--layers": "32", "--kv-heads": "8", "--head-dim": "128"}
    shape.update(zip(flags[::2], flags[1::2]))
    status, out, err = cli(capsys, "capacity", *[x for pair in shape.items() for x in pair], "--gpu-memory", "80GiB")
    assert status == 2 and err.strip() == message and out == ""


def test_capacity_says_when_nothing_is_left_for_the_cache(capsys):
    args = ["capacity", "--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--gpu-memory", "80GiB",
            "--weights-bytes", "90GiB", "--workspace", "1GiB", "--reserve", "0.1"]
    status, out, _ = cli(capsys, *args, "--json")
    rows = json.loads(out)["rows"]
    shortfall = 90 * 2**30 + 2**30 + int(0.1 * 80 * 2**30) - 80 * 2**30
    assert status == 0 and [(r["blocks"], r["shortfall_bytes"]) for r in rows] == [(0, shortfall)] * 3
    status, out, _ = cli(capsys, *args)
    assert status == 0 and "exceed the GPU's memory by 19.0 GiB" in " ".join(out.split())
    ok = plan(ModelShape(layers=32, kv_heads=8, head_dim=128), gpu_memory=80 * 2**30, cache_dtype="int8",
              block_size=16, context=8192, workspace=0, weights_bytes=0)
    assert ok["shortfall_bytes"] == 0 and ok["blocks"] > 0


def test_a_short_bench_run_against_an_in_process_daemon(tmp_path):
    pytest.importorskip("transformers")
    from kvctl.bench_figures import engine_figures
    from kvctl.bench_serve import run_transformers_baseline

    from .daemon_fixtures import apps, blocks_all_back, start_service, token_table

    service = start_service(tmp_path, num_blocks=128)
    try:
        unix, _ = apps(service, token_table(tmp_path))
        work = shared_prefix(groups=2, system_tokens=64, questions=3, question_tokens=8, max_tokens=4)

        before = service.status()
        records = asyncio.run(drive_over_socket(unix, tmp_path, work, concurrency=2))
        engine = engine_figures(before, service.status(), 1.0)
        # six requests of four tokens, two at a time: at least nine steps that decode
        assert engine["steps"].get("decode", 0) + engine["steps"].get("mixed", 0) >= 9
        assert [r.status for r in records] == ["ok"] * 6
        assert all(len(r.token_times) == 4 for r in records)
        assert [r.cached_tokens for r in records] == [0, 0, 64, 64, 64, 64]
        kvd = figures(records)
        assert kvd["cached_token_ratio"] == pytest.approx(4 * 64 / (6 * 72))
        assert kvd["ttft_cached_over_uncached"] is not None
        from kvctl.bench_figures import served_figures

        from .daemon_fixtures import call

        lines = call(unix, "GET", "/admin/trace", params={"last": 6}).json()["requests"]
        assert [line["served"]["cached_tokens"] for line in lines] == [0, 0, 64, 64, 64, 64]
        kvd_side = served_figures(lines)  # what bench serve prints as kvd's own timings
        assert kvd_side["requests"] == 6 and 0 < kvd_side["prefill_cached_over_uncached"]
        model = service.status()["model"]  # the baseline runs where kvd's model runs, in its dtype
        assert (model["device"], model["dtype"]) == (str(service.loaded.model.device), str(service.loaded.model.dtype))
        base = run_transformers_baseline(model["path"], work, batch=2, device=model["device"], dtype=model["dtype"])
        assert [len(r.token_times) for r in base] == [4] * 6 and figures(base)["cached_token_ratio"] == 0.0
        assert blocks_all_back(service)
    finally:
        service.shutdown(1)


def test_the_bench_client_keeps_the_url_path_and_sends_the_bearer_token(tmp_path):
    """Over TCP (`--url` with a proxy's path prefix and `--token-file`), the load generator posts
    to PREFIX/v1/completions with the token, and reads the stream it gets back, however long
    its event lines."""
    from aiohttp import web

    from kvctl.bench_serve import drive_kvd
    from kvctl.client import Client

    seen = []

    async def completions(request):
        seen.append((request.path, request.headers.get("Authorization")))
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        long_text = "x" * 200_000  # one event line of 200 kB (a stream that fell behind sends long ones)
        for token in (7, 8):
            await response.write(f'data: {{"choices": [{{"index": 0, "text": "{long_text}", '
                                 f'"token_ids": [{token}]}}]}}\n\n'.encode())
        await response.write(b'data: {"choices": [], "usage": {"prompt_tokens_details": {"cached_tokens": 3}}}\n\n')
        await response.write(b"data: [DONE]\n\n")
        return response

    token_file = tmp_path / "token"
    token_file.write_text("secret-token\n")

    async def run():
        app = web.Application()
        app.router.add_post("/proxy/kvd/v1/completions", completions)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        try:
            client = Client(url=f"http://127.0.0.1:{port}/proxy/kvd", token_file=str(token_file))
            async with client.async_session() as session:
                return await drive_kvd(session, shared_prefix(groups=1, system_tokens=4, questions=2,
                                                              question_tokens=2, max_tokens=2),
                                       concurrency=1, rate=None, seed=0)
        finally:
            await runner.cleanup()

    records = asyncio.run(run())
    assert seen == [("/proxy/kvd/v1/completions", "Bearer secret-token")] * 2
    assert [(r.status, len(r.token_times), r.cached_tokens) for r in records] == [("ok", 2, 3)] * 2


def test_the_engine_loop_runs_the_bench_workload_in_process_to_the_last_token():
    """scripts/engine-loop (the engine's own speed, without the serving path): every one of the
    32 requests gets its 32 tokens, pass after pass, in both arrival patterns."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("torch")
    script = Path(__file__).resolve().parents[1] / "scripts" / "engine-loop"
    for pattern in ([], ["--lockstep"]):
        done = subprocess.run([sys.executable, str(script), "--system-tokens", "40", "--passes", "2", *pattern],
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        lines = done.stdout.splitlines()
        assert lines[0].startswith(f"system tokens 40, {'lockstep' if pattern else 'staggered'} arrivals, ")
        assert lines[0].endswith(", quick prefill 64 tokens")  # kvd's default on a CPU
        passes = [re.match(r"pass (\d) \((cold|warm)\): ([\d,]+) tokens, ", line) for line in lines[1:]]
        assert [(m[1], m[2], m[3]) for m in passes] == [("0", "cold", "1,024"), ("1", "cold", "1,024")]


def test_a_bench_sent_as_a_tenant_is_that_tenant_s_traffic(tmp_path):
    """`kvctl bench serve --tenant acme`: the bench's own client, made from kvctl's, sends as acme."""
    import uvicorn

    from kvctl.bench_serve import drive_kvd
    from kvctl.client import Client

    from .daemon_fixtures import apps, start_service, token_table

    service = start_service(tmp_path, num_blocks=128)
    try:
        unix, _ = apps(service, token_table(tmp_path))
        work = shared_prefix(groups=1, system_tokens=32, questions=2, question_tokens=8, max_tokens=2)
        path = str(tmp_path / "bench.sock")

        async def go():
            server = uvicorn.Server(uvicorn.Config(unix, uds=path, log_level="warning", lifespan="off"))
            serving = asyncio.create_task(server.serve())
            while not server.started:
                await asyncio.sleep(0.01)
            try:
                async with Client(path, tenant="acme").async_session() as session:
                    return await drive_kvd(session, work, concurrency=1, rate=None, seed=0)
            finally:
                server.should_exit = True
                await serving

        records = asyncio.run(go())
        assert [r.status for r in records] == ["ok", "ok"]
        rows = {row["tenant"]: row for row in service_tenants(service)}
        assert set(rows) == {"acme"} and rows["acme"]["prompt_tokens"] == sum(r.prompt_tokens for r in records)
    finally:
        service.shutdown(1)


def service_tenants(service) -> list[dict]:
    from kvctl.daemon.server.tenants import list_tenants

    return list_tenants(service)["tenants"]


def test_a_daemon_that_stops_during_the_run_leaves_the_client_s_figures_and_says_why(capsys, monkeypatch):
    """The requests it cut short are aborts; the engine's step counters cannot be read after the
    run, so those figures alone are left out (every figure was lost with an error before)."""
    import kvctl.bench_serve as bench_serve
    import kvctl.client as client
    from kvctl.bench_figures import RequestRecord
    from kvctl.errors import KvdUnavailable

    status = {"model": {"name": "demo", "revision": "r3v", "path": "/nowhere", "device": "cpu",
                        "dtype": "torch.float32"}, "steps": {}}

    class Stopping:
        def __init__(self, **options):
            self.asked = 0

        def get(self, path, **params):
            self.asked += 1
            if self.asked == 1:
                return status
            raise KvdUnavailable("kvd answered 503: kvd is shutting down")

    async def drive(sync, work, concurrency, rate, seed, tick, api, replies="synthetic"):
        return [RequestRecord(0, 0.0, 40, 0, [0.1, 0.2], 0.2), RequestRecord(1, 0.0, 40, 0, [0.1], 0.1, "aborted")]

    monkeypatch.setattr(client, "Client", Stopping)
    monkeypatch.setattr(bench_serve, "_drive", drive)
    code, out, err = cli(capsys, "bench", "serve", "--baseline", "none", "--requests", "2", "--max-tokens", "2",
                         "--json")
    assert code == 0
    assert "kvd did not answer after the run (kvd answered 503: kvd is shutting down); its engine figures are " \
           "left out" in " ".join(err.split())
    document = json.loads(out)
    assert document["engine"] is None and document["kvd"]["aborts"] == 1
    assert document["kvd"]["output_tokens_per_second"] > 0


def test_a_finer_trace_s_prompts_share_exactly_the_tokens_their_ids_say(tmp_path):
    path = tmp_path / "t.jsonl"
    write_trace(path, [TraceRequest(0.0, 200, 5, (1, 2, 3, 4), None, 64),
                       TraceRequest(10.0, 150, 5, (1, 2, 9), None, 64)])
    a, b = from_trace(str(path))  # at full size: 64 tokens an id
    assert (len(a.prompt), len(b.prompt)) == (200, 150)
    assert a.prompt[:128] == b.prompt[:128] and a.prompt[128:150] != b.prompt[128:150]
    assert b.prompt[:64] == hash_block_tokens(1, 64, 256)
    a, b = from_trace(str(path), block_tokens=16)  # shrunk for a CPU: 2 tokens an id
    assert (len(a.prompt), len(b.prompt)) == (7, 5) and a.prompt[:4] == b.prompt[:4] != a.prompt[4:]


def served(queued_ms, prefill_ms, cached_tokens):
    return {"timestamp": 0.0, "input_length": 1056, "output_length": 8, "hash_ids": [0, 1, 2],
            "served": {"queued_ms": queued_ms, "prefill_ms": prefill_ms, "decode_ms": 50.0,
                       "cached_tokens": cached_tokens}}


def test_kvd_s_own_timings_part_the_queue_from_the_prefill():
    from kvctl.bench_figures import served_figures

    lines = [served(100.0, 40.0, 0), served(120.0, 44.0, 0), served(130.0, 4.0, 1024), served(140.0, 5.0, 1024),
             served(150.0, 6.0, 1024), {"timestamp": 1.0, "input_length": 900, "output_length": 0, "hash_ids": [3, 4]}]
    figures = served_figures(lines)  # the line turned away says nothing of how kvd served it
    assert figures == {"requests": 5, "queued_p50_s": 0.13, "queued_p95_s": 0.15, "prefill_p50_s": 0.006,
                       "prefill_cached_over_uncached": pytest.approx(0.005 / 0.040)}
    assert served_figures(lines[2:])["prefill_cached_over_uncached"] is None  # no uncached request to compare
    assert served_figures(lines[-1:]) is None


def test_the_report_gives_kvd_s_own_timings_and_says_when_the_queue_outweighs_the_prefill(capsys):
    from kvctl.bench_serve import _print_report

    document = {"workload": "shared-prefix", "settings": {"requests": 96, "max_tokens": 8},
                "kvd": {"ttft_cached_over_uncached": 2.127}, "baseline": None, "ratio": {},
                "served": {"requests": 96, "queued_p50_s": 0.1389, "queued_p95_s": 0.1981, "prefill_p50_s": 0.0055,
                           "prefill_cached_over_uncached": 0.087}}
    _print_report(document, None)
    captured = capsys.readouterr()
    assert " ".join(captured.out.split()).endswith(
        "kvd's own timings (96 requests): queued p50 138.9 ms, p95 198.1 ms; admission to first token p50 5.5 ms, "
        "cached ÷ uncached 0.087")
    assert " ".join(captured.err.split()) == (
        "requests waited in kvd's queue longer than their prefill took (p50 138.9 ms against 5.5 ms): the client's "
        "TTFT figures, ttft_cached_over_uncached most of all, measure that queue; kvd's own cached ÷ uncached is "
        "what the cache saves. A lower --rate (or --concurrency) measures the cache")
    _print_report({**document, "served": {**document["served"], "queued_p50_s": 0.0002}}, None)
    captured = capsys.readouterr()
    assert "queued p50 0.2 ms" in captured.out and captured.err == ""
    _print_report({**document, "served": None}, None)  # a kvd that keeps no trace
    assert "kvd's own timings" not in capsys.readouterr().out


def test_a_response_s_body_and_events_as_the_bench_sends_and_reads_them():
    from kvctl.bench_serve import read_chunk, request_body
    from kvctl.workloads import BenchRequest

    asked = BenchRequest([], 4, messages=[{"role": "system", "content": "be brief"},
                                          {"role": "user", "content": "first"}, {"role": "assistant", "content": "a"},
                                          {"role": "user", "content": "second"}])
    path, body = request_body(asked, 3, "responses", "resp_1")
    assert (path, body) == ("v1/responses", {"input": "second", "max_output_tokens": 4, "ignore_eos": True,
                                             "seed": 3, "temperature": 0.0, "stream": True,
                                             "instructions": "be brief", "previous_response_id": "resp_1"})
    path, body = request_body(BenchRequest([], 2, messages=[{"role": "user", "content": "hi"}]), 0, "responses",
                              None)
    assert "previous_response_id" not in body and "instructions" not in body and body["input"] == "hi"
    assert request_body(asked, 3, "", None)[0] == "v1/chat/completions"
    path, body = request_body(asked, 3, "conversations", "conv_1")
    assert (path, body["conversation"], body["input"]) == ("v1/responses", "conv_1", "second")
    assert "previous_response_id" not in body

    record = RequestRecord(0, 10.0)
    assert read_chunk({"type": "response.created", "response": {"id": "resp_9"}}, record, 10.1) == "resp_9"
    for now in (10.2, 10.3):
        assert read_chunk({"type": "response.output_text.delta", "delta": "x"}, record, now) is None
    read_chunk({"type": "response.completed", "response": {"usage": {
        "input_tokens": 40, "input_tokens_details": {"cached_tokens": 32}, "output_tokens": 3}}}, record, 10.4)
    # the third token came in the second delta (the client fell behind): by that delta's time
    assert (record.token_times, record.prompt_tokens, record.cached_tokens) == ([10.2, 10.3, 10.3], 40, 32)


@pytest.mark.parametrize("api", ["responses", "conversations"])
def test_a_multi_turn_bench_through_kvd_s_kept_conversations_continues_each_turn_from_the_cache(tmp_path, api):
    """`--api responses`: a turn sends only its new message and the id of the turn before;
    `--api conversations`: each conversation is made before its first turn, and every turn names
    it. Either way kvd renders the conversation it holds (with its own replies), so each turn after
    the first comes from the cache up to its new part."""
    pytest.importorskip("torch")
    from .daemon_fixtures import apps, blocks_all_back, start_service, token_table

    service = start_service(tmp_path, num_blocks=256)
    try:
        unix, _ = apps(service, token_table(tmp_path))
        work = multi_turn(conversations=2, turns=3, user_tokens=24, max_tokens=8, chat=True)

        records = asyncio.run(drive_over_socket(unix, tmp_path, work, concurrency=2, api=api))
        assert [r.status for r in records] == ["ok"] * 6
        assert all(len(r.token_times) == 8 for r in records)
        block = service.config.block_size
        for c in range(2):
            turns = records[3 * c:3 * c + 3]
            assert turns[0].cached_tokens == 0
            for before, after in zip(turns, turns[1:]):  # the last turn's prompt, whole blocks of it, came back
                assert after.prompt_tokens > before.prompt_tokens + 8
                assert after.cached_tokens >= before.prompt_tokens // block * block > 0
        kept = service.responses.figures()
        assert kept["responses"] == 6 and kept["running"] == 0
        talks = service.conversations
        if api == "conversations":  # three questions and three replies in each
            assert sorted(len(c.items) for c in talks.entries.values()) == [6, 6]
        else:
            assert talks.figures()["conversations"] == 0
        assert blocks_all_back(service)
    finally:
        service.shutdown(1)


@pytest.mark.parametrize("chat, api", [(False, None), (True, None), (True, "responses")])
def test_a_multi_turn_bench_can_send_the_model_s_own_replies_back(tmp_path, chat, api):
    """`--replies model`: each later turn is the turn before as it was sent, the reply it got (a chat
    its text, completions its token ids) and its own new message, so it finds the turn before and
    its reply cached, as a client's next turn does. A chat's replies go back in as the ids the model
    made (reply_ids.py): six of them in the later turns of two conversations of three (turn 2 sends
    one back, turn 3 two). Through /v1/responses, each turn whole with `store: false`: the same, and
    kvd keeps no response."""
    pytest.importorskip("torch")
    from .daemon_fixtures import apps, blocks_all_back, start_service, token_table

    service = start_service(tmp_path, num_blocks=256)
    try:
        unix, _ = apps(service, token_table(tmp_path))
        work = multi_turn(conversations=2, turns=3, user_tokens=24, max_tokens=8, chat=chat)
        records = asyncio.run(drive_over_socket(unix, tmp_path, work, concurrency=2, api=api, replies="model"))
        assert [r.status for r in records] == ["ok"] * 6
        block = service.config.block_size
        for c in range(2):
            turns = records[3 * c:3 * c + 3]
            for before, after in zip(turns, turns[1:]):  # the turn before and its reply (less its last token)
                assert after.cached_tokens == (before.prompt_tokens + 8 - 1) // block * block
                if not chat:  # the prompt is the one before, the reply's 8 ids and the 24 of its new message
                    assert after.prompt_tokens == before.prompt_tokens + 8 + 24
        assert service.reply_ids.figures()["spliced"] == (6 if chat else 0)
        assert service.responses.figures()["responses"] == 0  # (none kept, through /v1/responses either)
        assert blocks_all_back(service)
    finally:
        service.shutdown(1)


def test_a_stateless_responses_turn_sends_the_whole_conversation_kept_by_no_one():
    """`--api responses --replies model`: each turn sends the whole conversation as `input`, kept by no
    one (`store: false`), as an agent that keeps its own does; a system message is its instructions."""
    from dataclasses import replace

    from kvctl.bench_serve import request_body

    work = multi_turn(conversations=1, turns=2, user_tokens=24, max_tokens=8, chat=True)
    path, body = request_body(work[1], 1, "responses", None, stateless=True)
    assert (path, body["store"], body["input"]) == ("v1/responses", False, work[1].messages)
    assert "previous_response_id" not in body and "instructions" not in body
    system = [{"role": "system", "content": "Be brief."}]
    _, body = request_body(replace(work[1], messages=system + work[1].messages), 1, "responses", None, True)
    assert (body["instructions"], body["input"]) == ("Be brief.", work[1].messages)


@pytest.mark.parametrize("flags, message", [
    (["--replies", "mine"], "replies: unknown value 'mine'; use synthetic or model"),
    (["--replies", "model", "--baseline", "none"], "replies: model sends a turn's reply back in the next, and "
                                                   "shared-prefix has no turns; use --workload multi-turn"),
    (["--replies", "model", "--workload", "multi-turn", "--api", "conversations", "--baseline", "none"],
     "replies: under --api conversations kvd keeps the conversation, and each turn continues by its own replies "
     "already; leave --replies out"),
    (["--replies", "model", "--workload", "multi-turn"], "replies: model sends kvd's own replies back, which the "
                                                          "baseline would not have made; use --baseline none"),
])
def test_bench_serve_refuses_model_replies_where_they_cannot_be_sent(capsys, flags, message):
    status, _, err = cli(capsys, "bench", "serve", *flags)
    assert status == 2 and message in " ".join(err.split())
