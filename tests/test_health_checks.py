"""kvctl check and the checks kvd and kvd router decide (daemon/server/health_checks.py): each check
from plain status data, kvd's and the router's `/admin/checks`, and kvctl's exit status over a
real Unix socket."""

from __future__ import annotations

import asyncio
import threading
from contextlib import contextmanager

import pytest

from kvctl.check_cmd import ask_until_ok
from kvctl.daemon.server.health_checks import (CRITICAL, OK, WARNING, fleet_report, identity, serving_check,
                                               status_checks, worst)
from kvctl.errors import KvdUnavailable

NOW = 1_800_000_000.0
SOFTWARE = {"kvd": "0.1.0", "python": "3.11.9", "torch": "2.13.0+cu128", "cuda": "12.8", "triton": "3.9.0",
            "tokenizers": "0.23.3", "llguidance": "1.9.1"}


def healthy(**changes) -> dict:
    status = {"software": dict(SOFTWARE),
              "model": {"name": "llama-8b", "revision": "a" * 64, "dtype": "torch.bfloat16", "max_model_len": 8192,
                        "chat_template": {"digest": "c" * 64}, "sampling_defaults": {"values": {}}},
              "cache": {"dtype": "fp8_e4m3", "uncalibrated": False, "scales_verified": True,
                        "scale_set": {"id": 7}},
              "step_failures": {"total": 0, "in_a_row": 0, "last_error": None, "last_at": None, "last_stopped": 0},
              "store": {"file_ok": True, "audit_write_failures": 0, "failing_jobs": [], "unstored_rollback": None},
              "tiers": {"host": {"health": "ok"}, "disk": {"health": "ok"}},
              "tls": {"subject": "CN=kvd", "days_left": 80.0, "warning": None},
              "stranded_pins": 0, "last_reload": {"result": "ok", "error": None}, "weights_updated": None,
              "responses": {"file": {"failed_writes": 0}}}
    status.update(changes)
    return status


def described(checks) -> list[tuple[str, str, str]]:
    return [(c.name, c.status, c.detail) for c in checks]


def test_a_healthy_kvd_passes_every_check_it_has_and_an_older_kvd_is_checked_on_what_it_says():
    assert described(status_checks(healthy(), NOW)) == [
        ("engine", OK, "no step failed"),
        ("cache scales", OK, "fp8_e4m3, scale set 7 loaded and read"),
        ("store", OK, "writable, every record taken"),
        ("tiers", OK, "host, disk healthy"),
        ("tls", OK, "CN=kvd, 80 days left"),
        ("pins", OK, "every pin is reachable")]
    assert [c.name for c in status_checks({}, NOW)] == ["engine", "cache scales", "store"]  # says nothing more
    assert worst([]) == OK and worst([{"status": OK}, {"status": CRITICAL}, {"status": WARNING}]) == CRITICAL


