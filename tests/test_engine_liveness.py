"""kvd's /healthz says 503 once its engine thread has not come round its loop in 60 s (a kernel
that never returns, a deadlock), where it said ok while kvd served nothing: a Kubernetes liveness
probe restarts it, as systemd's watchdog does (engine_liveness.py)."""

from __future__ import annotations

import logging
import re
import threading
import time

import pytest

from kvctl.daemon.server.engine_liveness import EngineLoop


def test_the_loop_is_stalled_once_it_has_not_come_round_in_its_time_and_the_log_says_so_once():
    loop = EngineLoop()
    assert loop.stalled(1e9) is None and loop.to_log(1e9) is None  # not going round yet (loading): no stall
    loop.turned(100.0)
    assert loop.stalled(159.9) is None
    assert loop.stalled(160.0) == ("the engine has not come round its loop in 60 s (a step that does not end: a "
                                   "kernel that never returns, a deadlock): kvd serves nothing meanwhile")
    assert loop.to_log(161.0)[0] == "error" and loop.to_log(166.0) is None  # said once
    loop.turned(170.0)
    assert loop.to_log(171.0) == ("info", "the engine comes round its loop again") and loop.to_log(172.0) is None
    loop.stopped()
    assert loop.stalled(1e9) is None  # a loop that ended (kvd stops) is no stall


pytest.importorskip("torch")
pytest.importorskip("fastapi")


def test_healthz_and_readyz_say_503_while_a_step_does_not_end_and_ok_once_it_does(tmp_path, caplog):
    from kvctl.daemon.server.app import create_app

    from .daemon_fixtures import call, start_service

    service = start_service(tmp_path)
    try:
        app = create_app(service, service.metrics, front="unix")
        engine, real, release = service.engine, service.engine.step, threading.Event()

        def step():
            if engine.requests:
                release.wait(30)  # a kernel that does not return
            return real()

        engine.step = step
        service.engine_loop.after = 0.3
        answers = []
        asker = threading.Thread(target=lambda: answers.append(call(app, "POST", "/v1/completions", json={
            "prompt": "Hi", "max_tokens": 2})))
        asker.start()
        deadline = time.monotonic() + 10
        while call(app, "GET", "/healthz").status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        health, ready = call(app, "GET", "/healthz"), call(app, "GET", "/readyz")
        assert (health.status_code, health.json()["status"]) == (503, "engine_stalled")
        assert re.fullmatch(r"the engine has not come round its loop in \d+ s \(a step that does not end: a kernel "
                            r"that never returns, a deadlock\): kvd serves nothing meanwhile", health.json()["reason"])
        assert ready.status_code == 503 and ready.json()["reason"].startswith("the engine has not come round")
        with caplog.at_level(logging.INFO, logger="kvd"):
            service._say_engine_loop()  # (housekeeping's job, every 5 s)
            service._say_engine_loop()
            release.set()
            asker.join(30)
            assert answers[0].status_code == 200 and answers[0].json()["usage"]["completion_tokens"] == 2
            deadline = time.monotonic() + 10
            while call(app, "GET", "/healthz").status_code != 200 and time.monotonic() < deadline:
                time.sleep(0.05)
            service._say_engine_loop()
        said = [(r.levelname, r.getMessage()[:40]) for r in caplog.records if "round its loop" in r.getMessage()]
        assert said == [("ERROR", "the engine has not come round its loop i"),
                        ("INFO", "the engine comes round its loop again")]
        assert call(app, "GET", "/healthz").json() == {"status": "ok"}
        assert call(app, "GET", "/readyz").json() == {"ready": True}
    finally:
        service.shutdown(deadline=2)
