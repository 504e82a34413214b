"""Rollouts: stable cohorts, stop conditions, automatic rollback, completion, restart."""

from __future__ import annotations

import json
import threading
import time

import pytest

from kvctl.policies.rollout import StopCondition, in_cohort, parse_fraction

pytest.importorskip("torch")
pytest.importorskip("fastapi")

from .daemon_fixtures import apps, call, settled, start_service, token_table  # noqa: E402


def test_cohort_assignment_is_stable_and_near_the_fraction():
    keys = [f"tenant-{i}" for i in range(10_000)]
    chosen = [k for k in keys if in_cohort(7, k, 0.10)]
    assert 850 <= len(chosen) <= 1150
    assert chosen == [k for k in keys if in_cohort(7, k, 0.10)]
    assert set(chosen) <= {k for k in keys if in_cohort(7, k, 0.5)}  # growing keeps everyone in
    assert chosen != [k for k in keys if in_cohort(8, k, 0.10)]


def test_stop_conditions():
    c = StopCondition.parse("recomputed_token_ratio > 1.2 * baseline")
    assert c.tripped({"recomputed_token_ratio": 0.13}, {"recomputed_token_ratio": 0.1}) == (
        True, {"observed": 0.13, "threshold": pytest.approx(0.12), "baseline": 0.1})
    assert c.tripped({"recomputed_token_ratio": 0.11}, {"recomputed_token_ratio": 0.1})[0] is False
    assert StopCondition.parse("hit_ratio < 0.3").tripped({"hit_ratio": 0.2}, {})[0] is True
    with pytest.raises(ValueError, match="stop: unknown figure 'vibes'"):
        StopCondition.parse("vibes > 2")
    with pytest.raises(ValueError, match="stop: cannot parse"):
        StopCondition.parse("ttft_p95_seconds is high")
    assert parse_fraction("10%") == 0.1 and parse_fraction(0.5) == 0.5
    with pytest.raises(ValueError, match=r"cohort: '150%' is not in \(0%, 100%\]"):
        parse_fraction("150%")


def test_a_worse_policy_trips_its_stop_condition_and_rolls_back_by_itself(tmp_path):
    service = start_service(tmp_path, num_blocks=24, max_running=8)
    try:
        unix, _ = apps(service, token_table(tmp_path))
        body = {"policy": {"name": "no-output-reservation", "settings": {"reservation": "fixed:0"}},
                "cohort": "50%", "stops": ["recomputed_token_ratio > 1.2 * baseline"]}
        started = call(unix, "POST", "/admin/rollouts", json=body).json()
        rollout_id = started["id"]
        assert started["state"] == "running" and started["policy"]["version"]
        tenants = [f"t{i}" for i in range(200)]
        cohort = [t for t in tenants if in_cohort(rollout_id, t, 0.5)][:8]
        baseline = [t for t in tenants if not in_cohort(rollout_id, t, 0.5)][:8]
        from kvctl.daemon.engine.sampling import SamplingParams
        from kvctl.daemon.server.calls import Principal

        def wave(names):
            done = threading.Semaphore(0)
            for name in names:
                service.submit([list(range(1, 40))], SamplingParams(max_tokens=60, ignore_eos=True),
                               Principal(name, "admin", "test"),
                               lambda e: done.release() if e.finish_reason else None)
            for _ in names:
                assert done.acquire(timeout=120)

        wave(baseline)  # fully reserved: queues, never preempted
        wave(cohort)  # reserves nothing: runs into the pool's end and preempts
        status = settled(lambda: call(unix, "GET", f"/admin/rollouts/{rollout_id}").json(),
                         lambda answer: answer["traffic"]["requests"] == 16)
        assert status["baseline"]["recomputed_token_ratio"] == 0.0
        assert status["cohort"]["recomputed_token_ratio"] > 0
        assert status["traffic"] == {"by": "tenant", "requests": 16, "cohort_share": 0.5, "stops_checked": True,
                                     "stops_waiting_for": None}
        result = service.rollouts.evaluate()
        assert result["state"] == "rolled_back"
        last = result["events"][-1]
        assert last["action"] == "rollback" and last["actor"] == "kvd"
        assert last["detail"]["condition"] == "recomputed_token_ratio > 1.2 * baseline"
        assert last["detail"]["observed"] > last["detail"]["threshold"] == 0.0
        # what it was judged on stays with it: the figures at the rollback, kept after the live ones are gone
        assert result["cohort"] is None and result["last_figures"]["action"] == "rollback"
        assert result["last_figures"]["cohort"] == status["cohort"]
        assert result["last_figures"]["baseline"] == status["baseline"]
        assert result["last_figures"]["since"] == status["figures_since"] == started["figures_since"]
        assert service.rollouts.assign("t0", "r") == (None, None, None)
        audit = [e["action"] for e in call(unix, "GET", "/admin/audit").json()["entries"]]
        assert audit[:2] == ["rollout.rollback", "rollout.start"]
    finally:
        service.shutdown(1)


