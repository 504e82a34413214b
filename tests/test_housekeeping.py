"""kvd's periodic jobs run off the engine thread: a store another process holds locked delays
them, never a token; a job that fails is retried and never ends the thread."""

from __future__ import annotations

import logging
import re
import sqlite3
import threading
import time

import pytest

from kvctl.daemon.server.housekeeping import Housekeeping, Job
from kvctl.daemon.server import rollout_ops
from kvctl.daemon.store import StoreUnavailable


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_job_that_fails_is_counted_said_once_and_tried_again_at_its_next_turn(caplog):
    clock, ran = FakeClock(), []
    outcomes = iter([RuntimeError("boom"), StoreUnavailable("store: locked"), None, None])

    def flaky():
        ran.append(clock.now)
        outcome = next(outcomes)
        if outcome is not None:
            raise outcome

    job = Job("flaky", lambda: 1.5, flaky)
    house = Housekeeping([job], clock=clock)
    with caplog.at_level(logging.INFO, logger="kvd"):
        for _ in range(4):
            assert house.run_once(job) == 1.5
            assert job.due == clock.now + 1.5
            clock.now = job.due
    assert ran == [100.0, 101.5, 103.0, 104.5]
    assert house.failures == {"flaky": 2} and job.failing == 0
    said = [(r.levelname, r.getMessage(), bool(r.exc_info)) for r in caplog.records]
    assert said == [("ERROR", "housekeeping: flaky failed; tried again every 1.5 s (said once): boom", True),
                    ("INFO", "housekeeping: flaky works again after 2 failures", False)]


def test_a_store_that_cannot_take_writes_is_said_in_one_line_without_a_traceback(caplog):
    def locked():
        raise StoreUnavailable("store: 'kvd.sqlite3' cannot be written now (database is locked)")

    job = Job("pin expiry", lambda: 1.0, locked)
    with caplog.at_level(logging.ERROR, logger="kvd"):
        Housekeeping([job], clock=FakeClock()).run_once(job)
    [record] = caplog.records
    assert record.getMessage() == ("housekeeping: pin expiry failed; tried again every 1 s (said once): store: "
                                   "'kvd.sqlite3' cannot be written now (database is locked)")
    assert not record.exc_info


def test_a_job_that_waits_holds_up_only_itself_and_the_threads_stop_when_told():
    stop, release, ticks = threading.Event(), threading.Event(), []
    house = Housekeeping([Job("stuck", lambda: 0.01, release.wait), Job("tick", lambda: 0.01, lambda: ticks.append(1))])
    threads = house.start(stop)
    assert [t.name for t in threads] == ["kvd-housekeeping-stuck", "kvd-housekeeping-tick"]
    deadline = time.monotonic() + 5
    while len(ticks) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(ticks) >= 3 and not release.is_set()  # ticking while the other waits
    stop.set()
    release.set()
    for thread in threads:
        thread.join(5)
        assert not thread.is_alive()


pytest.importorskip("torch")
pytest.importorskip("fastapi")

from .daemon_fixtures import apps, call, settled, start_service, token_table  # noqa: E402