def test_each_trouble_is_its_check_s_warning_or_critical_with_what_to_run():
    failed = {"total": 3, "in_a_row": 0, "last_error": "RuntimeError: CUDA out of memory", "last_at": NOW - 300,
              "last_stopped": 2}
    found = status_checks(healthy(
        step_failures=failed,
        cache={"dtype": "int8", "uncalibrated": True, "scales_verified": None, "scale_set": None},
        store={"file_ok": True, "audit_write_failures": 2, "failing_jobs": ["pin expiry"], "unstored_rollback": 4},
        tiers={"host": {"health": "ok"}, "remote": {"health": "down"}},
        tls={"subject": "CN=kvd", "days_left": 3.0, "warning": "ssl_certfile: the certificate expires soon"},
        stranded_pins=2, last_reload={"result": "refused", "error": "max_queue: must be a positive integer, got 0"},
        weights_updated={"model_path": "/models/llama-8b-r2", "revision": "b" * 64},
        responses={"file": {"failed_writes": 5}}), NOW)
    assert described(found) == [
        ("engine", WARNING, "3 steps failed, the latest 5 min ago (RuntimeError: CUDA out of memory); kvd's log has "
                            "each traceback"),
        ("cache scales", WARNING, "int8 on unit scales (no calibration applied); `kvctl calibrate --apply` measures "
                                  "and loads them"),
        ("store", WARNING, "2 audit records the store did not take (kvd's log has each); housekeeping failing: pin "
                           "expiry; rollout 4's rollback is not in the store yet"),
        ("tiers", WARNING, "remote down: prefixes there are computed again; `kvctl tiers` says more"),
        ("tls", WARNING, "ssl_certfile: the certificate expires soon"),
        ("pins", WARNING, "2 pins no request reaches any more hold blocks; `kvctl pins` marks them, `kvctl unpin "
                          "--stranded` lets them go"),
        ("config", WARNING, "the latest reload was refused, kvd runs on its earlier settings: max_queue: must be a "
                            "positive integer, got 0"),
        ("weights", WARNING, "serves /models/llama-8b-r2 (revision bbbbbbbbbbbb), swapped in at run time: a restart "
                             "serves the configured model again"),
        ("responses file", WARNING, "5 writes to responses_store_file did not land; `kvctl responses` says more")]
    worse = status_checks(healthy(step_failures={**failed, "last_at": NOW - 7200},
                                  cache={"dtype": "int8", "scales_verified": False, "uncalibrated": False},
                                  store={"file_ok": False},
                                  tls={"subject": "CN=kvd", "days_left": -1.0, "warning": "expired"}), NOW)
    assert [(c.name, c.status) for c in worse][:3] == [("engine", OK), ("cache scales", CRITICAL), ("store", CRITICAL)]
    assert worse[0].detail.startswith("3 steps failed, the latest 2.0 h ago")  # said, but no longer a warning
    assert ("tls", CRITICAL) in [(c.name, c.status) for c in worse]


def test_serving_is_critical_unless_an_operator_drained_it_or_put_it_to_sleep():
    assert (serving_check(None, False, False).status, serving_check(None, False, False).detail) == \
        (OK, "takes completions")
    drained = serving_check("draining (kvctl resume takes completions again)", True, False)
    assert (drained.status, drained.detail) == (WARNING, "draining (kvctl resume takes completions again)")
    assert serving_check("asleep at level 1", False, True).status == WARNING
    assert serving_check("loading the model", False, False).status == CRITICAL