def test_a_rollout_that_completes_and_one_resumed_after_restart(tmp_path):
    service = start_service(tmp_path)
    unix, _ = apps(service, token_table(tmp_path))
    body = {"policy": {"name": "p95", "settings": {"reservation": "p95"}}, "cohort": "10%",
            "stops": ["ttft_p95_seconds > 3 * baseline"]}
    started = call(unix, "POST", "/admin/rollouts", json=body).json()
    rollout_id = started["id"]
    assert "note" not in started  # p95 is not what everyone has (fraction:1.0)
    assert call(unix, "POST", "/admin/rollouts", json=body).status_code == 409
    assert call(unix, "POST", f"/admin/rollouts/{rollout_id}/advance", json={"to": "50%"}).json()["fraction"] == 0.5
    assert call(unix, "POST", f"/admin/rollouts/{rollout_id}/pause").json()["state"] == "paused"
    for i in range(3):  # paused: every request is the baseline's
        assert call(unix, "POST", "/v1/completions", json={"prompt": f"before {i}", "max_tokens": 2}).status_code == 200
    service.shutdown(1)
    service = start_service(tmp_path)  # a restart resumes the recorded state
    try:
        unix, _ = apps(service, token_table(tmp_path))
        resumed = call(unix, "GET", "/admin/rollouts").json()
        assert (resumed["id"], resumed["state"], resumed["fraction"]) == (rollout_id, "paused", 0.5)
        # the figures of before the restart were stored as it stopped; the live ones start again
        before = resumed["last_figures"]
        assert before["action"] == "shutdown" and before["baseline"]["requests"] == 3
        assert before["cohort"]["requests"] == 0 and resumed["baseline"]["requests"] == 0
        from rich.console import Console

        from kvctl.rollout_cmd import _render

        console = Console(record=True, width=120)
        _render(resumed, console)
        text = console.export_text()
        assert "figures before kvd stopped (" in text and "figures since " in text
        assert call(unix, "POST", f"/admin/rollouts/{rollout_id}/resume").json()["state"] == "running"
        done = call(unix, "POST", f"/admin/rollouts/{rollout_id}/complete").json()
        assert done["state"] == "completed"
        assert [e["action"] for e in done["events"]] == ["start", "advance", "pause", "shutdown", "resume", "complete"]
        assert service.engine.reservation.spec == "p95" and service.config.reservation == "p95"
        again = call(unix, "POST", "/admin/rollouts", json=body).json()  # p95 is everyone's now
        assert again["note"] == ("the cohort's settings are everyone's already (reservation p95): cohort and "
                                 "baseline run alike")
        call(unix, "POST", f"/admin/rollouts/{again['id']}/rollback", json={"reason": "nothing to learn"})
        again = call(unix, "POST", f"/admin/rollouts/{rollout_id}/pause")
        assert again.status_code == 409 and "cannot pause while completed" in again.json()["error"]["message"]
    finally:
        service.shutdown(1)


def test_one_tenant_puts_all_traffic_on_one_side_and_status_says_the_stops_are_unchecked(tmp_path, capsys):
    from rich.console import Console

    from kvctl.daemon.engine.sampling import SamplingParams
    from kvctl.daemon.server.calls import Principal
    from kvctl.rollout_cmd import _render

    service = start_service(tmp_path)
    try:
        unix, _ = apps(service, token_table(tmp_path))
        body = {"policy": {"name": "p95", "settings": {"reservation": "p95"}}, "cohort": "25%",
                "stops": ["ttft_p95_seconds > 3 * baseline"]}
        rollout_id = call(unix, "POST", "/admin/rollouts", json=body).json()["id"]
        side = "cohort" if in_cohort(rollout_id, "default", 0.25) else "baseline"
        done = threading.Semaphore(0)
        for _ in range(20):
            service.submit([list(range(1, 20))], SamplingParams(max_tokens=2, ignore_eos=True),
                           Principal("default", "admin", "test"), lambda e: done.release() if e.finish_reason else None)
        for _ in range(20):
            assert done.acquire(timeout=60)
        status = settled(lambda: call(unix, "GET", f"/admin/rollouts/{rollout_id}").json(),
                         lambda answer: answer["traffic"]["requests"] == 20)
        other = "baseline" if side == "cohort" else "cohort"
        assert status["traffic"] == {
            "by": "tenant", "requests": 20, "cohort_share": 1.0 if side == "cohort" else 0.0, "stops_checked": False,
            "stops_waiting_for": f"20 requests on each side ({other} has 0)"}
        assert service.rollouts.evaluate() is None  # nothing to compare with: no rollback, and status says so
        console = Console(record=True, width=200)
        _render(status, console)
        text = " ".join(console.export_text().split())
        assert (f"traffic: {status['traffic']['cohort_share']:.0%} of 20 requests in the cohort (asked 25%, by tenant) "
                "— few tenants make a coarse split; `by: request` in the policy splits requests") in text
        assert f"stop conditions not checked yet: they wait for 20 requests on each side ({other} has 0)" in text
    finally:
        service.shutdown(1)


