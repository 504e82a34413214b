"""Python's garbage collections in kvd: timed by generation, slow ones warned about, and the
start's heap frozen under `kvd serve` (daemon/server/gc_pauses.py)."""

from __future__ import annotations

import gc
import logging

import pytest

from kvctl.daemon.server.gc_pauses import BUCKETS, WARN_EVERY_S, GcPauses


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_each_collection_is_counted_by_generation_with_its_longest_and_histogram():
    pauses = GcPauses(warn_seconds=lambda: 0.1, clock=FakeClock())
    for generation, took in [(0, 0.0004), (0, 0.002), (1, 0.004), (2, 0.15), (2, 0.03)]:
        pauses.record(generation, took)
    report = pauses.report()
    assert report["collections"] == {"0": 2, "1": 1, "2": 2}
    assert report["longest_seconds"] == {"0": 0.002, "1": 0.004, "2": 0.15}
    assert report["seconds"]["2"] == pytest.approx(0.18)
    assert report["slow"] == 1 and report["last_slow"]["generation"] == 2 and report["last_slow"]["seconds"] == 0.15
    buckets, total = pauses.histogram(2)
    assert total == pytest.approx(0.18)
    assert [b for b, _ in buckets] == [*BUCKETS, float("inf")]
    cumulative = dict(buckets)
    assert cumulative[0.025] == 0 and cumulative[0.05] == 1 and cumulative[0.1] == 1 and cumulative[0.25] == 2
    assert cumulative[float("inf")] == 2
    zeros, _ = pauses.histogram(0)
    assert dict(zeros)[0.001] == 1 and dict(zeros)[0.0025] == 2


def test_a_pause_at_the_threshold_is_slow_and_none_is_slow_with_the_warning_off():
    threshold = {"value": 0.1}
    pauses = GcPauses(warn_seconds=lambda: threshold["value"], clock=FakeClock())
    pauses.record(2, 0.1)
    pauses.record(2, 0.0999)
    assert pauses.slow == 1
    threshold["value"] = None  # gc_warn_seconds 0 (the service maps it to None), live on a reload
    pauses.record(2, 5.0)
    assert pauses.slow == 1 and pauses.last_slow[1] == 0.1


def test_slow_pauses_are_logged_at_most_once_a_minute_with_how_many(caplog):
    clock = FakeClock()
    pauses = GcPauses(warn_seconds=lambda: 0.1, clock=clock)
    caplog.set_level(logging.WARNING, logger="kvd")
    pauses.log_slow()
    assert not caplog.records  # nothing slow yet
    pauses.record(2, 0.142)
    pauses.log_slow()
    assert len(caplog.records) == 1
    message = caplog.records[0].getMessage()
    assert "stopped every thread for 142 ms (generation 2): no token moves meanwhile;" in message
    assert "gc_warn_seconds 0.1" in message
    pauses.record(2, 0.12)
    pauses.record(2, 0.3)
    clock.now += WARN_EVERY_S - 1
    pauses.log_slow()
    assert len(caplog.records) == 1  # within the minute: held back
    clock.now += 1
    pauses.log_slow()
    assert len(caplog.records) == 2
    assert "for 300 ms (generation 2), one of 2 such pauses since the last warning" in caplog.records[1].getMessage()
    clock.now += 2 * WARN_EVERY_S
    pauses.log_slow()
    assert len(caplog.records) == 2  # nothing new


def test_a_real_collection_is_timed_and_the_freeze_s_own_is_not_counted_as_a_pause():
    pauses = GcPauses(warn_seconds=lambda: None).install()
    try:
        before = dict(pauses.collections)
        gc.collect()
        assert pauses.collections[2] == before[2] + 1 and pauses.seconds[2] > 0
        frozen = pauses.freeze()
        assert frozen == gc.get_freeze_count() > 0
        assert pauses.collections[2] == before[2] + 1  # the freeze's collection is the start's, not a pause
        assert pauses.freeze_seconds > 0
        assert pauses.report()["watching"] is True and pauses.report()["frozen_objects"] == frozen
    finally:
        pauses.unfreeze()
        pauses.uninstall()
    assert gc.get_freeze_count() == 0 and pauses.report()["watching"] is False
    gc.collect()
    assert pauses.collections[2] == before[2] + 1  # uninstalled: no longer counted


def test_kvctl_status_names_the_frozen_heap_and_the_slow_pauses():
    from kvctl.gc_status import gc_line

    report = {"watching": True, "frozen_objects": 240907, "collections": {"0": 500, "1": 45, "2": 0},
              "longest_seconds": {"0": 0.0007, "1": 0.0047, "2": 0.0}, "seconds": {}, "slow": 0, "last_slow": None,
              "warn_seconds": 0.1}
    line = gc_line(report)
    assert line.plain == ("start's heap frozen (240,907 objects); no whole-heap collection yet; 545 younger, "
                          "longest 4.7 ms")
    assert not line.style
    report.update(frozen_objects=0, collections={"0": 500, "1": 45, "2": 2},
                  longest_seconds={"0": 0.0007, "1": 0.0047, "2": 0.1542}, slow=2,
                  last_slow={"generation": 2, "seconds": 0.1542, "at": 0})
    line = gc_line(report)
    assert line.plain.startswith("heap not frozen (gc_freeze off); 2 whole-heap collections, longest 154.2 ms; "
                                 "545 younger, longest 4.7 ms; 2 stopped every thread 100.0 ms or longer, the "
                                 "latest 154.2 ms at ")
    assert line.style == "yellow"


def test_kvd_serve_freezes_its_start_s_heap_and_reports_every_collection(tmp_path):
    """A real kvd: the imports' and the load's objects are frozen (torch's alone are over 100,000),
    its own freezing collections are not pauses, /metrics has the histogram, and it exits without
    native extensions reporting frozen objects as leaked."""
    from .kvd_process import complete, kvctl, running_kvd

    with running_kvd(tmp_path, "--gc-warn-seconds", "0.5") as (_, client, sock):
        report = client.get("/admin/status").json()["gc"]
        assert report["watching"] is True
        assert report["frozen_at_ready"] > 100_000
        # nothing is frozen after the start; frozen objects whose last reference goes are still freed
        assert 100_000 < report["frozen_objects"] <= report["frozen_at_ready"]
        assert report["freeze_seconds"] > 0 and report["warn_seconds"] == 0.5
        assert report["slow"] == 0
        before = report["collections"]["2"]
        complete(client.post, "one request")
        gc_rows = [line for line in kvctl(sock, "status").stdout.splitlines() if line.startswith("gc")]
        assert gc_rows and "start's heap frozen (" in gc_rows[0]
        metrics = client.get("/metrics").text
        frozen = [line for line in metrics.splitlines() if line.startswith("kvd_gc_frozen_objects ")]
        assert frozen and 100_000 < float(frozen[0].split()[-1]) <= report["frozen_objects"]
        counted = [line for line in metrics.splitlines()
                   if line.startswith('kvd_gc_pause_seconds_count{generation="2"}')]
        assert counted and float(counted[0].split()[-1]) >= before
    log = (tmp_path / "kvd.log").read_text()
    assert "leaked" not in log and "Traceback" not in log


def test_kvd_serve_with_gc_freeze_off_freezes_nothing(tmp_path):
    from .kvd_process import running_kvd

    with running_kvd(tmp_path, "--no-gc-freeze") as (_, client, _):
        report = client.get("/admin/status").json()["gc"]
        assert report["watching"] is True
        assert report["frozen_objects"] == 0 and report["frozen_at_ready"] is None and report["freeze_seconds"] == 0
