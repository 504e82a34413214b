"""The replay's cache keeps each request's output blocks, as kvd's does: they take room after the
request finishes, and a preempted request's restart finds what is left of its own output."""

from __future__ import annotations

import pytest

from kvctl.daemon.replay.trace import TraceRequest

from .test_replay import replica_run, run


@pytest.mark.parametrize("prompt, output, cached", [
    (32, 40, 4),  # 72 tokens: 4 whole blocks (2 of them the output's) and a partial one
    (32, 32, 3),  # 64 tokens: the 4th block's last token is sampled, never computed, so it is not cached
    (20, 40, 3),  # the prompt's tail and the output share a block: blocks 0 to 2 of 60 tokens
    (10, 40, 0),  # no whole block of prompt: a trace's ids say nothing to chain the output after
])
def test_a_finished_request_leaves_its_whole_written_blocks_cached(prompt, output, cached):
    replica = replica_run([TraceRequest(0.0, prompt, output, (1,))], capacity_tokens=128)
    pool = replica.manager.pool
    assert (pool.num_evictable, pool.num_free) == (cached, 8 - cached)


def test_output_blocks_take_room_a_later_prompt_must_evict():
    # the first's 2 prompt and 2 output blocks stay cached; the second's 5 blocks in a cache of 6 evict 3 of them
    trace = [TraceRequest(0.0, 32, 40, (1,)), TraceRequest(10_000.0, 80, 0, (2,))]
    result = run(trace, 16, 96, decode_rate=10.0)
    assert result.evictions == 3
    # lru evicts the deepest first (a request's blocks go back tail first): the output's, then the prompt's
    # second; its first stays for a third request to hit
    assert run(trace + [TraceRequest(20_000.0, 32, 0, (1,))], 16, 96, decode_rate=10.0).hit_tokens == 16


def test_a_preempted_request_restarts_on_its_own_cached_output():
    """Two requests of 32 prompt and 40 output tokens in 8 blocks, nothing reserved: both hold 4 blocks
    by 1.85 s. At 3.4 s the first needs a 5th: the second, 32 tokens made, is preempted. Of its output
    the block of tokens 32 to 47 is whole and written (its 4th block's last token was never computed):
    it stays cached with its prompt. Restarted when the first finishes (4.1 s), it hits 48 of its 64
    tokens and computes 16 again (0.05 s), then decodes its last 8: 4.95 s."""
    trace = [TraceRequest(0.0, 32, 40, (1,)), TraceRequest(50.0, 32, 40, (2,))]
    replica = replica_run(trace, capacity_tokens=128, reservation="fixed:0", prefill_rate=320.0, decode_rate=10.0)
    assert (replica.preemptions, replica.recomputed_after_preemption) == (1, 16)  # 32 with its prompt alone
    assert replica.ttft == [0.1, 0.1]
    assert replica.e2e == [4.1, pytest.approx(4.95 - 0.05)]
    assert replica.manager.pool.evictions == 1  # its last block, at 4.25 s, takes one of the first's