def test_a_p95_stop_waits_for_20_requests_a_side_unless_the_policy_says_otherwise():
    """A nearest-rank p95 of fewer than 20 values is their maximum: one slow request would roll
    the rollout back. Other figures need 5; a policy's min_requests sets it for every condition."""
    from kvctl.daemon.server.rollouts import traffic_split

    assert StopCondition.parse("ttft_p95_seconds > 1.5 * baseline").min_requests == 20
    assert StopCondition.parse("ttft_p50_seconds > 1.5 * baseline").min_requests == 5
    assert StopCondition.parse("recomputed_token_ratio > 1.2 * baseline").min_requests == 5
    sides = ({"requests": 12}, {"requests": 30})
    p95 = {"policy": {"settings": {}}, "stops": ["ttft_p95_seconds > 1.5 * baseline", "hit_ratio < 0.2"]}
    assert traffic_split(p95, *sides)["stops_waiting_for"] == "20 requests on each side (cohort has 12)"
    assert traffic_split({**p95, "policy": {"settings": {}, "min_requests": 10}}, *sides)["stops_checked"] is True
    assert traffic_split({**p95, "stops": ["hit_ratio < 0.2"]}, *sides)["stops_checked"] is True


def test_a_slow_cohort_rolls_back_on_its_p95_only_once_each_side_has_20_requests(tmp_path):
    from types import SimpleNamespace

    from kvctl.daemon.server.rollouts import RolloutManager
    from kvctl.daemon.store import Store

    manager = RolloutManager(Store(tmp_path / "kvd.sqlite3"))
    manager.start({"settings": {"reservation": "p95"}}, "50%", ["ttft_p95_seconds > 1.5 * baseline"], None, "ops")

    def finished(cohort: str, ttft: float):
        metrics = SimpleNamespace(cached_tokens=0, recomputed_tokens=0, preemptions=0, ttft=ttft, token_times=[],
                                  finished_blocks=0, reserved_unused_blocks=0)
        return SimpleNamespace(metrics=metrics, prompt_ids=[1] * 8, cohort=cohort, cancelled=False)

    for _ in range(19):
        manager.observe(finished("candidate", 1.0))  # ten times slower than the baseline
        manager.observe(finished("baseline", 0.1))
    assert manager.evaluate() is None and manager.active["state"] == "running"
    manager.observe(finished("candidate", 1.0))
    manager.observe(finished("baseline", 0.1))
    rolled = manager.evaluate()
    assert rolled["state"] == "rolled_back"
    assert rolled["events"][-1]["detail"]["reason"] == "stop condition tripped: ttft_p95_seconds > 1.5 * baseline"


@pytest.mark.parametrize("policy, message", [
    ({"settings": {"reservation": "p95"}, "min_requests": 0},
     "policy.min_requests: must be a whole number of at least 1, got 0"),
    ({"settings": {"eviction": "cost"}}, "policy.settings.eviction: is one per cache pool"),
    ({"settings": {"reservation": "lots"}}, "policy.settings.reservation: output reservation: invalid value"),
    ({"settings": {}}, "policy.settings: give at least one setting"),
    ({"settings": {"reservation": "p95"}, "by": "moon"}, "policy.by: invalid value 'moon'"),
])
def test_bad_policies_are_refused(tmp_path, policy, message):
    service = start_service(tmp_path)
    try:
        unix, _ = apps(service, token_table(tmp_path))
        response = call(unix, "POST", "/admin/rollouts", json={"policy": policy, "cohort": "10%"})
        assert response.status_code == 400 and response.json()["error"]["message"].startswith(message)
        bad_stop = call(unix, "POST", "/admin/rollouts", json={"policy": {"settings": {"reservation": "p95"}},
                                                               "cohort": "10%", "stops": ["x > 1"]})
        assert bad_stop.status_code == 400 and "unknown figure 'x'" in bad_stop.json()["error"]["message"]
    finally:
        service.shutdown(1)


