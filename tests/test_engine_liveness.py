"""kvd's /healthz says 503 once its engine thread has not come round its loop in 60 s (a kernel
that never returns, a deadlock), where it said ok while kvd served nothing: a Kubernetes liveness
probe restarts it, as systemd's watchdog does (engine_liveness.py)."""

from __future__ import annotations

import contextlib
import logging
import re
import threading
import time

import pytest

from kvctl.daemon.server.engine_liveness import EngineLoop

from .promql_eval import samples


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


def test_a_wait_for_the_engines_lock_ends_once_the_engine_stalls_or_the_wait_is_over():
    from kvctl.daemon.server.engine_liveness import take_unless_stalled

    lock, loop = threading.Condition(threading.RLock()), EngineLoop(after=0.3)
    held, release = threading.Event(), threading.Event()

    def step():  # a step that holds the lock past the stall
        with lock:
            held.set()
            release.wait(30)

    holder = threading.Thread(target=step)
    loop.turned()
    holder.start()
    held.wait(10)
    began = time.monotonic()
    assert take_unless_stalled(lock, loop, wait=0.1, look=0.05) is False  # the wait is over
    assert 0.1 <= time.monotonic() - began < 0.3
    assert take_unless_stalled(lock, loop, look=0.05) is False  # no wait given: until the stall, at 0.3 s
    assert 0.3 <= time.monotonic() - began < 2 and loop.stalled() is not None
    release.set()
    holder.join(10)
    assert take_unless_stalled(lock, loop) is True  # stalled still, but the lock is free: taken
    lock.release()
    loop.turned()
    assert take_unless_stalled(lock, loop, wait=0.1) is True
    lock.release()


pytest.importorskip("torch")
pytest.importorskip("fastapi")


def stall_steps(service) -> threading.Event:
    """From now, a step with requests waits (as a kernel that does not return) until the event
    returned is set; the engine counts as stalled after 0.3 s, not 60."""
    engine, real, release = service.engine, service.engine.step, threading.Event()

    def step():
        if engine.requests:
            release.wait(30)
        return real()

    engine.step = step
    service.engine_loop.after = 0.3
    return release


def test_healthz_and_readyz_say_503_while_a_step_does_not_end_and_ok_once_it_does(tmp_path, caplog):
    from kvctl.daemon.server.app import create_app

    from .daemon_fixtures import call, start_service

    service = start_service(tmp_path)
    try:
        app = create_app(service, service.metrics, front="unix")
        release = stall_steps(service)
        answers = []
        asker = threading.Thread(target=lambda: answers.append(call(app, "POST", "/v1/completions", json={
            "prompt": "Hi", "max_tokens": 2, "ignore_eos": True})))
        asker.start()
        deadline = time.monotonic() + 10
        while call(app, "GET", "/healthz").status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        health, ready = call(app, "GET", "/healthz"), call(app, "GET", "/readyz")
        assert (health.status_code, health.json()["status"]) == (503, "engine_stalled")
        began = time.monotonic()
        scraped = call(app, "GET", "/metrics")  # answered at once, without the engine's figures, saying why
        assert scraped.status_code == 200 and time.monotonic() - began < 3
        stalled = samples(scraped.text)
        assert stalled["kvd_engine_stalled"] == {frozenset(): 1.0}
        assert stalled["kvd_metrics_engine_figures_missed_total"] == {frozenset(): 1.0}
        assert "kvd_blocks" not in stalled and "kvd_queue_age_seconds" not in stalled
        assert re.fullmatch(r"the engine has not come round its loop in \d+ s \(a step that does not end: a kernel "
                            r"that never returns, a deadlock\): kvd serves nothing meanwhile", health.json()["reason"])
        assert ready.status_code == 503 and ready.json()["reason"].startswith("the engine has not come round")
        for path in ("/admin/status", "/admin/requests", "/admin/tenants", "/admin/prefixes"):  # operator views
            began = time.monotonic()
            view = call(app, "GET", path)
            assert view.status_code == 503 and time.monotonic() - began < 3, path
            assert re.fullmatch(r"the engine has not come round its loop in \d+ s \(.*\): kvd serves nothing "
                                r"meanwhile; this question waits for it: ask again once /healthz says ok",
                                view.json()["error"]["message"]), path
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
        again = samples(call(app, "GET", "/metrics").text)
        assert again["kvd_engine_stalled"] == {frozenset(): 0.0}
        assert again["kvd_metrics_engine_figures_missed_total"] == {frozenset(): 1.0}
        assert {"kvd_blocks", "kvd_queue_age_seconds"} <= set(again)  # the engine's figures, back
    finally:
        service.shutdown(deadline=2)