def test_the_fleet_report_names_each_replica_s_checks_a_silent_replica_and_where_the_rest_differ():
    def report(status: dict) -> dict:
        checks = [c.describe() for c in status_checks(status, NOW)]
        return {"status": worst(checks), "checks": checks, "identity": identity(status)}

    upgraded = healthy(software={**SOFTWARE, "kvd": "0.2.0"})
    answers = [("kvd-0", 200, report(healthy())), ("kvd-1", 200, report(upgraded)),
               ("kvd-2", None, {"error": "ConnectError: refused"}), ("kvd-3", 200, report(healthy(stranded_pins=1))),
               ("kvd-4", 404, {"detail": "Not Found"}), ("kvd-5", 503, {"error": {"message": "engine_stalled"}})]
    router = {"replicas": [{"replica": "kvd-0", "view": {"synced": True}}, {"replica": "kvd-3", "draining": "drained"},
                           {"replica": "kvd-1", "draining": "at the replica",
                            "failing": {"failed_in_a_row": 3, "seconds_left": 4.5},
                            "view": {"synced": False, "feed_error": "ReadTimeout"}}],
              "tls": {"subject": "CN=router", "days_left": 9.0, "warning": "expires in 9.0 days"}}
    fleet = fleet_report(answers, router)
    assert fleet["status"] == CRITICAL
    rows = [(c["check"], c["status"]) for c in fleet["checks"]]
    assert rows[:6] == [("kvd-0: engine", OK), ("kvd-0: cache scales", OK), ("kvd-0: store", OK),
                        ("kvd-0: tiers", OK), ("kvd-0: tls", OK), ("kvd-0: pins", OK)]
    assert ("kvd-2: answers", CRITICAL) in rows and ("kvd-3: pins", WARNING) in rows
    assert rows[-5:] == [("fleet: differ in kvd version", WARNING), ("kvd-3: drained at the router", WARNING),
                         ("kvd-1: passed over", WARNING), ("kvd-1: router view", WARNING), ("router: tls", WARNING)]
    by_name = {c["check"]: c["detail"] for c in fleet["checks"]}
    assert by_name["kvd-2: answers"] == "does not answer its checks: ConnectError: refused"
    assert by_name["kvd-4: answers"] == "an older kvd, which has no checks: `kvctl status` there shows its state"
    assert by_name["kvd-5: answers"] == "does not answer its checks: 503: engine_stalled"
    assert ("kvd-4: answers", WARNING) in rows and ("kvd-5: answers", CRITICAL) in rows
    assert by_name["fleet: differ in kvd version"] == (
        "0.1.0 on kvd-0, kvd-3; 0.2.0 on kvd-1 (a request may take other tokens on each, seeded or greedy)")
    assert by_name["kvd-3: drained at the router"] == (
        "drained: takes no new request; `kvctl fleet resume kvd-3` takes it back")
    assert by_name["kvd-1: passed over"] == (
        "its latest 3 answers were failures of its own: the router asks it again in 4.5 s")
    assert by_name["kvd-1: router view"] == (
        "the router does not follow its event feed (ReadTimeout): each request asks it instead, on the request's "
        "path")
    calm = fleet_report([("kvd-0", 200, report(healthy())), ("kvd-1", 200, report(healthy()))], {"replicas": []})
    assert calm["status"] == OK and not any(c["check"].startswith("fleet") for c in calm["checks"])


def test_checks_ignored_by_name_leave_the_status_to_the_rest():
    from kvctl.check_cmd import ignoring

    report = {"status": CRITICAL, "replicas": 2, "checks": [
        {"check": "kvd-0: pins", "status": WARNING, "detail": "1 stranded"},
        {"check": "kvd-1: pins", "status": WARNING, "detail": "2 stranded"},
        {"check": "kvd-1: store", "status": CRITICAL, "detail": "replaced"},
        {"check": "fleet: differ in checkpoint revision", "status": WARNING, "detail": "a canary"}]}
    assert ignoring(report, []) is report
    assert ignoring(report, ["pins"]) == {**report, "checks": report["checks"][2:], "ignored": 2}
    calm = ignoring(report, ["pins", "kvd-1: store", "fleet: differ in checkpoint revision"])
    assert (calm["status"], calm["checks"], calm["ignored"]) == (OK, [], 4)
    assert ignoring(report, ["kvd-1: pins", "kvd-1: store"])["status"] == WARNING  # kvd-0's pins and the fleet's


def test_identity_is_what_the_fleet_compares_and_nothing_else():
    status = healthy()
    compared = {k: v for k, v in SOFTWARE.items() if k not in ("python", "cuda")}  # (torch's build names its CUDA)
    assert identity(status) == {"software": compared,
                                "model": {"name": "llama-8b", "revision": "a" * 64, "dtype": "torch.bfloat16",
                                          "max_model_len": 8192, "chat_template": {"digest": "c" * 64},
                                          "sampling_defaults": {"values": {}}},
                                "cache": {"dtype": "fp8_e4m3"}}
    assert identity({}) == {}