def test_an_operator_completes_a_rollout_keeps_its_figures_and_is_told_a_reload_reverts_it(tmp_path):
    """The whole path through kvctl against a real kvd: a list with nothing in it, a rollout by
    request, traffic, completion (figures kept, and the setting to write into the config), the
    config showing where the setting came from, a SIGHUP whose config reverts it (and status
    saying so), and the list."""
    import json
    import signal

    from .kvd_process import complete, kvctl, running_kvd

    config = tmp_path / "kvd.yaml"
    config.write_text('reservation: "fraction:1.0"\n')
    policy = tmp_path / "p95.yaml"
    policy.write_text("name: reserve-p95\nby: request\nsettings:\n  reservation: p95\n")
    with running_kvd(tmp_path, "--config", str(config)) as (proc, client, sock):
        empty = kvctl(sock, "rollout", "list")
        assert empty.returncode == 0 and "no rollout has been started" in empty.stdout
        none = kvctl(sock, "rollout", "status")
        assert none.returncode == 0 and none.stdout.strip() == ("no rollout has been started; start one with "
                                                                "`kvctl rollout start`")
        assert kvctl(sock, "rollout", "status", "--json").stdout.strip() == "null"
        missing = kvctl(sock, "rollout", "status", "7")
        assert missing.returncode == 2 and "rollout 7: no such rollout" in missing.stderr
        started = kvctl(sock, "rollout", "start", "--policy", str(policy), "--cohort", "50%", "--json")
        rollout_id = json.loads(started.stdout)["id"]
        for i in range(12):
            complete(client.post, f"question {i}")
        glance = " ".join(kvctl(sock, "status").stdout.split())
        assert (f"rollout {rollout_id} running: reservation p95 for 50% of traffic (reserve-p95; kvctl rollout "
                f"status {rollout_id})") in glance
        done = kvctl(sock, "rollout", "complete", str(rollout_id))
        assert done.returncode == 0, done.stderr
        text = " ".join(done.stdout.split())
        assert "settings: reservation p95 (everyone's now)" in text
        assert "figures at its complete (" in text
        assert ("to keep it: set reservation: p95 in kvd's config (YAML, KVD_RESERVATION or --reservation); "
                "until then a reload or restart reverts it") in text
        status = json.loads(kvctl(sock, "rollout", "status", str(rollout_id), "--json").stdout)
        figures = status["last_figures"]
        assert figures["cohort"]["requests"] + figures["baseline"]["requests"] == 12
        assert status["settings_in_effect"] == {"reservation": True}
        assert json.loads(kvctl(sock, "status", "--json").stdout)["rollout"] is None
        shown = " ".join(kvctl(sock, "config", "show").stdout.split())
        assert f"reservation p95 (not in the config yet) rollout {rollout_id}" in shown
        proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 30
        while json.loads(kvctl(sock, "config", "show", "--json").stdout)["config"]["reservation"] != "fraction:1.0":
            assert time.monotonic() < deadline, "the reload did not apply"
            time.sleep(0.2)
        assert (f"reload reverted reservation from p95 (completed rollout {rollout_id}) to the config's "
                "fraction:1.0") in (tmp_path / "kvd.log").read_text()
        after = " ".join(kvctl(sock, "rollout", "status", str(rollout_id)).stdout.split())
        assert "(no longer in effect: reservation;" in after
        listed = kvctl(sock, "rollout", "list").stdout.splitlines()
        assert listed[0].split() == ["id", "state", "cohort", "policy", "started", "latest", "adr"]
        assert listed[1].split()[:4] == [str(rollout_id), "completed", "50%", "reserve-p95"]
        assert " complete " in listed[1] and listed[1].split()[-1] == "-"
        audit = json.loads(kvctl(sock, "audit", "--json").stdout)["entries"]
        assert [e["action"] for e in audit[:3]] == ["reload", "rollout.complete", "rollout.start"]
        assert "figures" not in audit[1]["detail"]


def test_a_decision_record_lists_the_rollouts_that_carry_it_out(tmp_path):
    from kvctl.daemon.records import Records, parse_markdown

    service = start_service(tmp_path)
    try:
        unix, _ = apps(service, token_table(tmp_path))
        records = Records(service.store)
        adr = records.new("Reserve p95 of output", {"decision": "p95 for chat"}, "ana")
        assert adr.rollouts == [] and "Rollouts" not in adr.markdown()
        body = {"policy": {"name": "p95", "settings": {"reservation": "p95"}}, "cohort": "10%", "adr": adr.id}
        first = call(unix, "POST", "/admin/rollouts", json=body).json()["id"]
        call(unix, "POST", f"/admin/rollouts/{first}/rollback", json={"reason": "too early"})
        second = call(unix, "POST", "/admin/rollouts", json={**body, "cohort": "25%"}).json()["id"]
        adr = records.get(adr.id)
        assert adr.as_dict()["rollouts"] == [{"id": first, "state": "rolled_back", "fraction": 0.1},
                                             {"id": second, "state": "running", "fraction": 0.25}]
        text = adr.markdown()
        assert f"- Rollouts: {first} (rolled_back, cohort 10%), {second} (running, cohort 25%)" in text
        assert parse_markdown(text) == ("Reserve p95 of output", {**{f: "" for f in (
            "context", "alternatives", "evidence", "assumptions", "rollout_plan", "reversal_trigger",
            "unresolved_risks")}, "decision": "p95 for chat"})  # an export is still valid --from-file input
    finally:
        service.shutdown(1)