def test_tokens_keep_coming_while_another_process_holds_the_store_s_write_lock(tmp_path):
    """A pin's TTL ends and an operator completes a rollout while a `sqlite3` shell holds the
    store's write lock: both wait for it, and a request runs to its end meanwhile. Before, the
    pin's expiry waited on the engine thread and the rollout's write under the locks the engine
    thread takes, and no token moved until the lock went. Once it goes, both land."""
    from rich.console import Console

    from kvctl.daemon.engine.sampling import SamplingParams
    from kvctl.daemon.server.calls import Principal
    from kvctl.status_view import render_status

    service = start_service(tmp_path, max_running=8)
    try:
        unix, _ = apps(service, token_table(tmp_path))
        rollout = call(unix, "POST", "/admin/rollouts", json={
            "policy": {"name": "p", "settings": {"reservation": "fixed:0"}}, "cohort": "50%", "stops": []}).json()
        pin = call(unix, "POST", "/admin/pins", json={"text": "a system prompt " * 8, "ttl": 1}).json()
        path = tmp_path / "kvd.sqlite3"
        shell = sqlite3.connect(path, isolation_level=None)
        shell.execute("BEGIN IMMEDIATE")
        try:
            completed: list[dict] = []
            operator = threading.Thread(target=lambda: completed.append(
                rollout_ops.complete_rollout(service, rollout["id"], Principal("default", "admin", "ops"))))
            operator.start()
            assert settled(lambda: call(unix, "GET", "/admin/pins").json()["pins"], lambda pins: pins == []) == []
            done, tokens = threading.Event(), []

            def sink(event):
                if event.token_id is not None:
                    tokens.append(event.token_id)
                if event.finish_reason:
                    done.set()

            service.submit([list(range(1, 30))], SamplingParams(max_tokens=16, ignore_eos=True),
                           Principal("acme", "admin", "t"), sink)
            assert done.wait(20), "no token moved while the store was locked"
            assert len(tokens) == 16
            assert operator.is_alive() and completed == []  # still waiting for the lock
            reader = sqlite3.connect(path)
            assert reader.execute("SELECT pin_id FROM pins").fetchall() == [(pin["pin_id"],)]  # not yet gone
            status = settled(lambda: call(unix, "GET", "/admin/status").json(),
                             lambda s: s["store"]["longest_write_wait_seconds"] >= 1.0)
            assert status["store"]["waiting_writes"] >= 2  # the rollout's and the pin's, at least
            console = Console(record=True, width=200)
            render_status(status, console)  # what `kvctl status` shows
            assert re.search(r"writes \d waiting \d+ s for the store's write lock \(another process holds it: a "
                             r"sqlite3 shell left in a transaction, a long kvctl db command\?\); after 30 s each fails",
                             " ".join(console.export_text().split()))
            scraped = call(unix, "GET", "/metrics").text
            assert re.search(r"^kvd_store_waiting_writes [2-9]\.0$", scraped, re.M)
        finally:
            shell.execute("ROLLBACK")
        operator.join(30)
        assert completed[0]["state"] == "completed"
        assert settled(lambda: reader.execute("SELECT pin_id FROM pins").fetchall(), lambda rows: rows == []) == []
        wanted = {("unpin", "expired", pin["pin_id"]), ("rollout.complete", "ok", f"rollout:{rollout['id']}")}
        # the expiry deletes the pin's row, then writes its audit entry: wait for both writes
        audit = settled(lambda: {(e["action"], e["result"], e["target"])
                                 for e in call(unix, "GET", "/admin/audit").json()["entries"]},
                        lambda entries: entries >= wanted)
        assert audit >= wanted
        metrics = call(unix, "GET", "/metrics").text
        assert 'kvd_housekeeping_failures_total{task="pin expiry"} 0.0' in metrics  # each waited; none failed
        assert 'kvd_housekeeping_failures_total{task="rollout stop conditions"} 0.0' in metrics
    finally:
        service.shutdown(1)


