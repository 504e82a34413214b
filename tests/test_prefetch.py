"""Prefetch policies: how long a waiting request holds out for its prefix to come up from disk
(or Redis) before it is admitted with what has arrived, and that a slow fetch holds up only its
own request. SGLang HiCache's names: timeout, best_effort, wait_complete.

The disk reads are gated: block 0 of TEXT_A is staged, the read of block 1 hangs until the test
releases it, and the engine's clock is the test's, so every deadline is exact."""

from __future__ import annotations

import threading

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

from kvctl.daemon.cache.keys import PrefixHasher  # noqa: E402
from kvctl.policies.tiering import PrefetchWait  # noqa: E402

from .daemon_fixtures import call, start_service  # noqa: E402
from .tier_engine import GREEDY, TEXT_A, TEXT_B, demo, engine_with, generate, push_out  # noqa: E402,F401
from .tier_fixtures import redis_server  # noqa: E402,F401

TEXT_D = "Something nobody asked before, with no prefix in any tier at all: it computes from scratch."


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class GatedDisk:
    """Disk reads one block at a time; the second read waits for `release`."""

    def __init__(self, tiered) -> None:
        tiered.FETCH_GROUP = 1
        self.real, self.tiered = tiered.disk._read_range, tiered
        self.entered, self.release, self.calls = threading.Event(), threading.Event(), 0
        tiered.disk._read_range = self.read

    def read(self, *where):
        self.calls += 1
        if self.calls == 2:
            self.entered.set()
            self.release.wait(10)
        return self.real(*where)

    def settle(self) -> None:
        """Let the fetch finish, and wait until it has."""
        self.release.set()
        self.tiered._reader.submit(lambda: None).result(10)


def on_disk(demo, tmp_path, **settings):
    """An engine whose TEXT_A sits on disk only (the device pushed it out), with its cold output."""
    clock = Clock()
    engine, tiered = engine_with(demo, settings=settings, clock=clock, disk_bytes=1 << 22, disk_path=tmp_path / "d")
    cold = generate(engine, TEXT_A, demo)
    push_out(engine, demo)
    tiered.flush()
    keys = PrefixHasher(engine.namespace("default")).feed(demo.tokenizer.encode(TEXT_A))
    assert engine.cache.lookup(keys) == 0 and all(k in tiered.disk.index for k in keys)
    return engine, tiered, clock, cold.sequences[0].output_ids


def held_fetch(demo, tmp_path, **settings):
    """`on_disk`, then a request for TEXT_A whose fetch has staged block 0 and hangs on block 1:
    (engine, tiers, clock, cold output, gate, request)."""
    engine, tiered, clock, cold = on_disk(demo, tmp_path, **settings)
    gate = GatedDisk(tiered)
    request = engine.add_request(demo.tokenizer.encode(TEXT_A), GREEDY)
    assert gate.entered.wait(10)
    return engine, tiered, clock, cold, gate, request


def blocks_of(demo, text) -> int:
    return (len(demo.tokenizer.encode(text)) - 1) // 16  # whole blocks before the last prompt token


def test_the_policy_s_deadlines_and_outcomes():
    timeout = PrefetchWait("timeout", timeout=2.0, per_1k_tokens=0.5)
    assert timeout.deadline(10.0, 2048) == 13.0
    assert timeout.waits(10.0, 2048, 12.999) and not timeout.waits(10.0, 2048, 13.0)
    assert (timeout.outcome(True), timeout.outcome(False)) == ("complete", "timeout")
    best = PrefetchWait("best_effort")
    assert not best.waits(10.0, 4096, 10.0) and best.outcome(False) == "best_effort"
    forever = PrefetchWait("wait_complete")
    assert forever.waits(10.0, 16, 1e12) and forever.outcome(True) == "complete"
    for kwargs, message in ((dict(policy="sometimes"), "prefetch_policy: invalid value 'sometimes'; use timeout, "
                                                       "best_effort, wait_complete"),
                            (dict(timeout=0.0), "prefetch_timeout: invalid value 0.0; must be > 0 seconds"),
                            (dict(per_1k_tokens=-1.0), "prefetch_timeout_per_1k_tokens: invalid value -1.0; "
                                                       "must be >= 0")):
        with pytest.raises(ValueError) as raised:
            PrefetchWait(**kwargs)
        assert str(raised.value) == message