def test_once_the_stall_is_seen_the_log_says_what_the_step_computes_and_where_the_engine_thread_stands(
        tmp_path, caplog):
    """Where a step is stuck is the first thing an operator (or a bug report) needs: the log names
    the step's requests and the engine thread's stack, never a prompt's text or ids."""
    import dataclasses

    from kvctl.daemon.server.app import create_app

    from .daemon_fixtures import call, start_service

    service = start_service(tmp_path)
    model, release = service.engine.model, threading.Event()
    real_forward = model.forward

    def kernel_that_never_returns(*args, **kwargs):
        release.wait(30)
        return real_forward(*args, **kwargs)

    exits = []
    service.on_stall_exit = lambda: exits.append(service.stall_exit)
    try:
        app = create_app(service, service.metrics, front="unix")
        model.forward, service.engine_loop.after = kernel_that_never_returns, 0.3
        answers = []
        asker = threading.Thread(target=lambda: answers.append(call(app, "POST", "/v1/completions", json={
            "prompt": "the secret plan", "max_tokens": 2, "ignore_eos": True})))
        asker.start()
        deadline = time.monotonic() + 10
        while service.engine_loop.stalled() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        [request_id] = list(service.engine.requests)
        prompt_tokens = len(service.engine.requests[request_id].prompt_ids)
        with caplog.at_level(logging.INFO, logger="kvd"):
            service._say_engine_loop()
            service._say_engine_loop()  # (said once)
        [stuck] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("the engine thread is stuck")]
        head, *frames = stuck.split("\n  ")
        assert head == (f"the engine thread is stuck in a step of 1 sequence: {request_id} (tenant default, "
                        f"{prompt_tokens} tokens of prefill); where it stands (innermost last):")
        at = next(i for i, f in enumerate(frames) if f.endswith(" in kernel_that_never_returns"))
        assert "tests/test_engine_liveness.py:" in frames[at]
        assert frames[at + 1:] and all(re.search(r"threading\.py:\d+ in wait$", f) for f in frames[at + 1:])
        assert any(f.startswith("daemon/engine/engine.py:") and f.endswith(" in step") for f in frames[:at])
        # (no token id either; the request's id, 12 random hex digits, holds "256" about 1 run in 400, as one did)
        assert "secret" not in stuck and str(service.loaded.tokenizer.encode("the secret plan")[0]) not in \
            head.replace(request_id, "")
        service.config = dataclasses.replace(service.config, engine_stall_exit_seconds=0.3)  # (>= 60 in a config)
        service._say_engine_loop()
        [record] = service.store.audit_since(action="exit")
        assert record["detail"]["step"] == head.removeprefix("the engine thread is stuck ").removesuffix(
            "; where it stands (innermost last):")
        assert record["detail"]["stuck_at"] == frames[-4:]
    finally:
        release.set()
        asker.join(30)
        service.shutdown(deadline=2)
    assert len(exits) == 1 and answers[0].status_code == 200  # (in-process: the step ended, and kvd stopped)
    assert service.engine.stepping is None  # a step that ended computes nothing: a later stall names no stale one