def test_metrics_chart_each_side_of_a_running_rollout(tmp_path):
    """/metrics carries the rollout (id, state, policy, version, share asked) and per side the
    counts its stop conditions compare and a TTFT histogram; they agree with `rollout status`,
    and they go once the rollout is finished."""
    from prometheus_client.parser import text_string_to_metric_families

    from kvctl.daemon.engine.sampling import SamplingParams
    from kvctl.daemon.server.calls import Principal

    service = start_service(tmp_path)
    try:
        unix, _ = apps(service, token_table(tmp_path))
        body = {"policy": {"name": "p95", "by": "request", "settings": {"reservation": "p95"}}, "cohort": "50%"}
        started = call(unix, "POST", "/admin/rollouts", json=body).json()
        done = threading.Semaphore(0)
        sent = 0
        # request ids are random, and so is each one's side: rounds of 10 until both sides have one
        # (one round but about once in 500 runs)
        while sent < 50:
            for i in range(10):
                service.submit([list(range(1, 20 + i))], SamplingParams(max_tokens=2, ignore_eos=True),
                               Principal("default", "admin", "test"),
                               lambda e: done.release() if e.finish_reason else None)
            sent += 10
            for _ in range(10):
                assert done.acquire(timeout=60)
            status = settled(lambda: call(unix, "GET", "/admin/rollouts").json(),
                             lambda answer: answer["cohort"]["requests"] + answer["baseline"]["requests"] == sent)
            if status["cohort"]["requests"] and status["baseline"]["requests"]:
                break

        def samples():
            text = call(unix, "GET", "/metrics").text
            return {(s.name, tuple(sorted(s.labels.items()))): s.value
                    for family in text_string_to_metric_families(text) for s in family.samples
                    if s.name.startswith("kvd_rollout")}

        got = samples()
        rid = str(started["id"])
        assert got[("kvd_rollout_info", (("policy", "p95"), ("rollout", rid), ("state", "running"),
                                         ("version", started["policy"]["version"])))] == 1.0
        assert got[("kvd_rollout_fraction", (("rollout", rid),))] == 0.5
        for side in ("cohort", "baseline"):
            labels = (("rollout", rid), ("side", side))
            assert got[("kvd_rollout_requests_total", labels)] == status[side]["requests"]
            assert got[("kvd_rollout_ttft_seconds_count", labels)] == status[side]["requests"]
            assert got[("kvd_rollout_ttft_seconds_bucket", (("le", "+Inf"),) + labels)] == status[side]["requests"]
            assert got[("kvd_rollout_ttft_seconds_bucket", (("le", "60.0"),) + labels)] == status[side]["requests"]
            assert got[("kvd_rollout_ttft_seconds_sum", labels)] > 0
            assert got[("kvd_rollout_prompt_tokens_total", labels)] > 0
            assert got[("kvd_rollout_finished_blocks_total", labels)] > 0  # each request held 2 blocks or more
            assert got[("kvd_rollout_hit_tokens_total", labels)] / got[("kvd_rollout_prompt_tokens_total", labels)] \
                == pytest.approx(status[side]["hit_ratio"])
        assert status["cohort"]["requests"] + status["baseline"]["requests"] == sent
        call(unix, "POST", f"/admin/rollouts/{rid}/complete")
        assert samples() == {}  # no series left behind for a finished rollout
    finally:
        service.shutdown(1)


def test_nan_and_infinity_are_refused_at_the_edge_and_never_reach_a_stored_rollout(tmp_path):
    """Python's json reads NaN, Infinity and 1e400 as floats. A policy document carrying one was
    stored, and the rollout list answered 500 from then on (such a float cannot be rendered)."""
    service = start_service(tmp_path, num_blocks=24)
    try:
        unix, _ = apps(service, token_table(tmp_path))
        policy = '{"name": "p", "settings": {"reservation": "fixed:0"}, "weight": %s}'
        for word, message in (("Infinity", "Infinity is not a JSON number"), ("NaN", "NaN is not a JSON number"),
                              ("-Infinity", "-Infinity is not a JSON number"),
                              ("1e400", "1e400 is past the largest number a float holds")):
            refused = call(unix, "POST", "/admin/rollouts", content='{"policy": %s, "cohort": "50%%"}' % (policy % word),
                           headers={"content-type": "application/json"})
            assert refused.status_code == 400
            assert refused.json()["error"] == {"message": f"body: not valid JSON ({message})",
                                               "type": "invalid_request_error", "param": None, "code": None}
        listed = call(unix, "GET", "/admin/rollouts/history")
        assert listed.status_code == 200 and listed.json()["rollouts"] == []
        for body, message in (('{"prompt": "a",}', "body: not valid JSON (Expecting property name enclosed in double "
                                                   "quotes, at character 15)"),
                              ("", "body: a JSON object is required, and the request has none")):
            bad = call(unix, "POST", "/v1/completions", content=body, headers={"content-type": "application/json"})
            assert (bad.status_code, bad.json()["error"]["message"]) == (400, message)
        accepted = call(unix, "POST", "/admin/rollouts", content='{"policy": %s, "cohort": "50%%"}' % (policy % "1e300"),
                        headers={"content-type": "application/json"})
        assert accepted.status_code == 200, accepted.text  # a large number that a float holds is a number
        assert call(unix, "GET", "/admin/rollouts/history").json()["rollouts"][0]["policy"]["weight"] == 1e300
    finally:
        service.shutdown(1)