def test_a_slow_fetch_holds_up_only_its_own_request_until_its_timeout(demo, tmp_path):
    engine, tiered, clock, cold, gate, slow = held_fetch(demo, tmp_path, prefetch_policy="timeout",
                                                         prefetch_timeout=5.0, prefetch_timeout_per_1k_tokens=1.0)
    fresh = engine.add_request(demo.tokenizer.encode(TEXT_D), GREEDY)
    while not fresh.finished:  # the request behind it runs to the end meanwhile
        engine.step()
    assert slow.metrics.admitted is None and engine.fetching_prefix(slow)
    tokens = slow.metrics.prefetch_tokens
    assert tokens == blocks_of(demo, TEXT_A) * 16
    clock.now += 5.0 + tokens / 1024 - 0.001  # just before its deadline: still waiting
    engine.step()
    assert slow.metrics.admitted is None
    clock.now += 0.001
    engine.step()  # the deadline: admitted with the one block staged, the rest recomputed
    assert slow.metrics.admitted is not None and slow.metrics.restored_tokens == 16
    gate.settle()
    engine.run_until_done()
    assert slow.sequences[0].output_ids == cold
    assert engine.stats.prefetch_outcomes == {"timeout": 1} and engine.stats.prefetch_staged_blocks == 1
    assert list(engine.stats.recent_prefetch_waits) == [pytest.approx(5.0 + tokens / 1024)]
    assert tiered.staged == {} and not tiered.prefetches
    engine.cache.audit()


def test_wait_complete_waits_past_any_timeout_and_restores_the_whole_prefix(demo, tmp_path):
    engine, tiered, clock, cold, gate, slow = held_fetch(demo, tmp_path, prefetch_policy="wait_complete")
    clock.now += 3600
    for _ in range(3):
        assert engine.step() == [] and slow.metrics.admitted is None
    gate.settle()
    engine.run_until_done()
    assert slow.metrics.restored_tokens == slow.metrics.cached_tokens == blocks_of(demo, TEXT_A) * 16
    assert slow.sequences[0].output_ids == cold
    assert engine.stats.prefetch_outcomes == {"complete": 1}
    assert engine.stats.prefetch_staged_blocks == blocks_of(demo, TEXT_A)


def test_best_effort_admits_at_once_with_what_is_staged(demo, tmp_path):
    engine, tiered, clock, cold, gate, slow = held_fetch(demo, tmp_path, prefetch_policy="best_effort")
    engine.step()
    assert slow.metrics.admitted == clock.now and slow.metrics.restored_tokens == 16
    gate.settle()
    engine.run_until_done()
    assert slow.sequences[0].output_ids == cold
    assert engine.stats.prefetch_outcomes == {"best_effort": 1}
    assert list(engine.stats.recent_prefetch_waits) == [0.0]


def test_an_idle_engine_waits_for_a_held_fetch_no_longer_than_its_deadline_or_a_poll(demo, tmp_path):
    """With nothing to run the engine does not spin: it waits on the fetch, for at most the poll
    interval (so that new requests are looked at) and never past the request's deadline."""
    engine, tiered, clock, _, gate, slow = held_fetch(demo, tmp_path, prefetch_policy="timeout", prefetch_timeout=1.0)
    waits = []
    real_wait = tiered.wait_prefetch
    tiered.wait_prefetch = lambda request_id, timeout: (waits.append((request_id, timeout)),
                                                        real_wait(request_id, timeout))
    tokens = slow.metrics.prefetch_tokens
    engine.step()
    clock.now += 1.0 - 0.01  # 10 ms before the deadline
    engine.step()
    assert waits == [(slow.request_id, engine.PREFETCH_POLL), (slow.request_id, pytest.approx(0.01))]
    assert tokens and slow.metrics.admitted is None
    gate.settle()
    engine.run_until_done()