def test_a_scrape_waits_for_a_long_step_only_so_long_and_answers_without_the_engines_figures(tmp_path,
                                                                                             monkeypatch):
    from kvctl.daemon.server import engine_liveness
    from kvctl.daemon.server.app import create_app

    from .daemon_fixtures import a_long_step, call, start_service

    service = start_service(tmp_path, metrics_aliases="vllm")
    try:
        app = create_app(service, service.metrics, front="unix")
        assert "vllm:num_requests_running" in samples(call(app, "GET", "/metrics").text)
        monkeypatch.setattr(engine_liveness, "SCRAPE_LOCK_WAIT_S", 1.0)
        with a_long_step(service):  # not long enough to be a stall
            began = time.monotonic()
            scraped = call(app, "GET", "/metrics")
            waited = time.monotonic() - began
        # one wait for the scrape, shared by kvd's collector and the aliases' (each its own: 2 s)
        assert scraped.status_code == 200 and 1.0 <= waited < 1.8
        missed = samples(scraped.text)
        assert missed["kvd_engine_stalled"] == {frozenset(): 0.0}
        assert missed["kvd_metrics_engine_figures_missed_total"] == {frozenset(): 1.0}
        assert not {"kvd_blocks", "vllm:num_requests_running"} & set(missed)
        assert ("# HELP kvd_metrics_engine_figures_missed_total Scrapes answered without the engine's figures: its "
                "lock, which a step holds, was not had in 1 s") in scraped.text
        after = samples(call(app, "GET", "/metrics").text)
        assert after["kvd_metrics_engine_figures_missed_total"] == {frozenset(): 1.0}
        assert {"kvd_blocks", "vllm:num_requests_running"} <= set(after)
    finally:
        service.shutdown(deadline=2)


NOTHING_CHANGED = r"the engine has not come round its loop in \d+ s \(.*\): kvd serves nothing meanwhile; nothing " \
                  r"was changed: ask again once /healthz says ok"
QUESTION_WAITS = r"the engine has not come round its loop in \d+ s \(.*\): kvd serves nothing meanwhile; this " \
                 r"question waits for it: ask again once /healthz says ok"
NOT_STARTED = r"the engine has not come round its loop in \d+ s \(.*\): kvd serves nothing meanwhile; this " \
              r"completion was not started: send it again \(to another replica, or here once /healthz says ok\)"