def test_a_sighup_while_the_store_is_locked_holds_up_no_request(tmp_path):
    """SIGHUP's reload ran on kvd's event loop, and its audit record waited there for the store:
    no request was answered until the lock went (up to 30 s). It runs off the loop now."""
    import signal

    from .kvd_process import launch

    proc, client = launch(tmp_path / "state", tmp_path / "kvd.sock", tmp_path / "kvd.log", "--max-running", "4")
    try:
        shell = sqlite3.connect(tmp_path / "state" / "kvd.sqlite3", isolation_level=None)
        shell.execute("BEGIN IMMEDIATE")
        try:
            proc.send_signal(signal.SIGHUP)
            time.sleep(0.5)  # the reload waits for the store by now
            assert client.get("/healthz", timeout=10).status_code == 200
            done = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 4, "ignore_eos": True},
                               timeout=10)
            assert done.json()["usage"]["completion_tokens"] == 4
            assert client.get("/admin/audit", timeout=10).json()["entries"] == []  # the reload's record waits
        finally:
            shell.execute("ROLLBACK")
        deadline = time.monotonic() + 10
        while not (entries := client.get("/admin/audit").json()["entries"]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [(e["action"], e["actor"], e["result"]) for e in entries] == [("reload", "sighup", "ok")]
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0


def test_admin_calls_waiting_for_a_locked_store_leave_the_probes_status_and_metrics_answering(tmp_path):
    """Sync handlers share 40 worker threads. Sixty `drain` calls, each waiting for a store that
    a shell holds locked, took them all, and /healthz, /readyz, /health, /v1/models, /metrics,
    /admin/status and /tokenize timed out: a supervisor would have restarted a kvd that was
    serving, and `kvctl status` and the scrape that say why were missing. The probes and the
    model list answer on the event loop now, /metrics has worker threads of its own, and at most
    16 admin calls that change something hold a worker thread at once."""
    import signal

    import httpx

    from .kvd_process import launch

    sock = tmp_path / "kvd.sock"
    proc, client = launch(tmp_path / "state", sock, tmp_path / "kvd.log", "--max-running", "4")
    try:
        shell = sqlite3.connect(tmp_path / "state" / "kvd.sqlite3", isolation_level=None)
        shell.execute("BEGIN IMMEDIATE")
        answers: list[int] = []

        def drain():
            with httpx.Client(base_url="http://kvd", transport=httpx.HTTPTransport(uds=str(sock)), timeout=60) as c:
                answers.append(c.post("/admin/drain", json={}).status_code)

        callers = [threading.Thread(target=drain) for _ in range(60)]
        try:
            for caller in callers:
                caller.start()
            # every worker thread a drain may take waits for the store (within 1 s on an idle machine;
            # a loaded one took longer: 15 of the 16 were there after 1 s)
            deadline = time.monotonic() + 20
            while client.get("/admin/status", timeout=5).json()["store"]["waiting_writes"] < 16:
                assert time.monotonic() < deadline, "the drains never filled the 16 slots"
                time.sleep(0.05)
            assert answers == []
            assert client.get("/healthz", timeout=5).json() == {"status": "ok"}
            readyz = client.get("/readyz", timeout=5)
            assert (readyz.status_code, readyz.json()) == (503, {"ready": False, "reason": "draining (kvctl resume "
                                                                 "takes completions again)"})
            assert client.get("/health", timeout=5).status_code == 200
            assert client.get("/v1/models", timeout=5).json()["data"][0]["owned_by"] == "kvd"
            scraped = client.get("/metrics", timeout=5).text  # from the metrics' own threads
            assert 'kvd_housekeeping_failures_total{task="pin expiry"} 0.0' in scraped
            # at most 16 of the drains hold a worker thread; the rest wait on the event loop
            status = client.get("/admin/status", timeout=5).json()
            assert status["store"]["waiting_writes"] == 16 and status["draining"]
            assert client.post("/tokenize", json={"prompt": "hello"}, timeout=5).json()["count"] > 0
            assert client.post("/admin/explain", json={"text": "hello"}, timeout=5).status_code == 200
        finally:
            shell.execute("ROLLBACK")
        for caller in callers:
            caller.join(60)
        assert answers == [200] * 60
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0


def test_only_admin_calls_that_change_something_take_a_slot():
    from kvctl.daemon.server.admin_slots import changes_something

    def http(method, path):
        return {"type": "http", "method": method, "path": path}

    assert changes_something(http("POST", "/admin/pins")) and changes_something(http("DELETE", "/admin/pins/pin-1"))
    assert changes_something(http("POST", "/admin/rollouts/3/complete"))
    assert not changes_something(http("POST", "/admin/explain"))  # reads sent by POST
    assert not changes_something(http("POST", "/admin/route-facts"))  # a router asks often
    assert not changes_something(http("GET", "/admin/status")) and not changes_something(http("POST", "/v1/completions"))
    assert not changes_something({"type": "websocket", "path": "/admin/pins"})


def test_a_write_given_a_wait_gives_up_after_it_and_the_busy_timeout_is_the_default_again(tmp_path):
    from kvctl.daemon.store import Store

    store = Store(tmp_path / "kvd.sqlite3")
    shell = sqlite3.connect(tmp_path / "kvd.sqlite3", isolation_level=None)
    shell.execute("BEGIN IMMEDIATE")
    try:
        with pytest.raises(StoreUnavailable) as refused:
            with store.write(wait=0.2) as conn:
                conn.execute("INSERT INTO audit (at, actor, tenant, action, target, result, detail) "
                             "VALUES (1, 'a', '-', 'x', '-', 'ok', '{}')")
        assert "database is locked: another process held its write lock for the 0 s this write waited" in str(
            refused.value)
        assert store.conn.execute("PRAGMA busy_timeout").fetchone() == (30_000,)  # for every other write
    finally:
        shell.execute("ROLLBACK")
    assert store.read_one("SELECT count(*) FROM audit WHERE action = 'x'") == (0,)


def test_a_write_given_a_wait_behind_another_of_kvd_s_writes_gives_up_and_a_close_leaves_that_one_be(tmp_path):
    """One of kvd's threads waits for another process's write lock (holding the writing
    connection); kvd's stop neither waits for it to write nor to close."""
    from kvctl.daemon.store import Store

    store = Store(tmp_path / "kvd.sqlite3")
    shell = sqlite3.connect(tmp_path / "kvd.sqlite3", isolation_level=None)
    shell.execute("BEGIN IMMEDIATE")
    outcomes = []

    def write_and_wait() -> None:
        try:
            with store.write():
                pass
            outcomes.append("written")
        except StoreUnavailable:
            outcomes.append("refused")
    waiting = threading.Thread(target=write_and_wait, daemon=True)
    try:
        store.conn.execute("PRAGMA busy_timeout=3000")
        waiting.start()
        settled(lambda: store.waiting_writes()[0], lambda n: n == 1)
        with pytest.raises(StoreUnavailable, match="another of kvd's writes held it for the 0 s this write could wait"):
            with store.write(wait=0.1):
                pass
        assert store.close(wait=0.1) is False  # the waiting write holds the connection: left to end with kvd
    finally:
        shell.execute("ROLLBACK")
    waiting.join(10)
    assert outcomes == ["written"]  # it began once the other process let go
    assert store.close(wait=1) is True


def test_kvd_s_stop_does_not_wait_out_the_busy_timeout_of_a_locked_store_and_logs_the_figures_it_could_not_store(
        tmp_path, caplog):
    """Before, the stop waited for each periodic job's write (up to 30 s each) and then for the
    rollout's last figures (30 s more) while another process held the store's write lock."""
    service = start_service(tmp_path, num_blocks=24)
    unix, _ = apps(service, token_table(tmp_path))
    body = {"policy": {"name": "any", "by": "request", "settings": {"reservation": "fixed:0"}}, "cohort": "50%"}
    assert call(unix, "POST", "/admin/rollouts", json=body).status_code == 200
    assert call(unix, "POST", "/v1/completions", json={"prompt": "hello", "max_tokens": 2}).status_code == 200
    shell = sqlite3.connect(tmp_path / "kvd.sqlite3", isolation_level=None)
    shell.execute("BEGIN IMMEDIATE")
    try:
        stopping = threading.Thread(target=service.shutdown, args=(1,))
        with caplog.at_level(logging.ERROR, logger="kvd"):
            stopping.start()
            stopping.join(20)  # the busy timeout is 30 s: the stop is not waiting it out
            assert not stopping.is_alive()
        assert "rollout 1: its figures at shutdown were not stored" in caplog.text
    finally:
        shell.execute("ROLLBACK")


def test_kvd_starts_while_another_process_holds_its_store_s_write_lock_and_drops_a_lapsed_pin_later(tmp_path):
    """Opening a store whose schema is current writes nothing, and a pin that lapsed while kvd was
    down leaves the store off the start's path: before, the start waited out the 30 s busy
    timeout opening the store, then failed (kvd exited with status 2)."""
    from kvctl.daemon.config import resolve
    from kvctl.daemon.server.metrics import Metrics
    from kvctl.daemon.server.service import EngineService
    from kvctl.daemon.store import Store

    path = tmp_path / "kvd.sqlite3"
    store = Store(path)
    store.save_pin({"pin_id": "lapsed-pin", "tenant": "default", "keys": "ab" * 32, "owner": "ops", "note": "",
                    "created_at": 1.0, "expires_at": 2.0})
    store.close()
    shell = sqlite3.connect(path, isolation_level=None)
    shell.execute("BEGIN IMMEDIATE")
    started: list = []
    try:
        def start() -> None:
            config = resolve({"state_dir": str(tmp_path), "socket": str(tmp_path / "kvd.sock"), "num_blocks": 24},
                             env={})
            service = EngineService(config, Store(path))
            service.metrics = Metrics(service)
            service.start()
            started.append(service)
        opener = threading.Thread(target=start, daemon=True)
        opener.start()
        opener.join(20)  # the busy timeout is 30 s: the start is not waiting it out
        assert started and started[0].ready.wait(20) and started[0].load_error is None
        assert started[0].store.read_one("SELECT count(*) FROM pins") == (1,)  # still locked: not dropped yet
    finally:
        shell.execute("ROLLBACK")
    try:
        assert settled(lambda: started[0].store.read_one("SELECT count(*) FROM pins"), lambda n: n == (0,),
                       timeout=40) == (0,)  # the lock let go: the waiting delete lands
        assert started[0].engine.cache.pins.all() == []
    finally:
        started[0].shutdown(1)


def test_kvctl_says_why_an_admin_call_waits_when_kvd_s_store_is_locked(tmp_path):
    """`kvctl drain` waited up to 30 s on a store another process held locked, without a word. After
    2 s it asks kvd (on a connection of its own) and says why it waits; the call then lands."""
    import os
    import signal
    import subprocess

    from .kvd_process import BIN, launch

    proc, client = launch(tmp_path / "state", tmp_path / "kvd.sock", tmp_path / "kvd.log", "--max-running", "4")
    try:
        shell = sqlite3.connect(tmp_path / "state" / "kvd.sqlite3", isolation_level=None)
        shell.execute("BEGIN IMMEDIATE")
        try:
            drain = subprocess.Popen([str(BIN / "kvctl"), "drain"], env={**os.environ, "KVD_SOCKET": str(tmp_path / "kvd.sock")},
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            time.sleep(4.0)
            assert drain.poll() is None  # still waiting for the store
        finally:
            shell.execute("ROLLBACK")
        out, err = drain.communicate(timeout=30)
        assert drain.returncode == 0, err
        assert err.startswith("note: kvd is waiting for its store's write lock (1 write waiting ")
        assert "another process holds it (a sqlite3 shell left in a transaction, a long kvctl db command?)" in err
        started = subprocess.run([str(BIN / "kvctl"), "resume"], env={**os.environ, "KVD_SOCKET": str(tmp_path / "kvd.sock")},
                                 capture_output=True, text=True, timeout=30)
        assert started.returncode == 0 and started.stderr == ""  # nothing waits: no note
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0


def test_the_waiting_note_names_each_replica_whose_store_waits():
    from kvctl.client import waiting_writes_note

    assert waiting_writes_note({"store": {"waiting_writes": 0}}) is None
    assert waiting_writes_note({"store": {"waiting_writes": 2, "longest_write_wait_seconds": 3.4}}).startswith(
        "note: kvd is waiting for its store's write lock (2 writes waiting 3 s): another process holds it")
    fleet = {"replica_status": [{"replica": "a", "store": {"waiting_writes": 0}},
                                {"replica": "b", "store": {"waiting_writes": 1, "longest_write_wait_seconds": 12.0}},
                                {"replica": "c", "error": "not reachable"}]}
    assert waiting_writes_note(fleet).startswith("note: kvd is waiting for its store's write lock (b: 1 write waiting "
                                                 "12 s): ")