def test_a_cohort_s_ttft_percentiles_cover_its_latest_5000_requests():
    from types import SimpleNamespace

    from kvctl.daemon.server.rollouts import CohortStats

    cohort = CohortStats()
    for i in range(6000):  # TTFTs 0 .. 5999 ms: the first 1,000 have gone from the window
        metrics = SimpleNamespace(cached_tokens=0, recomputed_tokens=0, preemptions=0, ttft=i / 1000, token_times=[],
                                  finished_blocks=0, reserved_unused_blocks=0)
        cohort.add(SimpleNamespace(metrics=metrics, prompt_ids=[1, 2]))
    figures = cohort.figures()
    assert (figures["requests"], figures["ttft_p50_seconds"], figures["ttft_p95_seconds"]) == (6000, 3.499, 5.749)
    assert len(cohort.ttfts) == 5000 and sum(cohort.ttft_buckets) == 6000  # the histogram keeps every one


def test_a_cohort_s_time_per_output_token_counts_the_tokens_after_the_first():
    from types import SimpleNamespace

    from kvctl.daemon.server.rollouts import CohortStats
    from kvctl.policies.rollout import StopCondition

    cohort = CohortStats()
    for times in ([5.0, 5.1, 5.3], [1.0, 1.4], [2.0], []):  # 0.15 s, 0.4 s; one token or none: no figure
        metrics = SimpleNamespace(cached_tokens=0, recomputed_tokens=0, preemptions=0, ttft=None, token_times=times,
                                  finished_blocks=0, reserved_unused_blocks=0)
        cohort.add(SimpleNamespace(metrics=metrics, prompt_ids=[1, 2]))
    figures = cohort.figures()
    assert figures["requests"] == 4 and list(cohort.tpots) == pytest.approx([0.15, 0.4])
    assert figures["tpot_p50_seconds"] == pytest.approx(0.15) and figures["tpot_p95_seconds"] == pytest.approx(0.4)
    condition = StopCondition.parse("tpot_p95_seconds > 1.1 * baseline")
    assert condition.min_requests == 20
    assert condition.tripped(figures, {"tpot_p95_seconds": 0.3})[0] is True


def test_a_reservation_cohort_s_figures_say_what_it_left_unwritten_beside_its_preemptions():
    from types import SimpleNamespace

    from kvctl.daemon.server.rollouts import CohortStats
    from kvctl.policies.rollout import StopCondition

    assert CohortStats().figures()["reserved_unused_ratio"] is None  # no block finished yet
    cohort = CohortStats()
    for held, unused, preempted in ((5, 3, 0), (3, 0, 1), (4, 1, 0)):
        metrics = SimpleNamespace(cached_tokens=0, recomputed_tokens=0, preemptions=preempted, ttft=None,
                                  token_times=[], finished_blocks=held, reserved_unused_blocks=unused)
        cohort.add(SimpleNamespace(metrics=metrics, prompt_ids=[1, 2]))
    figures = cohort.figures()
    assert (figures["reserved_unused_ratio"], figures["preemptions_per_request"]) == (4 / 12, 1 / 3)
    condition = StopCondition.parse("reserved_unused_ratio > 0.9 * baseline")
    assert condition.tripped(figures, {"reserved_unused_ratio": 0.25})[0] is True