def test_completions_and_the_operators_changes_are_refused_while_the_engine_is_stalled_and_nothing_changes(
        tmp_path, caplog):
    """A completion sent to a stalled kvd waited until its client gave up (or kvd exited), and an
    operator's change (pin, unpin, evict, cancel, drain, reload) until kvctl's 120 s timeout,
    holding an admin slot: each is now refused at once, having changed nothing, and the audit log
    keeps each refusal (what was tried during the incident, by whom)."""
    import dataclasses

    from kvctl.daemon.server.app import create_app

    from .daemon_fixtures import call, start_service

    service = start_service(tmp_path)
    try:
        app = create_app(service, service.metrics, front="unix")
        pin = call(app, "POST", "/admin/pins", json={"text": "a system prompt that stays " * 4}).json()
        rollout = call(app, "POST", "/admin/rollouts", json={
            "policy": {"name": "reserve-p95", "settings": {"reservation": "p95"}}, "cohort": "10%"}).json()
        release = stall_steps(service)
        service.engine_loop.after = 1.5  # time to hand a completion in before the stall is seen
        answers = {}

        def ask(name, prompt):
            answers[name] = call(app, "POST", "/v1/completions", json={"prompt": prompt, "max_tokens": 2,
                                                                       "ignore_eos": True})

        stuck = threading.Thread(target=ask, args=("stuck", "Hi"))
        stuck.start()
        deadline = time.monotonic() + 10
        while not service.engine.requests and time.monotonic() < deadline:  # its step has begun, and holds
            time.sleep(0.01)
        handed = threading.Thread(target=ask, args=("handed", "Hello"))
        handed.start()
        while service.inbox_size() == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert service.engine_loop.stalled() is None and service.inbox_size() == 1  # it waits for the stuck step
        while service.engine_loop.stalled() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        began = time.monotonic()
        sent = call(app, "POST", "/v1/completions", json={"prompt": "Hey", "max_tokens": 2})
        assert sent.status_code == 503 and time.monotonic() - began < 2
        assert sent.headers["retry-after"] == "5" and sent.json()["error"]["code"] == "engine_stalled"
        assert re.fullmatch(NOT_STARTED, sent.json()["error"]["message"])
        with caplog.at_level(logging.INFO, logger="kvd"):
            service._say_engine_loop()  # (housekeeping's job, every 5 s): what was handed in is refused
        handed.join(10)
        assert answers["handed"].status_code == 503 and answers["handed"].json()["error"]["code"] == "engine_stalled"
        assert service.inbox_size() == 0
        assert ("1 completions handed in as the engine stalled refused (503 engine_stalled): nothing would start "
                "them") in caplog.messages
        scraped = samples(call(app, "GET", "/metrics").text)  # (the one sent, the one handed in)
        assert scraped["kvd_requests_refused_total"] == {frozenset({("reason", "engine_stalled")}): 2.0,
                                                         frozenset({("reason", "draining")}): 0.0,
                                                         frozenset({("reason", "asleep")}): 0.0}
        service.config_source = lambda: dataclasses.replace(service.config, max_queue=7)
        changes = [("POST", "/admin/pins", {"text": "another prompt to pin " * 4}),
                   ("DELETE", f"/admin/pins/{pin['pin_id']}", None), ("POST", "/admin/evict", {"all_unpinned": True}),
                   ("POST", "/admin/cancel", {"tenant": "default"}), ("POST", "/admin/drain", {"drain": True}),
                   ("POST", "/admin/reload", None), ("POST", "/admin/wake", {}),
                   ("POST", f"/admin/rollouts/{rollout['id']}/complete", None),
                   ("POST", "/admin/calibrate", {"dtype": "int8"})]
        questions = [("GET", "/admin/pins", None), ("GET", "/admin/tiers", None),
                     ("GET", "/admin/events/snapshot", None), ("POST", "/admin/route-facts", {"tokens": [5, 6, 7]}),
                     ("POST", "/admin/explain", {"tokens": [5, 6, 7]})]
        for (method, path, body), said in [(c, NOTHING_CHANGED) for c in changes] + [(q, QUESTION_WAITS)
                                                                                      for q in questions]:
            began = time.monotonic()
            refused = call(app, method, path, **({} if body is None else {"json": body}))
            assert refused.status_code == 503 and time.monotonic() - began < 2, (path, refused.text)
            assert refused.json()["error"]["code"] == "engine_stalled", path
            assert re.fullmatch(said, refused.json()["error"]["message"]), (path, refused.json())
        assert service.reloads["refused"] == 1 and service.store.audit_since(0, action="reload")[0]["result"] == (
            "refused")
        release.set()
        stuck.join(30)
        # nothing was changed: the stuck request was not cancelled, the pin stands, kvd is not draining
        assert answers["stuck"].status_code == 200 and answers["stuck"].json()["usage"]["completion_tokens"] == 2
        assert [p["pin_id"] for p in call(app, "GET", "/admin/pins").json()["pins"]] == [pin["pin_id"]]
        assert not service.draining and service.config.max_queue == 256
        audited = [a for a in reversed(service.store.audit_since(0)) if a["action"] in (
            "pin", "unpin", "evict", "cancel", "drain", "wake", "rollout.complete", "calibrate")]
        assert [(a["actor"], a["tenant"], a["action"], a["target"], a["result"]) for a in audited] == [
            ("unix-socket", "default", "pin", pin["pin_id"], "ok"), ("unix-socket", "default", "pin", "-", "refused"),
            ("unix-socket", "default", "unpin", pin["pin_id"], "refused"),
            ("unix-socket", "default", "evict", "all_unpinned", "refused"),
            ("unix-socket", "default", "cancel", "tenant=default", "refused"),
            ("unix-socket", "default", "drain", "completions", "refused"),
            ("unix-socket", "default", "wake", "memory", "refused"),
            ("unix-socket", "-", "rollout.complete", f"rollout:{rollout['id']}", "refused"),
            ("unix-socket", "-", "calibrate", "-", "refused")]
        assert all(re.fullmatch(NOTHING_CHANGED, a["detail"]["error"]) for a in audited[1:])
        asked = call(app, "GET", "/admin/audit", params={"result": "refused", "tenant": "-"}).json()["entries"]
        assert [a["action"] for a in asked] == ["calibrate", "rollout.complete", "reload"]  # (newest first)
        assert (audited[6]["detail"]["tags"], audited[8]["detail"]["dtype"]) == (["kv_cache", "weights"], "int8")
        assert service.rollouts.status(rollout["id"])["state"] == "running"
        assert call(app, "POST", "/v1/completions", json={"prompt": "Hey", "max_tokens": 2}).status_code == 200
    finally:
        service.shutdown(deadline=2)