def test_cancelling_a_request_that_waits_for_its_fetch_counts_it_cancelled(demo, tmp_path):
    engine, tiered, _, _, gate, slow = held_fetch(demo, tmp_path, prefetch_policy="wait_complete")
    engine.step()
    engine.cancel(slow.request_id)
    gate.settle()
    assert engine.stats.prefetch_outcomes == {"cancelled": 1} and not engine.stats.recent_prefetch_waits
    assert tiered.staged == {} and not engine.has_work()
    engine.cache.audit()


def test_a_fetch_from_a_shared_redis_that_finds_nothing_is_a_miss_not_complete(demo, redis_server):
    """A Redis tier may hold blocks other daemons wrote, so a new prompt's prefix is asked for
    there; when none is found, the wait ended as a miss. Blocks that came up are `complete`."""
    from kvctl.tiers_cmd import prefetch_line

    writer, _ = engine_with(demo, remote_url=redis_server.url, write_policy="write_through")
    generate(writer, TEXT_A, demo)
    assert writer.tiers.flush(timeout=30)
    engine, tiered = engine_with(demo, remote_url=redis_server.url, settings={"prefetch_policy": "wait_complete"})
    fresh = generate(engine, TEXT_D, demo)  # nobody wrote it
    assert fresh.metrics.prefetch_outcome == "miss" and fresh.metrics.restored_tokens == 0
    shared = generate(engine, TEXT_A, demo)  # the writer's blocks come up
    assert shared.metrics.prefetch_outcome == "complete" and shared.metrics.restored_tokens > 0
    assert engine.stats.prefetch_outcomes == {"miss": 1, "complete": 1}
    line = prefetch_line({"policy": "wait_complete", "outcomes": engine.stats.prefetch_outcomes,
                          "wait_seconds": {"count": 0}, "staged_blocks": 0, "fetching_now": 0})
    assert line == "prefetch (wait_complete): 1 complete, 1 found nothing"


