"""A CPU engine shares the host's CPUs with other busy kvd engines: the policy, the /proc probe,
the share over time, and the engine thread taking it up between steps."""

from __future__ import annotations

import logging
import os
import time

import pytest

from kvctl.daemon.server.cpu_neighbours import KvdNeighbours, is_kvd_engine, parse_cpu_list
from kvctl.daemon.server.cpu_share import CpuShare
from kvctl.policies.cpu_threads import RAISE_AFTER_S, intra_op_threads, is_busy

TICKS = os.sysconf("SC_CLK_TCK")


def test_threads_are_an_equal_share_with_the_busy_neighbours_never_above_the_default():
    assert [intra_op_threads(8, busy, default=8) for busy in range(5)] == [8, 4, 2, 2, 1]
    assert intra_op_threads(8, 0, default=2) == 2  # never above what the engine started with
    assert intra_op_threads(2, 1, default=2) == 1
    assert intra_op_threads(2, 7, default=2) == 1  # at least one
    assert is_busy(1.0, 5.0) and not is_busy(0.99, 5.0) and not is_busy(1.0, 0.0)


def test_a_kvd_engine_is_kvd_serve_not_the_router():
    assert is_kvd_engine(["/opt/kvctl/venv/bin/python", "/opt/kvctl/venv/bin/kvd", "serve", "--config", "k.yaml"])
    assert is_kvd_engine(["kvd", "serve"])
    assert not is_kvd_engine(["/opt/kvctl/venv/bin/kvd", "router", "--replicas", "r"])
    assert not is_kvd_engine(["python", "serve.py", "kvd"])
    assert not is_kvd_engine(["/usr/bin/kvdx", "serve"])
    assert parse_cpu_list("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}


class FakeProc:
    """A /proc with processes given by argv, CPUs and CPU seconds."""

    def __init__(self, root):
        self.root = root

    def process(self, pid: int, argv: list[str], cpus: str, cpu_seconds: float) -> None:
        folder = self.root / str(pid)
        folder.mkdir(exist_ok=True)
        (folder / "cmdline").write_text("\0".join(argv) + "\0")
        (folder / "status").write_text(f"Name:\tpython3\nCpus_allowed:\tf\nCpus_allowed_list:\t{cpus}\n")
        ticks = int(cpu_seconds * TICKS)
        (folder / "stat").write_text(f"{pid} (python3 kvd (x)) S 1 1 1 0 -1 0 0 0 0 0 {ticks} 0 0 0 20 0 9\n")


KVD = ["/venv/bin/python", "/venv/bin/kvd", "serve"]


def test_neighbours_counts_the_busy_kvd_engines_on_its_cpus_only(tmp_path):
    proc, clock = FakeProc(tmp_path), [100.0]
    proc.process(10, KVD, "0-3", 0)  # this kvd
    everyone = {20: (KVD, "0-1"), 30: (KVD, "2"), 40: (["/venv/bin/kvd", "router"], "0-3"),
                50: (KVD, "4-5"), 60: (["python", "train.py"], "0-3")}
    for pid, (argv, cpus) in everyone.items():
        proc.process(pid, argv, cpus, 0)
    neighbours = KvdNeighbours(tmp_path, me=10, clock=lambda: clock[0])
    assert neighbours.look() == (0, {0, 1, 2, 3})  # first seen: not known to be busy yet
    clock[0] += 5
    used = {20: 2.0, 30: 0.5, 40: 5.0, 50: 5.0, 60: 5.0}  # 20: 0.4 of a CPU; 30: 0.1 (idle)
    for pid, seconds in used.items():
        proc.process(pid, everyone[pid][0], everyone[pid][1], seconds)
    proc.process(70, KVD, "3", 9.0)  # started since the last look
    assert neighbours.look()[0] == 1  # only 20: 30 idle, 40 the router, 50 other CPUs, 60 no kvd
    clock[0] += 5
    proc.process(70, KVD, "3", 11.0)
    proc.process(30, KVD, "2", 3.0)
    (tmp_path / "20" / "stat").unlink()  # 20 is gone
    assert neighbours.look()[0] == 2  # 70 and 30


class Neighbours:
    def __init__(self, busy=0, cpus=4):
        self.busy, self.cpu_set = busy, set(range(cpus))

    def look(self):
        return self.busy, self.cpu_set


def test_the_share_drops_at_once_rises_after_a_quiet_spell_and_says_so(caplog):
    neighbours, clock = Neighbours(), [0.0]
    share = CpuShare(4, neighbours, clock=lambda: clock[0])
    caplog.set_level(logging.INFO, logger="kvd")
    assert share.look() == 4 and not caplog.records
    neighbours.busy = 1
    assert share.look() == 2
    assert caplog.records[-1].getMessage() == ("engine threads 4 -> 2: 1 other busy kvd engine shares this kvd's "
                                               "4 CPUs (OMP_NUM_THREADS fixes the count instead)")
    assert share.look() == 2 and len(caplog.records) == 1  # said once
    neighbours.busy = 3
    assert share.look() == 1  # fewer at once
    neighbours.busy = 0
    for _ in range(3):  # a neighbour between bursts: not yet
        clock[0] += RAISE_AFTER_S / 4
        assert share.look() == 1
    neighbours.busy = 1  # a burst again: the quiet spell starts over
    clock[0] += 1
    assert share.look() == 1
    neighbours.busy = 0
    assert share.look() == 1
    clock[0] += RAISE_AFTER_S
    assert share.look() == 4 and share.report() == {"cpus": 4, "busy_neighbours": 0, "threads": 4, "fixed_by": None,
                                                "looks": 10, "shared_looks": 4}
    assert [r.getMessage().split(" this")[0] for r in caplog.records] == [
        "engine threads 4 -> 2: 1 other busy kvd engine shares", "engine threads 2 -> 1: 3 other busy kvd engines share",
        "engine threads 1 -> 4: no other busy kvd engine shares"]


def test_an_operator_s_omp_num_threads_is_kept_and_an_oversubscription_named_once(caplog):
    neighbours = Neighbours(busy=1, cpus=2)
    share = CpuShare(2, neighbours, operator_threads=True)
    caplog.set_level(logging.INFO, logger="kvd")
    assert share.look() == 2 and share.look() == 2
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == ["1 other busy kvd engine shares this kvd's 2 CPUs, and OMP_NUM_THREADS=2 oversubscribes "
                        "them: each engine's steps slow many times over; give each kvd OMP_NUM_THREADS=1 or its "
                        "own CPUs (CPUAffinity=)"]
    assert share.report()["fixed_by"] == "OMP_NUM_THREADS" and share.report()["busy_neighbours"] == 1


def test_cpus_that_cannot_be_read_leave_the_threads_as_they_are():
    share = CpuShare(2, Neighbours(busy=0, cpus=0))
    assert share.look() == 2 and share.wanted == 2


def test_the_engine_thread_takes_up_its_share_between_steps(tmp_path):
    import torch

    from .daemon_fixtures import start_service

    default = torch.get_num_threads()
    if default < 2:
        pytest.skip("one intra-op thread: nothing to share")
    service = start_service(tmp_path)
    neighbours = Neighbours(cpus=default)
    try:
        service._share_cpus_with_neighbours(neighbours)
        neighbours.busy = default  # as many busy engines as CPUs: one thread
        service.cpu_share.look()
        deadline = time.monotonic() + 10
        while service.engine_threads != 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert service.engine_threads == 1
        status = service.status()
        assert status["engine_threads"] == 1
        shown = status["cpu_share"]
        assert {k: shown[k] for k in ("cpus", "busy_neighbours", "threads", "fixed_by")} == {
            "cpus": default, "busy_neighbours": default, "threads": 1, "fixed_by": None}
        assert shown["shared_looks"] >= 1 and shown["looks"] >= 2
        from prometheus_client import generate_latest

        exposed = generate_latest(service.metrics.registry).decode()
        assert "kvd_engine_threads 1.0" in exposed.splitlines()
        assert f"kvd_cpu_busy_neighbours {float(default)}" in exposed.splitlines()
        clock = [0.0]
        service.cpu_share.clock = lambda: clock[0]
        neighbours.busy = 0
        service.cpu_share.look()
        clock[0] += RAISE_AFTER_S  # neighbours idle that long: the engine's own count again
        service.cpu_share.look()
        deadline = time.monotonic() + 10
        while service.engine_threads != default and time.monotonic() < deadline:
            time.sleep(0.05)
        assert service.engine_threads == default
    finally:
        service.shutdown(1)


def test_status_names_the_kvd_engines_a_cpu_engine_shares_with():
    from rich.console import Console

    from kvctl.status_view import render_status

    from .test_cli import _status_data

    data = _status_data(0)
    data.update(steps={"decode": {"count": 10, "seconds": 0.02}}, engine_threads=1,
                cpu_share={"cpus": 2, "busy_neighbours": 1, "threads": 1, "fixed_by": None})
    console = Console(record=True, width=200)
    render_status(data, console)
    assert "10 decode steps on 1 thread (its 2 CPUs shared with 1 other busy kvd), 20.0 ms busy" in " ".join(
        console.export_text().split())


def test_a_share_whose_look_fails_says_so_once_and_keeps_its_threads(caplog):
    import threading

    class Broken:
        def look(self):
            raise FileNotFoundError("/proc")

    share = CpuShare(2, Broken())
    caplog.set_level(logging.INFO, logger="kvd")
    stop = threading.Event()
    runner = threading.Thread(target=share.run, args=(stop, 0.01))
    runner.start()
    runner.join(5)
    stop.set()
    assert not runner.is_alive() and share.wanted == 2
    assert [r.getMessage() for r in caplog.records] == [
        "looking at other kvd engines failed; the engine keeps 2 threads from now on"]