@contextlib.contextmanager
def a_stuck_request(tmp_path):
    """A kvd whose engine stalls on the request sent as this begins (stall_steps); yields
    (service, exits): the reasons of the stall exits asked of it (on_stall_exit). On the way out
    the step ends, and kvd stops."""
    from kvctl.daemon.server.app import create_app

    from .daemon_fixtures import call, start_service

    service = start_service(tmp_path)
    release = stall_steps(service)
    exits = []
    service.on_stall_exit = lambda: exits.append(service.stall_exit)
    app = create_app(service, service.metrics, front="unix")
    asker = threading.Thread(target=lambda: call(app, "POST", "/v1/completions", json={"prompt": "Hi",
                                                                                      "max_tokens": 2}))
    try:
        asker.start()
        yield service, exits
    finally:
        release.set()
        asker.join(30)
        service.shutdown(deadline=2)  # (in-process, nothing ended it: the step ends, and so does the stop)


def test_kvd_exits_once_its_engine_has_been_stalled_past_engine_stall_exit_seconds(tmp_path, caplog):
    import dataclasses

    with a_stuck_request(tmp_path) as (service, exits):
        service.config = dataclasses.replace(service.config, engine_stall_exit_seconds=0.0)  # never
        deadline = time.monotonic() + 10
        while (service.engine_loop.idle_seconds() or 0) < 1.0 and time.monotonic() < deadline:
            time.sleep(0.05)
        service._say_engine_loop()
        assert exits == [] and service.stall_exit is None  # 0: kvd never exits by itself
        service.config = dataclasses.replace(service.config, engine_stall_exit_seconds=1.5)  # (>= 60 in a config)
        service._say_engine_loop()
        assert exits == []  # stalled 1 s: not yet
        while service.engine_loop.idle_seconds() < 1.5 and time.monotonic() < deadline:
            time.sleep(0.05)
        with caplog.at_level(logging.INFO, logger="kvd"):
            service._say_engine_loop()
            service._say_engine_loop()  # (the process ends at the first; it is asked once)
        assert len(exits) == 1 and re.fullmatch(r"the engine has not come round its loop in \d+ s \(.*\): kvd serves "
                                                r"nothing meanwhile", exits[0])
        [said] = [r for r in caplog.records if r.levelname == "CRITICAL"]
        assert said.getMessage() == (exits[0] + "; after engine_stall_exit_seconds (1.5 s) kvd exits (code 75) for "
                                     "its service manager to start it again: its requests in flight are lost")
        [record] = service.store.audit_since(action="exit")
        assert {k: record[k] for k in ("actor", "target", "result")} == {
            "actor": "kvd", "target": "engine", "result": "engine_stalled"}
        assert {k: record["detail"][k] for k in ("error", "exit_code", "step")} == {
            "error": exits[0], "exit_code": 75,  # (the stuck step here waits before Engine.step)
            "step": "with no step's sequences planned (admitting requests, restoring a prefix from a tier, or "
                    "outside a step: its stack says where)"}