def test_a_stop_that_trips_while_the_store_is_locked_stops_the_cohort_at_once_and_is_stored_later(tmp_path):
    """A stop condition is there to stop harm: when it trips while another process holds the
    store's write lock (past the busy timeout), the cohort still goes at once and the engine
    serves on; the rollback is stored, with the time it happened, by the first check the store
    can take. Before, the failed write escaped the engine thread and kvd served nothing more."""
    import sqlite3

    from rich.console import Console

    from kvctl.daemon.engine.sampling import SamplingParams
    from kvctl.daemon.server.calls import Principal
    from kvctl.status_view import render_status
    from kvctl.rollout_cmd import _render

    service = start_service(tmp_path, num_blocks=24, max_running=8)
    try:
        # the checks are this test's own: housekeeping's (every 10 s) must not trip the stop before the
        # store is locked
        [check] = [job for job in service.housekeeping.jobs if job.name == "rollout stop conditions"]
        check.run = lambda: None
        unix, _ = apps(service, token_table(tmp_path))
        body = {"policy": {"name": "any", "by": "request", "min_requests": 1, "settings": {"reservation": "fixed:0"}},
                "cohort": "50%", "stops": ["hit_ratio < 2"]}  # a ratio is never 2: trips at the first check
        rollout_id = call(unix, "POST", "/admin/rollouts", json=body).json()["id"]

        def run(n):
            done = threading.Semaphore(0)
            for _ in range(n):
                service.submit([list(range(1, 20))], SamplingParams(max_tokens=2, ignore_eos=True),
                               Principal("acme", "admin", "t"), lambda e: done.release() if e.finish_reason else None)
            for _ in range(n):
                assert done.acquire(timeout=60)

        sent = 10
        run(sent)
        settled(lambda: service.rollouts.status(rollout_id)["traffic"]["requests"], lambda n: n == sent)
        # (request ids are random: all ten on one side, 1 in 512, leave the other none to compare with)
        while min(service.rollouts.cohort.requests, service.rollouts.baseline.requests) == 0:
            run(2)
            sent += 2
            settled(lambda: service.rollouts.status(rollout_id)["traffic"]["requests"], lambda n: n == sent)
        service.store.conn.execute("PRAGMA busy_timeout=50")
        shell = sqlite3.connect(tmp_path / "kvd.sqlite3", isolation_level=None)
        shell.execute("BEGIN IMMEDIATE")
        try:
            result = service.rollouts.evaluate()
            assert result["state"] == "rolled_back" and result["unstored"].startswith("kvd rolled it back")
            console = Console(record=True, width=200)
            _render(result, console)
            text = " ".join(console.export_text().split())
            assert text.startswith(f"rollout {rollout_id}: rolled_back, cohort 50%")
            kept = tmp_path / "rollback-pending.json"
            assert ("not stored: kvd rolled it back on a stop condition, and the store could not take that yet: kvd "
                    f"tries again at each check and keeps it in {kept} meanwhile, so a restart keeps it rolled back"
                    ) in text
            record = json.loads(kept.read_text())  # whole, beside the store: a restart now keeps it rolled back
            assert (record["rollout_id"], record["actor"], record["action"], record["detail"]["reason"]) == (
                rollout_id, "kvd", "rollback", "stop condition tripped: hit_ratio < 2")
            assert "rollback by kvd: stop condition tripped: hit_ratio < 2" in text
            status = call(unix, "GET", "/admin/status").json()
            assert status["rollout"] is None and status["store"]["unstored_rollback"] == rollout_id
            console = Console(record=True, width=200)
            render_status(status, console)  # what `kvctl status` shows
            assert (f"rollout kvd rolled rollout {rollout_id} back on a stop condition and the store has not taken "
                    f"that yet: {kept} keeps it meanwhile (a restart keeps it rolled back)"
                    ) in " ".join(console.export_text().split())
            assert result["events"][-1]["action"] == "rollback"
            assert result["events"][-1]["detail"]["reason"] == "stop condition tripped: hit_ratio < 2"
            assert service.rollouts.assign("acme", "r1") == (None, None, None)  # the cohort is gone now
            assert service.rollouts.summary() is None
            [listed] = call(unix, "GET", "/admin/rollouts/history").json()["rollouts"]
            assert (listed["state"], listed["last_action"]) == ("rolled_back", "rollback") and listed["unstored"]
            refused = call(unix, "POST", "/admin/rollouts", json=body)  # the pending rollback must land first
            assert refused.status_code == 503 and "database is locked" in refused.json()["error"]["message"]
            with pytest.raises(Exception, match="database is locked"):
                service.rollouts.evaluate()  # still waiting; it raises, housekeeping logs and tries again
            run(2)  # the engine serves on
            stored = sqlite3.connect(tmp_path / "kvd.sqlite3").execute(
                "SELECT state FROM rollouts WHERE id = ?", (rollout_id,)).fetchone()
            assert stored == ("running",)
        finally:
            shell.execute("ROLLBACK")
        at = result["events"][-1]["at"]
        assert service.rollouts.evaluate() is None  # stored now, nothing active to check
        assert not kept.exists()
        after = call(unix, "GET", f"/admin/rollouts/{rollout_id}").json()
        assert after["state"] == "rolled_back" and "unstored" not in after
        assert [(e["action"], e["at"]) for e in after["events"]][-1] == ("rollback", at)
        audit = [e["action"] for e in call(unix, "GET", "/admin/audit").json()["entries"]]
        assert audit[0] == "rollout.rollback"
    finally:
        service.shutdown(1)


def _tripped_while_locked(tmp_path, pending):
    """A rollout whose stop condition trips while another process holds the store's write lock:
    (store, the held lock's connection, the rollout's id). The manager kvd ran is gone (kvd stopped)."""
    import sqlite3
    from types import SimpleNamespace

    from kvctl.daemon.server.rollouts import RolloutManager
    from kvctl.daemon.store import Store

    store = Store(tmp_path / "kvd.sqlite3")
    manager = RolloutManager(store, pending_path=pending)
    rollout_id = manager.start({"by": "request", "min_requests": 1, "settings": {"reservation": "fixed:0"}}, "50%",
                               ["hit_ratio < 2"], None, "ops")["id"]
    for cohort in ("candidate", "baseline"):
        metrics = SimpleNamespace(cached_tokens=4, recomputed_tokens=0, preemptions=0, ttft=0.1, token_times=[],
                                  finished_blocks=0, reserved_unused_blocks=0)
        manager.observe(SimpleNamespace(metrics=metrics, prompt_ids=[1] * 8, cohort=cohort, cancelled=False))
    store.conn.execute("PRAGMA busy_timeout=50")
    shell = sqlite3.connect(tmp_path / "kvd.sqlite3", isolation_level=None)
    shell.execute("BEGIN IMMEDIATE")
    assert manager.evaluate()["state"] == "rolled_back" and pending.exists()
    return store, shell, rollout_id