def test_the_daemon_reports_prefetches_and_takes_a_new_policy_live(tmp_path):
    """After a restart TEXT_A is on disk only: its request waits for the fetch. /admin/tiers,
    /metrics, `kvctl tiers` and `kvctl requests` (while a fetch hangs) show it; a reload changes
    the policy without a restart."""
    from rich.console import Console

    from kvctl.daemon.config import resolve
    from kvctl.daemon.server.app import create_app
    from kvctl.requests_cmd import render_requests
    from kvctl.tiers_cmd import render_tiers

    settings = dict(num_blocks=64, disk_cache_bytes="16MiB", tiering="always")
    body = {"prompt": TEXT_A, "max_tokens": 2, "temperature": 0}
    first = start_service(tmp_path, **settings)
    before = call(create_app(first, first.metrics, front="unix"), "POST", "/v1/completions", json=body).json()
    first.shutdown(deadline=5)  # its cached blocks are saved to disk
    service = start_service(tmp_path, **settings, prefetch_timeout=30.0)
    try:
        app = create_app(service, service.metrics, front="unix")
        gate = GatedDisk(service.tiers)
        answers = []
        client = threading.Thread(target=lambda: answers.append(call(app, "POST", "/v1/completions", json=body)))
        client.start()
        assert gate.entered.wait(10)
        rows = call(app, "GET", "/admin/requests").json()
        [row] = rows["requests"]
        assert (row["state"], row["fetching_prefix"], rows["waiting"]) == ("waiting", True, 1)
        console = Console(width=140, record=True)
        console.print(render_requests(rows))
        assert "waiting (fetching prefix)" in console.export_text()
        assert call(app, "GET", "/admin/tiers").json()["prefetch"]["fetching_now"] == 1
        gate.settle()
        client.join(30)
        after = answers[0].json()
        assert after["choices"][0]["text"] == before["choices"][0]["text"]
        cached = after["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached == blocks_of(service.loaded, TEXT_A) * 16
        report = call(app, "GET", "/admin/tiers").json()
        prefetch = report["prefetch"]
        assert (prefetch["policy"], prefetch["timeout_seconds"], prefetch["timeout_per_1k_tokens_seconds"]) == \
            ("timeout", 30.0, 0.0)
        assert prefetch["outcomes"] == {"complete": 1, "timeout": 0, "best_effort": 0, "cancelled": 0, "miss": 0}
        assert prefetch["staged_blocks"] == cached // 16 and prefetch["fetching_now"] == 0
        assert prefetch["wait_seconds"]["count"] == 1 and prefetch["wait_seconds"]["p50"] > 0
        console = Console(width=160, record=True)
        render_tiers(report, console)
        text = console.export_text()
        assert f"prefetch (timeout 30 s): 1 complete; {cached // 16} blocks staged by admission; waited p50" in text
        metrics = call(app, "GET", "/metrics").text
        assert 'kvd_prefetch_requests_total{outcome="complete"} 1.0' in metrics
        assert 'kvd_prefetch_requests_total{outcome="timeout"} 0.0' in metrics
        assert "kvd_prefetch_wait_seconds_count 1.0" in metrics
        new = resolve({"state_dir": str(tmp_path), "socket": str(tmp_path / "kvd.sock"), **settings,
                       "prefetch_policy": "best_effort"}, env={})
        result = service.reload(new, actor="test")
        assert "prefetch_policy" in result["changed"]
        assert service.engine.prefetch.policy == "best_effort"
        assert call(app, "GET", "/admin/tiers").json()["prefetch"]["policy"] == "best_effort"
    finally:
        service.shutdown(deadline=2)


@pytest.mark.parametrize("field, value, message", [
    ("prefetch_policy", "sometimes", "prefetch_policy: invalid value 'sometimes' from --prefetch-policy: "
                                     "must be timeout, best_effort or wait_complete"),
    ("prefetch_timeout", "0", "prefetch_timeout: invalid value '0' from --prefetch-timeout: must be a number of "
                              "seconds > 0 (for no limit, use prefetch_policy: wait_complete)"),
    ("prefetch_timeout", "inf", "prefetch_timeout: invalid value 'inf' from --prefetch-timeout: must be a finite "
                                "number"),
    ("prefetch_timeout_per_1k_tokens", "-0.5", "prefetch_timeout_per_1k_tokens: invalid value '-0.5' from "
                                               "--prefetch-timeout-per-1k-tokens: must be a number of seconds >= 0"),
])
def test_bad_prefetch_settings_are_refused_naming_the_field_and_value(field, value, message):
    from kvctl.daemon.config import ConfigError, resolve

    with pytest.raises(ConfigError) as raised:
        resolve({field: value}, env={})
    assert str(raised.value) == message


def test_a_fetch_that_finds_its_blocks_staged_by_another_holds_them_until_its_own_request_is_done(demo, tmp_path):
    """Two requests for the same prefix on disk: the second's fetch, queued behind the first's,
    finds every block staged already. Those stay staged for it when the first request is admitted."""
    engine, tiered, _, _ = on_disk(demo, tmp_path)
    keys = PrefixHasher(engine.namespace("default")).feed(demo.tokenizer.encode(TEXT_A))
    gate = GatedDisk(tiered)
    assert tiered.start_prefetch("first", keys) and gate.entered.wait(10)
    assert tiered.start_prefetch("second", keys)  # block 0 is staged: it sets out from block 1, behind the first
    gate.settle()
    assert tiered.prefetches["first"].staged == keys and tiered.prefetches["second"].staged == keys[1:]
    tiered.finish_prefetch("first")
    assert list(tiered.staged) == keys[1:]
    tiered.finish_prefetch("second")
    assert tiered.staged == {}