def test_a_stop_asked_of_a_kvd_whose_engine_is_stalled_ends_it_at_once(tmp_path):
    """SIGTERM's stop waits for what runs to finish, under the engine's lock: with the step that
    holds it never ending, the stop hung until a service manager killed kvd. Now kvd ends at once,
    saying why."""
    with a_stuck_request(tmp_path) as (service, exits):
        deadline = time.monotonic() + 10
        while service.engine_loop.stalled() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        stopping = threading.Thread(target=service.shutdown, kwargs={"deadline": 30})
        began = time.monotonic()
        stopping.start()
        stopping.join(10)
        assert not stopping.is_alive() and time.monotonic() - began < 5  # not the 30 s it gives requests to finish
        assert len(exits) == 1 and exits[0].startswith("the engine has not come round its loop in")
        [record] = service.store.audit_since(action="exit")
        assert (record["result"], record["detail"]["error"], record["detail"]["exit_code"]) == (
            "engine_stalled", exits[0], 75)


def test_a_stop_whose_engine_stalls_while_it_cancels_what_runs_ends_at_once(tmp_path):
    """Past its deadline a stop cancels what still runs, one request at a time, and a step runs
    between two: one that stalls there held the next cancel, and the stop, until a service manager
    killed kvd. Now kvd ends at once there too."""
    from kvctl.daemon.server.app import create_app

    from .daemon_fixtures import call, start_service

    service = start_service(tmp_path)
    exits = []
    service.on_stall_exit = lambda: exits.append(service.stall_exit)
    engine, real_step, real_cancel = service.engine, service.engine.step, service.engine.cancel
    real_take = service._stalled_at_stop
    cancelling, stalling, release = threading.Event(), threading.Event(), threading.Event()

    def step():  # slow enough to run past the stop's deadline; stalls once the stop has cancelled one
        if engine.requests:
            if cancelling.is_set():
                stalling.set()
                release.wait(30)
            time.sleep(0.02)
        return real_step()

    def cancel(request_id):
        cancelling.set()
        return real_cancel(request_id)

    def take():  # after the first cancel, the step between two is in (the stop would win the lock first)
        if cancelling.is_set():
            stalling.wait(10)
        return real_take()

    engine.step, engine.cancel, service.engine_loop.after = step, cancel, 0.3
    service._stalled_at_stop = take
    app = create_app(service, service.metrics, front="unix")
    askers = [threading.Thread(target=call, args=(app, "POST", "/v1/completions"),
                               kwargs={"json": {"prompt": f"Hi {i}", "max_tokens": 200, "ignore_eos": True}})
               for i in range(2)]
    try:
        for asker in askers:
            asker.start()
        deadline = time.monotonic() + 10
        while len(engine.requests) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(engine.requests) == 2
        stopping = threading.Thread(target=service.shutdown, kwargs={"deadline": 0.2})
        began = time.monotonic()
        stopping.start()
        stopping.join(10)
        assert not stopping.is_alive() and time.monotonic() - began < 5
        assert cancelling.is_set() and len(exits) == 1 and exits[0].startswith("the engine has not come round")
    finally:
        release.set()
        for asker in askers:
            asker.join(30)
        service.shutdown(deadline=2)


def test_the_stall_exit_removes_kvds_socket_and_ends_the_process_with_75(tmp_path, monkeypatch):
    import os

    from kvctl.daemon.cli import exit_stalled
    from kvctl.daemon.server.unix_front import UnixFront

    front = UnixFront(str(tmp_path / "kvd.sock"))
    ended = []

    def _exit(code):
        ended.append(code)
        raise SystemExit(code)

    monkeypatch.setattr(os, "_exit", _exit)
    with pytest.raises(SystemExit):
        exit_stalled(front)
    assert ended == [75] and not (tmp_path / "kvd.sock").exists()
