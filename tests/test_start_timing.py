"""How long kvd's start took and where the time went: /admin/status `start`, kvd_start_seconds,
and kvctl status's `started` line."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvctl.daemon.server.start_timing import StartTimer, process_age
from kvctl.status_view import start_line


class Clock:
    def __init__(self, now: float = 50.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_each_phase_is_timed_from_the_end_of_the_one_before_and_ready_from_the_process_start():
    clock = Clock()
    timer = StartTimer(clock=clock, age=lambda: 9.5)
    for phase, took in (("model", 2.0), ("cache", 0.5), ("tiers", 0.25), ("pins", 0.125)):
        clock.now += took
        timer.mark(phase)
    timer.ready()
    assert timer.report() == {"ready_after_seconds": 9.5, "load_seconds": 2.875, "pins_warmed_seconds": None,
                              "phases": {"model": 2.0, "cache": 0.5, "tiers": 0.25, "pins": 0.125}}
    blind = StartTimer(clock=clock, age=lambda: None)  # no /proc: ready counts from the load's start
    clock.now += 3.0
    blind.mark("model")
    blind.ready()
    assert blind.report()["ready_after_seconds"] == 3.0


def test_the_process_age_counts_from_the_process_s_own_start():
    if process_age() is None:
        pytest.skip("this system does not say when a process started (/proc)")
    code = ("import time; time.sleep(0.6); from kvctl.daemon.server.start_timing import process_age; "
            "print(process_age())")
    age = float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert 0.6 <= age < 60  # the sleep, plus the interpreter's start and the import (a tick is 10 ms)


def test_kvd_reports_its_start_by_phase_in_status_and_metrics(tmp_path):
    pytest.importorskip("torch")
    from kvctl.daemon.server.app import create_app

    from .daemon_fixtures import call, start_service

    service = start_service(tmp_path, num_blocks=64, disk_cache_bytes="16MiB")
    try:
        app = create_app(service, service.metrics, front="unix")
        start = call(app, "GET", "/admin/status").json()["start"]
        assert list(start["phases"]) == ["model", "cache", "tiers", "pins"]
        assert all(took >= 0 for took in start["phases"].values())
        assert start["load_seconds"] == pytest.approx(sum(start["phases"].values()))
        assert start["ready_after_seconds"] >= start["load_seconds"]  # the process began before the load
        metrics = call(app, "GET", "/metrics").text
        for phase in ("ready", "model", "cache", "tiers", "pins"):
            assert f'kvd_start_seconds{{phase="{phase}"}}' in metrics
        assert 'phase="pins_warmed"' not in metrics  # no pin to bring back
    finally:
        service.shutdown(deadline=2)


def test_kvctl_status_says_how_long_the_start_took_and_where_it_went():
    start = {"ready_after_seconds": 12.5, "load_seconds": 4.25, "pins_warmed_seconds": 1.5,
             "phases": {"model": 3.0, "cache": 0.75, "tiers": 0.375, "pins": 0.125}}
    assert start_line(start, 7300) == (
        "ready 12.50 s after the process began: 8.25 s before the load (imports, settings), model 3.00 s, "
        "cache 750.0 ms, tiers (disk scan) 375.0 ms, pins 125.0 ms; pinned prefixes back from the lower tiers "
        "1.50 s later; up 2h 1m")
    assert start_line({**start, "pins_warmed_seconds": None}, None).endswith("pins 125.0 ms")