def test_a_rollback_the_store_had_not_taken_when_kvd_stopped_stays_rolled_back_after_a_restart(tmp_path):
    """kvd kept the rollback beside the store; the next start stores it (at the time it happened,
    by kvd) instead of resuming the cohort that the stop condition had stopped."""
    from kvctl.daemon.server.rollouts import RolloutManager
    from kvctl.daemon.store import Store

    pending = tmp_path / "rollback-pending.json"
    _, shell, rollout_id = _tripped_while_locked(tmp_path, pending)
    at = json.loads(pending.read_text())["at"]
    shell.execute("ROLLBACK")  # the other process lets go; kvd starts again
    again = RolloutManager(Store(tmp_path / "kvd.sqlite3"), pending_path=pending)
    assert again.active is None and again.unstored is None and not pending.exists()
    status = again.status(rollout_id)
    assert status["state"] == "rolled_back" and "unstored" not in status
    assert [(e["action"], e["actor"], e["at"]) for e in status["events"]][-1] == ("rollback", "kvd", at)
    assert status["events"][-1]["detail"]["reason"] == "stop condition tripped: hit_ratio < 2"


def test_a_restart_while_the_store_still_cannot_take_the_rollback_keeps_it_rolled_back_until_it_can(tmp_path):
    from kvctl.daemon.server.rollouts import RolloutManager
    from kvctl.daemon.store import Store

    pending = tmp_path / "rollback-pending.json"
    store = Store(tmp_path / "kvd.sqlite3")  # (opened first: opening a store writes its schema)
    store.conn.execute("PRAGMA busy_timeout=50")
    _, shell, rollout_id = _tripped_while_locked(tmp_path, pending)
    again = RolloutManager(store, pending_path=pending)  # kvd starts again; the lock is still held
    assert again.active is None and again.unstored["rollout_id"] == rollout_id and pending.exists()
    assert again.assign("acme", "r1") == (None, None, None)  # the cohort does not come back
    assert again.status(rollout_id)["state"] == "rolled_back"
    assert again.status(rollout_id)["unstored"].endswith(f"keeps it in {pending} meanwhile, so a restart keeps it "
                                                         "rolled back")
    shell.execute("ROLLBACK")
    assert again.evaluate() is None and not pending.exists()  # stored by the next check
    assert store.read_one("SELECT state FROM rollouts WHERE id = ?", (rollout_id,)) == ("rolled_back",)


def test_a_pending_rollback_of_a_rollout_settled_since_is_dropped_and_a_torn_one_is_ignored(tmp_path, caplog):
    """An operator rolled the rollout back (or completed it) with kvctl while kvd was down: the kept
    record has nothing left to do. A file that does not parse changes nothing and is named in the log."""
    from kvctl.daemon.server.rollouts import RolloutManager
    from kvctl.daemon.store import Store

    pending = tmp_path / "rollback-pending.json"
    _, shell, rollout_id = _tripped_while_locked(tmp_path, pending)
    shell.execute("ROLLBACK")
    shell.execute("UPDATE rollouts SET state = 'completed' WHERE id = ?", (rollout_id,))
    again = RolloutManager(Store(tmp_path / "kvd.sqlite3"), pending_path=pending)
    assert again.active is None and again.unstored is None and not pending.exists()
    assert again.status(rollout_id)["state"] == "completed"

    started = again.start({"settings": {"reservation": "p95"}}, "10%", [], None, "ops")["id"]
    pending.write_text('{"rollout_id": ')
    with caplog.at_level("ERROR", logger="kvd"):
        third = RolloutManager(Store(tmp_path / "kvd.sqlite3"), pending_path=pending)
    assert third.active["id"] == started and third.unstored is None and pending.exists()
    assert f"{pending}: cannot be read as a pending rollback" in caplog.text


def test_a_policy_file_without_a_name_is_known_by_the_file_s_name(tmp_path):
    from .kvctl_fakes import kvctl_answered

    unnamed, named = tmp_path / "p95-reserve.yaml", tmp_path / "other.yaml"
    unnamed.write_text("settings:\n  reservation: p95\n")
    named.write_text("name: reserve-p95\nsettings:\n  reservation: p95\n")
    sent = []
    for path in (unnamed, named):
        result = kvctl_answered(["rollout", "start", "--policy", str(path), "--cohort", "10%", "--json"],
                                {"id": 1}, sent)
        assert result.exit_code == 0, result.output
    assert [body["policy"] for _, body in sent] == [
        {"name": "p95-reserve", "settings": {"reservation": "p95"}},
        {"name": "reserve-p95", "settings": {"reservation": "p95"}}]
