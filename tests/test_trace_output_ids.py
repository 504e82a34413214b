"""`output_hash_ids`: kvd's trace names the whole blocks of each request's prompt and output together,
in the chain a later prompt repeating the answer carries, so a replay hits a chat's earlier answers
as kvd's cache does."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from kvctl.daemon.replay.simulator import ReplaySettings, max_hit_blocks
from kvctl.daemon.replay.sweep import sweep
from kvctl.daemon.replay.trace import TraceError, TraceKeyer, TraceRequest, parse_request, read_trace, write_trace
from kvctl.daemon.server.fleet_trace import merge_traces
from kvctl.daemon.server.request_trace import RequestTrace, chained_block_ids, sequence_block_ids

from .test_cli import cli
from .test_fleet_trace import keyed, replica
from .test_request_trace import KEY, finished

PROMPT = [(i * 7) % 250 for i in range(100)]
ANSWER = [7] * 60  # what finished() answers: 60 sevens


def test_the_output_s_ids_are_the_ids_a_prompt_repeating_it_carries():
    prompt_ids, output_ids = sequence_block_ids(KEY, "default", PROMPT, ANSWER, 64)
    assert prompt_ids == chained_block_ids(KEY, "default", PROMPT, 64)  # (2 ids: 64 and the 36-token tail)
    assert len(output_ids) == 1  # 160 tokens make one whole block of 64 from the prompt's tail (64 to 127)
    later = chained_block_ids(KEY, "default", PROMPT + ANSWER + [9] * 40, 64)
    assert later[0] == prompt_ids[0] and later[1] == output_ids[0] and later[1] != prompt_ids[1]
    assert sequence_block_ids(KEY, "default", PROMPT, ANSWER[:27], 64)[1] == ()  # 127 tokens: none whole
    assert sequence_block_ids(KEY, "acme", PROMPT, ANSWER, 64)[1] != output_ids  # tenants never share


def test_kvd_s_trace_numbers_output_ids_with_the_prompts_and_a_fleet_s_merge_keeps_them():
    trace = RequestTrace(capacity=4, key=KEY, block_tokens=16)
    trace.observe(finished(1.0, PROMPT, outputs=(60, 12)))  # the longer sample's output is traced
    trace.observe(finished(2.0, PROMPT + ANSWER + [9] * 40, outputs=(4,)))
    first, second = trace.report(default_tenant="default")["requests"]
    # the first: 7 ids (6 whole blocks and a 4-token tail); its 160 tokens make blocks 6 to 9 whole
    assert first["hash_ids"] == list(range(7)) and first["output_hash_ids"] == [7, 8, 9, 10]
    # the second repeats the answer: blocks 6 to 9 are the first's output ids, then 3 of its own
    assert second["hash_ids"] == list(range(6)) + [7, 8, 9, 10, 11, 12, 13]
    assert "output_hash_ids" not in second  # 204 tokens: no block whole past its prompt's 12
    lines = trace.report(keyed=True, unix_time=float)["requests"]
    assert lines[0]["keyed_output_ids"] == [f"{i:016x}" for i in
                                            sequence_block_ids(KEY, "default", PROMPT, ANSWER, 16)[1]]
    assert "keyed_output_ids" not in lines[1]
    # replicas sharing a trace key: the merge numbers output ids with everyone's prompt ids
    a = replica(keyed(100.0, lines[0]["keyed_ids"], output=60, prompt=100) | {
        "keyed_output_ids": lines[0]["keyed_output_ids"]})
    b = replica(keyed(100.5, lines[1]["keyed_ids"], output=4, prompt=200))
    a[1]["block_tokens"] = b[1]["block_tokens"] = 16
    status, body = merge_traces(["r0", "r1"], [a, b], last=None)
    assert status == 200 and [r.get("output_hash_ids") for r in body["requests"]] == [[7, 8, 9, 10], None]
    assert body["requests"][1]["hash_ids"] == list(range(6)) + [7, 8, 9, 10, 11, 12, 13]


TURN = TraceRequest(0.0, 100, 60, tuple(range(7)), block_tokens=16, output_hash_ids=(7, 8, 9, 10))
NEXT = TraceRequest(10_000.0, 200, 4, tuple(range(6)) + (7, 8, 9, 10, 11, 12, 13), block_tokens=16)


def test_the_replay_hits_the_answer_a_next_turn_repeats_as_kvd_s_cache_does():
    keyer = TraceKeyer(16)
    prompt = keyer.keys(TURN)
    # the answer's written blocks: 159 tokens make blocks 6 to 8 whole (the last token is never computed)
    assert keyer.output_keys(TURN, 0, prompt) == keyer.keys(NEXT)[6:9]
    base = ReplaySettings(block_size=16, capacity_tokens=4096)
    [run] = sweep([TURN, NEXT], [16], [4096], ["lru"], base)
    assert run.hit_tokens == 9 * 16  # 6 blocks of prompt and 3 of answer, as kvd's cache would give
    assert run.max_hit_ratio == 144 / 300
    [unsaid] = sweep([replace(TURN, output_hash_ids=()), NEXT], [16], [4096], ["lru"], base)
    assert unsaid.hit_tokens == 6 * 16 and unsaid.max_hit_ratio == 96 / 300  # the answer's blocks its own
    outputs = [keyer.output_keys(r, i, keyer.keys(r)) for i, r in enumerate([TURN, NEXT])]
    assert max_hit_blocks([TURN, NEXT], [prompt, keyer.keys(NEXT)], 16, outputs) == [0, 9]
    # ids coarser than the replay's blocks: the first's prompt ends 36 tokens into an id, whose blocks
    # the prompt keys by its own tail's id, so the answer's chain cannot run through them
    coarse = TraceRequest(0.0, 100, 60, (0, 1), block_tokens=64, output_hash_ids=(2,))
    keys = TraceKeyer(16).keys(coarse)
    assert TraceKeyer(16).output_keys(coarse, 0, keys) == TraceKeyer(16).output_keys(
        replace(coarse, output_hash_ids=()), 0, keys)  # its own keys, as a trace that says none


def test_a_trace_line_s_output_ids_round_trip_and_a_wrong_count_is_named(tmp_path):
    path = tmp_path / "turns.jsonl"
    write_trace(path, [TURN, NEXT])
    assert read_trace(path) == [TURN, NEXT]
    line = TURN.to_object()
    with pytest.raises(TraceError) as wrong:
        parse_request({**line, "output_hash_ids": [7, 8]}, "t line 1")
    assert str(wrong.value) == ("t line 1: field 'output_hash_ids' has 2 ids but input_length 100 and output_length "
                                "60 make 4 whole blocks of 16 tokens from the prompt's tail")
    with pytest.raises(TraceError) as bad:
        parse_request({**line, "output_hash_ids": [7, -1, 9, 10]}, "t line 1")
    assert str(bad.value) == "t line 1: field 'output_hash_ids' must be a list of integers >= 0"


def test_kvctl_replays_and_describes_a_trace_with_output_ids(tmp_path, capsys):
    path = tmp_path / "turns.jsonl"
    write_trace(path, [TURN, NEXT])
    status, printed, _ = cli(capsys, "bench", "replay", str(path), "--block-sizes", "16", "--policy", "lru", "--json")
    assert status == 0 and json.loads(printed)["runs"][0]["hit_ratio"] == 144 / 300
    status, printed, _ = cli(capsys, "trace", "stats", str(path), "--json")
    figures = json.loads(printed)
    assert status == 0 and figures["unbounded_hit_ratio"] == 144 / 300
    # the second's 12 whole prompt blocks hold the first's 6 and its answer's 3: no block is an output's alone
    assert (figures["working_set_tokens"], figures["output_working_set_tokens"]) == (12 * 16, 0)


def test_a_live_chat_s_next_turn_replays_with_the_hit_kvd_gave_it(tmp_path, capsys):
    """kvd (ids of 16 tokens) answers 20 tokens to a 40-token prompt; the next turn repeats prompt and
    answer. kvd's cache gave it the 3 blocks written whole (48 tokens: the answer's last token is never
    computed), and the replay of kvd's own trace gives it the same."""
    pytest.importorskip("torch")
    from .daemon_fixtures import call, start_service

    service = start_service(tmp_path, trace_block_tokens=16)
    try:
        from .daemon_fixtures import apps, token_table

        unix, _ = apps(service, token_table(tmp_path))
        prompt = [(i * 7) % 250 for i in range(40)]
        body = {"prompt": prompt, "max_tokens": 20, "temperature": 0.0, "ignore_eos": True}
        answer = call(unix, "POST", "/v1/completions", json=body).json()["choices"][0]["token_ids"]
        assert len(answer) == 20
        nxt = {"prompt": prompt + answer + [5] * 10, "max_tokens": 2, "temperature": 0.0, "ignore_eos": True}
        assert call(unix, "POST", "/v1/completions", json=nxt).status_code == 200
        first, second = call(unix, "GET", "/admin/trace", params={"last": 2}).json()["requests"]
    finally:
        service.shutdown(1)
    assert first["hash_ids"] == [0, 1, 2] and first["output_hash_ids"] == [3]  # 60 tokens: block 2 to 3 whole
    assert second["hash_ids"] == [0, 1, 3, 4, 5] and second["served"]["cached_tokens"] == 48
    path = tmp_path / "chat.jsonl"
    write_trace(path, [parse_request(first, "first"), parse_request(second, "second")])
    # one at a time, as the client sent them (the service model's default rates would still be decoding
    # the answer when the next turn comes, milliseconds later in kvd's trace)
    status, printed, _ = cli(capsys, "bench", "replay", str(path), "--block-sizes", "16", "--policy", "lru",
                             "--sequential", "--json")
    assert status == 0 and json.loads(printed)["runs"][0]["hit_tokens"] == 48