def test_kvctl_asks_until_every_check_is_ok_or_its_wait_is_over():
    now = [0.0]
    loading = {"status": CRITICAL, "checks": [{"check": "serving", "status": CRITICAL, "detail": "loading the model"},
                                              {"check": "engine", "status": OK, "detail": "no step failed"}]}
    answers = iter([KvdUnavailable("kvd is not reachable at /run/kvd/kvd.sock"), loading, loading,
                    {"status": OK, "checks": []}])

    def ask():
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    def sleep(seconds):
        now[0] += seconds

    lines = []
    report, asked = ask_until_ok(ask, wait=10, clock=lambda: now[0], sleep=sleep, waiting=lines.append)
    assert (report["status"], asked, now[0]) == (OK, 4, 3.0)
    assert lines == ["waiting (10 s left): kvd critical: kvd is not reachable at /run/kvd/kvd.sock",
                     "waiting (9 s left): serving critical: loading the model"]  # said again only when it changes
    answers = iter([KvdUnavailable("kvd is not reachable at /run/kvd/kvd.sock")] * 5)
    report, asked = ask_until_ok(ask, wait=2.5, clock=lambda: now[0], sleep=sleep)
    assert asked == 3 and report == {"status": CRITICAL, "checks": [
        {"check": "kvd", "status": CRITICAL, "detail": "kvd is not reachable at /run/kvd/kvd.sock"}]}
    answers = iter([{"status": WARNING, "checks": []}])
    assert ask_until_ok(ask, wait=0, clock=lambda: now[0], sleep=sleep) == ({"status": WARNING, "checks": []}, 1)


# ---- over a real socket ------------------------------------------------------------------------
@contextmanager
def served_on(app, path: str):
    """`app` on a Unix socket at `path`, served by uvicorn in a thread of its own."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, uds=path, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=asyncio.run, args=(server.serve(),), daemon=True)
    thread.start()
    try:
        for _ in range(500):
            if server.started:
                break
            threading.Event().wait(0.01)
        assert server.started
        yield path
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.fixture
def kvd(tmp_path):
    pytest.importorskip("torch")
    from kvctl.daemon.server.app import create_app

    from .daemon_fixtures import start_service

    service = start_service(tmp_path, num_blocks=64)
    try:
        yield service, create_app(service, service.metrics, front="unix")
    finally:
        service.shutdown(deadline=2)


def test_kvctl_check_at_kvd_exits_0_when_fit_1_while_drained_and_2_when_unreachable(kvd, tmp_path, capsys):
    from .daemon_fixtures import call
    from .test_cli import cli

    service, app = kvd
    body = call(app, "GET", "/admin/checks").json()
    assert body["status"] == OK and [c["check"] for c in body["checks"]] == [
        "serving", "engine", "cache scales", "store", "pins"]
    assert body["identity"]["model"]["name"] == service.model_name
    with served_on(app, str(tmp_path / "kvd-check.sock")) as path:
        status, out, _ = cli(capsys, "--socket", path, "check")
        assert status == 0 and " ".join(out.split()).endswith(f"kvd at {path}: OK")
        assert "cache scales ok float32: not quantised, no scales" in " ".join(out.split())
        assert call(app, "POST", "/admin/drain", json={}).status_code == 200
        status, out, _ = cli(capsys, "--socket", path, "check", "--json")
        report = __import__("json").loads(out)
        assert status == 1 and report["status"] == WARNING
        assert report["checks"][0] == {"check": "serving", "status": WARNING,
                                       "detail": "draining (kvctl resume takes completions again)"}
        status, out, _ = cli(capsys, "--socket", path, "check", "--ignore", "serving")
        assert status == 0 and " ".join(out.split()).endswith(f"kvd at {path}: OK (1 ignored)")
        assert call(app, "POST", "/admin/drain", json={"drain": False}).status_code == 200
    status, out, _ = cli(capsys, "--socket", str(tmp_path / "gone.sock"), "check")
    assert status == 2 and "kvd at" in out and "CRITICAL (1 critical)" in " ".join(out.split())
    status, _, err = cli(capsys, "--socket", str(tmp_path / "gone.sock"), "check", "--wait", "-1")
    assert status == 2 and err.strip() == "error: wait: must be 0 or more seconds, got -1"


def test_kvctl_check_at_the_router_is_critical_for_a_replica_that_does_not_answer(kvd, tmp_path, capsys):
    from .test_cli import cli
    from .test_router import router_app

    _, app = kvd
    router, front = router_app([app, app], "round_robin", down=(1,))
    with served_on(front, str(tmp_path / "router-check.sock")) as path:
        status, out, _ = cli(capsys, "--socket", path, "check", "--json")
    report = __import__("json").loads(out)
    assert status == 2 and report["status"] == CRITICAL and report["replicas"] == 2
    rows = {c["check"]: (c["status"], c["detail"]) for c in report["checks"]}
    assert rows["replica-0: serving"] == (OK, "takes completions")
    assert rows["replica-1: answers"][0] == CRITICAL and "connection refused" in rows["replica-1: answers"][1]
    assert not any(name.startswith("fleet:") for name in rows)  # one replica answered: nothing to compare
    with served_on(front, str(tmp_path / "router-check.sock")) as path:
        status, out, _ = cli(capsys, "--socket", path, "check")
    assert status == 2 and " ".join(out.split()).endswith(
        f"kvd router at {path} (2 replicas): CRITICAL (1 critical)")


def test_a_kvd_still_loading_is_critical_and_says_so(tmp_path):
    pytest.importorskip("torch")
    from kvctl.daemon.config import resolve
    from kvctl.daemon.server.health_checks import kvd_report
    from kvctl.daemon.server.service import EngineService
    from kvctl.daemon.store import Store

    config = resolve({"state_dir": str(tmp_path), "socket": str(tmp_path / "kvd.sock"), "num_blocks": 64}, env={})
    service = EngineService(config, Store(tmp_path / "kvd.sqlite3"))  # not started: its model is not loaded
    assert kvd_report(service) == {"status": CRITICAL, "identity": None, "checks": [
        {"check": "serving", "status": CRITICAL, "detail": "loading the model"}]}
    service.load_error = "model: no config.json in /models/missing"
    assert kvd_report(service)["checks"][0]["detail"] == "model: no config.json in /models/missing"


def test_a_real_kvd_s_status_feeds_its_checks_a_quantised_cache_on_unit_scales_and_its_tiers(tmp_path):
    pytest.importorskip("torch")
    from kvctl.daemon.server.app import create_app

    from .daemon_fixtures import call, start_service

    service = start_service(tmp_path, num_blocks=64, cache_dtype="fp8_e4m3", allow_uncalibrated=True,
                            host_cache_bytes="1MiB", disk_cache_bytes="4MiB", disk_cache_path=str(tmp_path / "disk"))
    try:
        report = call(create_app(service, service.metrics, front="unix"), "GET", "/admin/checks").json()
    finally:
        service.shutdown(deadline=2)
    assert report["status"] == WARNING
    assert {c["check"]: (c["status"], c["detail"]) for c in report["checks"]} == {
        "serving": (OK, "takes completions"), "engine": (OK, "no step failed"),
        "cache scales": (WARNING, "fp8_e4m3 on unit scales (no calibration applied); `kvctl calibrate --apply` "
                                  "measures and loads them"),
        "store": (OK, "writable, every record taken"), "tiers": (OK, "host, disk healthy"),
        "pins": (OK, "every pin is reachable")}
    assert report["identity"]["cache"] == {"dtype": "fp8_e4m3"}


def test_kvctl_check_at_a_router_that_follows_no_replica_s_feed_warns_of_each(kvd, tmp_path, capsys):
    """An events-view router whose followers do not run (as before its first snapshot) has a view of
    no replica: each is a warning, the rest of the replica's checks as they are."""
    from .test_cli import cli
    from .test_router import router_app

    _, app = kvd
    _, front = router_app([app], "prefix", view="events")
    with served_on(front, str(tmp_path / "router-events.sock")) as path:
        status, out, _ = cli(capsys, "--socket", path, "check", "--json")
    report = __import__("json").loads(out)
    assert status == 1 and report["status"] == WARNING
    assert [c for c in report["checks"] if c["status"] != OK] == [
        {"check": "replica-0: router view", "status": WARNING,
         "detail": "the router does not follow its event feed: each request asks it instead, on the request's path"}]
