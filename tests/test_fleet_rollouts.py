"""Fleet rollouts at kvd router: one rollout at every replica under one fleet id, one cohort
across the fleet, moved by its fleet id, all or none at its start, and a stop at one replica
a stop at all (fleet_rollouts.py)."""

from __future__ import annotations

import asyncio
import re

import pytest

from kvctl.policies.rollout import in_cohort

pytest.importorskip("torch")
pytest.importorskip("fastapi")

from kvctl.daemon.server import fleet_rollouts  # noqa: E402
from kvctl.daemon.server.app import create_app  # noqa: E402

from .daemon_fixtures import call, settled, start_service  # noqa: E402
from .test_router import router_app  # noqa: E402
from .test_sleep import kvctl_on  # noqa: E402

POLICY = "name: p95\nsettings:\n  reservation: p95\n"
START = {"policy": {"name": "p95", "settings": {"reservation": "p95"}}, "cohort": "50%",
         "stops": ["ttft_p95_seconds > 3 * baseline"]}


@pytest.fixture
def fleet(tmp_path):
    """Two replicas (their services and unix apps) and a round-robin kvd router over them."""
    services = [start_service(tmp_path / f"replica{i}", num_blocks=64) for i in range(2)]
    try:
        apps = [create_app(s, s.metrics, front="unix") for s in services]
        router, app = router_app(apps, "round_robin")
        yield services, apps, router, app
    finally:
        for service in services:
            service.shutdown(deadline=5)


def watch_once(router):
    return asyncio.run(fleet_rollouts.watch_once(router.replicas, router.ask_each))


def newest(app) -> dict:
    return call(app, "GET", "/admin/rollouts").json()


def test_kvctl_rollout_start_at_the_router_starts_one_rollout_at_every_replica_with_one_cohort(fleet, tmp_path):
    services, apps, _, app = fleet
    (tmp_path / "p95.yaml").write_text(POLICY)
    code, shown = kvctl_on(app, ["rollout", "start", "--policy", str(tmp_path / "p95.yaml"), "--cohort", "50%",
                                 "--stop", "ttft_p95_seconds > 3 * baseline"])
    assert code == 0, shown
    lines = shown.splitlines()
    fleet_id = re.fullmatch(r"fleet rollout (fleet-[0-9a-f]{12}): running", lines[0]).group(1)
    assert lines[1] == "replica replica-0"
    assert lines[2].startswith("rollout 1: running, cohort 50%, policy p95 (version ")
    assert lines[2].endswith(f", one of fleet rollout {fleet_id}")
    assert "replica replica-1" in lines
    reports = [newest(a) for a in apps]
    assert [r["policy"]["fleet"] for r in reports] == [fleet_id, fleet_id]
    assert [r["state"] for r in reports] == ["running", "running"]
    assert reports[0]["policy"]["version"] == reports[1]["policy"]["version"]
    assert [e["action"] for e in reports[1]["events"]] == ["start"]
    code, status = kvctl_on(app, ["status"])  # the fleet rollout once, with where it runs
    assert code == 0 and (f"fleet rollout {fleet_id} running: reservation p95 for 50% of traffic (p95; kvctl rollout "
                          f"status {fleet_id}) at replica-0, replica-1 ") in " ".join(status.split()) + " ", status
    # a tenant lands on the same side at every replica: the cohort hash is salted with the fleet id
    tenants = [f"tenant-{i}" for i in range(40)]
    sides = [[s.rollouts.assign(t, "req")[2] for t in tenants] for s in services]
    expected = ["candidate" if in_cohort(fleet_id, t, 0.5) else "baseline" for t in tenants]
    assert sides == [expected, expected]
    assert expected != ["candidate" if in_cohort(1, t, 0.5) else "baseline" for t in tenants]  # not its number's
    # the same policy started alone has the same version (the fleet id is not part of it)
    call(apps[0], "POST", f"/admin/rollouts/{fleet_id}/rollback", json={"reason": "test"})
    alone = call(apps[0], "POST", "/admin/rollouts", json=START).json()
    assert alone["policy"]["version"] == reports[0]["policy"]["version"] and "fleet" not in alone["policy"]
    # kvctl status at a replica names the fleet rollout its rollout is one of
    call(apps[0], "POST", f"/admin/rollouts/{alone['id']}/rollback", json={"reason": "test"})
    summary = call(apps[1], "GET", "/admin/status").json()["rollout"]
    assert summary["fleet"] == fleet_id and summary["id"] == 1


def test_a_fleet_rollout_moves_by_its_fleet_id_at_the_router_and_at_each_replica(fleet):
    _, apps, _, app = fleet
    fleet_id = call(app, "POST", "/admin/rollouts", json=START).json()["fleet"]
    code, shown = kvctl_on(app, ["rollout", "advance", fleet_id, "--to", "80%"])
    assert code == 0, shown
    assert shown.splitlines()[0] == f"fleet rollout {fleet_id}: running (advanced at every replica that has it)"
    assert [newest(a)["fraction"] for a in apps] == [0.8, 0.8]
    paused = call(app, "POST", f"/admin/rollouts/{fleet_id}/pause", json={}).json()
    assert paused["state"] == "paused" and paused["result"] == "ok"
    assert [row["report"]["state"] for row in paused["replicas"]] == ["paused", "paused"]
    # at one replica, the fleet id names its own rollout of it
    resumed = call(apps[1], "POST", f"/admin/rollouts/{fleet_id}/resume", json={}).json()
    assert resumed["id"] == 1 and resumed["state"] == "running"
    shown = call(app, "GET", f"/admin/rollouts/{fleet_id}").json()
    assert shown["state"] == "mixed: paused at replica-0, running at replica-1"
    code, text = kvctl_on(app, ["rollout", "status", fleet_id])
    assert code == 0
    assert text.splitlines()[0] == f"fleet rollout {fleet_id}: mixed: paused at replica-0, running at replica-1"
    code, listed = kvctl_on(app, ["rollout", "list"])  # each fleet rollout once, then each replica's rollouts
    lines = listed.splitlines()
    assert code == 0 and lines[0] == "fleet rollouts"
    row = " ".join(next(line for line in lines if line.startswith(fleet_id)).split())
    assert row.startswith(f"{fleet_id} mixed: paused at 1, running at 1 80% p95 ") and row.endswith(" 2 of 2")
    assert "replica replica-0" in lines and "replica replica-1" in lines
    # moved where it can be, and the rest named
    partly = call(app, "POST", f"/admin/rollouts/{fleet_id}/resume", json={}).json()
    assert partly["result"] == "partial" and partly["state"] == "running"
    assert partly["message"] == ("resume not done at every replica: replica-1 refused it (409: rollout 1: cannot "
                                 "resume while running)")
    # a replica's own number means nothing at the router; a name that is neither is refused at a replica
    number = call(app, "POST", "/admin/rollouts/1/pause", json={})
    assert number.status_code == 400 and number.json()["error"]["message"].startswith(
        "rollout_id: at kvd router a rollout is named by its fleet id (fleet- and 12 hex digits, as kvctl rollout "
        "start here gave it), got '1'")
    bad = call(apps[0], "GET", "/admin/rollouts/fleet-xyz")
    assert bad.status_code == 400 and bad.json()["error"]["message"] == (
        "rollout_id: expected a rollout's number or a fleet rollout's id (fleet- and 12 hex digits), got 'fleet-xyz'")
    missing = call(apps[0], "GET", "/admin/rollouts/fleet-0123456789ab")
    assert missing.status_code == 404 and missing.json()["error"]["message"] == (
        "rollout fleet-0123456789ab: no rollout of that fleet rollout here")
    assert call(app, "POST", f"/admin/rollouts/{fleet_id}/explode", json={}).status_code == 404
    gone = call(app, "POST", f"/admin/rollouts/{fleet_id}/rollback", json={"reason": "test over"}).json()
    assert gone["state"] == "rolled_back" and gone["result"] == "ok"


def test_a_fleet_rollout_starts_at_every_replica_or_at_none(fleet, tmp_path):
    _, apps, _, app = fleet
    own = call(apps[1], "POST", "/admin/rollouts", json=START).json()
    refused = call(app, "POST", "/admin/rollouts", json=START)
    assert refused.status_code == 409
    message = refused.json()["error"]["message"]
    assert message == (f"fleet rollout not started: replica-1 refused it (409: rollout {own['id']} is running; "
                       "complete or roll it back first); rolled back at replica-0 where it had started")
    at_zero = newest(apps[0])
    assert at_zero["state"] == "rolled_back"
    assert at_zero["events"][-1]["detail"]["reason"] == (
        f"fleet rollout {at_zero['policy']['fleet']} did not start at every replica: replica-1 refused it (409: "
        f"rollout {own['id']} is running; complete or roll it back first)")
    assert newest(apps[1])["id"] == own["id"] and newest(apps[1])["state"] == "running"  # its own, untouched
    call(apps[1], "POST", f"/admin/rollouts/{own['id']}/rollback", json={"reason": "test"})
    # a replica not reached: none started
    _, down_app = router_app(apps, "round_robin", down=(1,))
    unreached = call(down_app, "POST", "/admin/rollouts", json=START)
    assert unreached.status_code == 503
    assert unreached.json()["error"]["message"].startswith("fleet rollout not started: replica-1 was not reached (")
    assert newest(apps[0])["state"] == "rolled_back" and newest(apps[0])["id"] == at_zero["id"] + 1
    # refused alike everywhere: the replicas' own refusal; the router names the fleet itself
    bad = call(app, "POST", "/admin/rollouts", json={**START, "cohort": "150%"})
    assert bad.status_code == 400 and bad.json()["error"]["message"] == "cohort: '150%' is not in (0%, 100%]"
    named = call(app, "POST", "/admin/rollouts", json={**START, "policy": {**START["policy"], "fleet": "x"}})
    assert named.status_code == 400 and named.json()["error"]["message"] == (
        "policy.fleet: kvd router names a fleet rollout itself; leave it out, got 'x'")
    assert newest(apps[0])["id"] == at_zero["id"] + 1  # neither started one


def test_a_stop_condition_tripped_at_one_replica_rolls_the_fleet_rollout_back_everywhere(fleet):
    services, apps, router, app = fleet
    body = {"policy": {"name": "always", "min_requests": 1, "settings": {"reservation": "p95"}}, "cohort": "50%",
            "stops": ["hit_ratio < 2"]}
    fleet_id = call(app, "POST", "/admin/rollouts", json=body).json()["fleet"]
    assert watch_once(router) == []  # running everywhere: nothing to do
    tenants = [f"tenant-{i}" for i in range(40)]
    cohort = next(t for t in tenants if in_cohort(fleet_id, t, 0.5))
    baseline = next(t for t in tenants if not in_cohort(fleet_id, t, 0.5))
    for tenant in (cohort, baseline):  # one request a side at replica 0 alone
        answer = call(apps[0], "POST", "/v1/completions", json={"prompt": "hello", "max_tokens": 1},
                      headers={"X-KVD-Tenant": tenant})
        assert answer.status_code == 200
    books = services[0].rollouts
    assert settled(lambda: (books.cohort.requests, books.baseline.requests), lambda sides: sides == (1, 1)) == (1, 1)
    tripped = books.evaluate()
    assert tripped["state"] == "rolled_back" and newest(apps[1])["state"] == "running"
    done = watch_once(router)
    assert done == [{"fleet": fleet_id, "action": "rollback", "rolled_back_at": "replica-0",
                     "reason": "stop condition tripped: hit_ratio < 2", "rolled_back": ["replica-1"],
                     "not_rolled_back": {}}]
    at_one = newest(apps[1])
    assert at_one["state"] == "rolled_back"
    assert at_one["events"][-1]["detail"]["reason"] == (
        f"fleet rollout {fleet_id} was rolled back at replica-0 (stop condition tripped: hit_ratio < 2): kvd "
        "router's fleet rollout watch rolls it back at every replica")
    assert watch_once(router) == []  # nothing left running
    shown = call(app, "GET", f"/admin/rollouts/{fleet_id}").json()
    assert shown["state"] == "rolled_back"


def test_a_replica_not_reached_when_the_fleet_rolled_back_is_rolled_back_once_it_answers(fleet):
    _, apps, router, app = fleet
    fleet_id = call(app, "POST", "/admin/rollouts", json=START).json()["fleet"]
    _, down_app = router_app(apps, "round_robin", down=(1,))
    partly = call(down_app, "POST", f"/admin/rollouts/{fleet_id}/rollback", json={"reason": "bad"}).json()
    assert partly["result"] == "partial" and partly["message"].startswith(
        "rollback not done at every replica: replica-1 was not reached (")
    assert newest(apps[1])["state"] == "running"
    done = watch_once(router)  # the router that reaches both
    assert [(d["rolled_back_at"], d["reason"], d["rolled_back"]) for d in done] == [("replica-0", "bad", ["replica-1"])]
    assert newest(apps[1])["state"] == "rolled_back"


def test_complete_at_the_router_completes_everywhere_only_while_it_runs_everywhere(fleet):
    services, apps, _, app = fleet
    fleet_id = call(app, "POST", "/admin/rollouts", json=START).json()["fleet"]
    code, shown = kvctl_on(app, ["rollout", "complete", fleet_id])
    assert code == 0, shown
    assert shown.splitlines()[0] == f"fleet rollout {fleet_id}: completed (completed at every replica that has it)"
    assert [s.config.reservation for s in services] == ["p95", "p95"]
    # a fleet rollout rolled back at one replica does not complete anywhere
    second = call(app, "POST", "/admin/rollouts", json={**START, "policy": {"settings": {"reservation": "p99"}}})
    fleet_id = second.json()["fleet"]
    call(apps[0], "POST", f"/admin/rollouts/{fleet_id}/rollback", json={"reason": "bad at 0"})
    refused = call(app, "POST", f"/admin/rollouts/{fleet_id}/complete", json={})
    assert refused.status_code == 409 and refused.json()["error"]["message"] == (
        f"fleet rollout {fleet_id} not completed: it is rolled_back at replica-0; kvd router's watch rolls it "
        "back at the others")
    assert newest(apps[1])["state"] == "running" and services[1].config.reservation == "p95"


def test_a_replica_that_joined_the_fleet_since_gets_the_fleet_rollout_as_it_runs_then(fleet, caplog):
    _, apps, router, _ = fleet
    _, alone = router_app(apps[:1], "round_robin")  # the fleet before replica-1 joined
    fleet_id = call(alone, "POST", "/admin/rollouts", json=START).json()["fleet"]
    call(alone, "POST", f"/admin/rollouts/{fleet_id}/advance", json={"to": "70%"})
    call(alone, "POST", f"/admin/rollouts/{fleet_id}/pause", json={})
    own = call(apps[1], "POST", "/admin/rollouts", json=START).json()
    said: set = set()
    with caplog.at_level("WARNING", logger="kvd.router"):
        for _ in range(2):  # a rollout of its own runs there: left out, said once
            assert asyncio.run(fleet_rollouts.watch_once(router.replicas, router.ask_each, said)) == []
    assert [r.getMessage() for r in caplog.records if fleet_id in r.getMessage()] == [
        f"fleet rollout {fleet_id}: not started at replica-1, which joined the fleet since it started: a rollout of "
        "its own runs there (roll that back for it to join)"]
    code, status = kvctl_on(router_app(apps, "round_robin")[1], ["status"])
    assert code == 0
    shown = " ".join(status.split())
    assert (f"replica-1 rollout {own['id']} running: reservation p95 for 50% of traffic (p95; kvctl --socket REPLICA "
            f"rollout status {own['id']})") in shown
    assert (f"fleet rollout {fleet_id} paused: reservation p95 for 70% of traffic (p95; kvctl rollout status "
            f"{fleet_id}) at replica-0; not at replica-1") in shown
    call(apps[1], "POST", f"/admin/rollouts/{own['id']}/rollback", json={"reason": "make room"})
    done = asyncio.run(fleet_rollouts.watch_once(router.replicas, router.ask_each, said))
    assert done == [{"fleet": fleet_id, "action": "join", "started_at": ["replica-1"], "state": "paused"}]
    joined, source = newest(apps[1]), newest(apps[0])
    assert (joined["policy"], joined["fraction"], joined["state"], joined["stops"]) == (
        source["policy"], 0.7, "paused", ["ttft_p95_seconds > 3 * baseline"])
    assert watch_once(router) == []  # every replica has it now
    shown = call(router_app(apps, "round_robin")[1], "GET", f"/admin/rollouts/{fleet_id}").json()
    assert shown["state"] == "paused"


def finished(prompt_tokens: int, cached: int, ttft: float, token_times: list[float], recomputed: int = 0):
    """A finished request as CohortStats.add reads one."""
    from types import SimpleNamespace

    return SimpleNamespace(prompt_ids=[0] * prompt_tokens, metrics=SimpleNamespace(
        cached_tokens=cached, recomputed_tokens=recomputed, preemptions=1 if recomputed else 0, finished_blocks=4,
        reserved_unused_blocks=1, ttft=ttft, token_times=token_times))


def test_a_side_pooled_across_replicas_has_the_figures_of_all_their_requests():
    from kvctl.daemon.server.cohort_stats import CohortStats

    requests = [finished(100 + i, 16 * (i % 3), 0.05 * (i + 1), [0.0, 0.01 * (i + 1), 0.03 * (i + 1)],
                         recomputed=i % 2) for i in range(9)]
    whole, parts = CohortStats(), [CohortStats(), CohortStats(), CohortStats()]
    for i, request in enumerate(requests):
        whole.add(request)
        parts[i % 3].add(request)
    pooled = CohortStats.pooled([part.sides_entry() for part in parts])
    assert pooled.figures() == whole.figures()
    assert pooled.figures()["requests"] == 9 and pooled.figures()["ttft_p95_seconds"] == pytest.approx(0.45)
    assert CohortStats.pooled([]).figures()["requests"] == 0


def test_a_fleet_rollout_judged_across_the_fleet_stops_on_the_fleet_s_figures(fleet):
    services, apps, router, app = fleet
    body = {"policy": {"name": "pooled", "judged": "fleet", "min_requests": 3, "settings": {"reservation": "p95"}},
            "cohort": "50%", "stops": ["hit_ratio < 2"]}
    alone = call(apps[0], "POST", "/admin/rollouts", json=body)
    assert alone.status_code == 400 and alone.json()["error"]["message"] == (
        "policy.judged: fleet is for a fleet rollout: start it at kvd router (kvctl rollout start there), which "
        "judges the stop conditions on every replica's traffic")
    fleet_id = call(app, "POST", "/admin/rollouts", json=body).json()["fleet"]
    tenants = [f"tenant-{i}" for i in range(40)]
    cohort = [t for t in tenants if in_cohort(fleet_id, t, 0.5)][:3]
    baseline = [t for t in tenants if not in_cohort(fleet_id, t, 0.5)][:3]
    for replica, names in ((0, cohort[:2] + baseline[:2]), (1, cohort[2:] + baseline[2:])):
        for tenant in names:
            answer = call(apps[replica], "POST", "/v1/completions", json={"prompt": "hello", "max_tokens": 2},
                          headers={"X-KVD-Tenant": tenant})
            assert answer.status_code == 200
    for service, each in zip(services, (2, 1)):
        books = service.rollouts
        assert settled(lambda: (books.cohort.requests, books.baseline.requests),
                       lambda sides: sides == (each, each)) == (each, each)
        assert books.evaluate() is None  # not the replica's to judge (it would trip on 3 a side)
    shown = call(app, "GET", f"/admin/rollouts/{fleet_id}").json()
    pooled = shown["fleet_figures"]
    assert pooled["replicas"] == ["replica-0", "replica-1"]
    assert (pooled["cohort"]["requests"], pooled["baseline"]["requests"]) == (3, 3)
    assert all("sides" not in row["report"] for row in shown["replicas"])
    code, text = kvctl_on(app, ["rollout", "status", fleet_id])
    assert code == 0 and "figures across the fleet (replica-0, replica-1)" in text
    assert "stop conditions judged by kvd router on the fleet's figures (judged: fleet)" in text
    done = watch_once(router)
    hit, other = pooled["cohort"]["hit_ratio"], pooled["baseline"]["hit_ratio"]
    reason = (f"stop condition tripped across the fleet (2 replicas, 3 cohort and 3 baseline requests): hit_ratio "
              f"< 2 (observed {hit:.4g}, threshold 2, baseline {other:.4g}); judged by kvd router's fleet rollout "
              "watch")
    assert [(d["action"], d["reason"], d["rolled_back"], d["figures"]["cohort"]["requests"]) for d in done] == [
        ("rollback", reason, ["replica-0", "replica-1"], 3)]
    for replica in apps:
        rolled = newest(replica)
        assert rolled["state"] == "rolled_back" and rolled["events"][-1]["detail"]["reason"] == reason
        assert all("sides" not in event["detail"] for event in rolled["events"])  # (kept, but not listed)
    ended = call(app, "GET", f"/admin/rollouts/{fleet_id}").json()  # the live figures went with the rollout
    assert ended["fleet_figures"] == kept_as(pooled)  # each replica kept its sides at its end
    code, text = kvctl_on(app, ["rollout", "status", fleet_id])
    assert code == 0 and "figures across the fleet at its end (replica-0, replica-1)" in " ".join(text.split())


def kept_as(pooled: dict) -> dict:
    """Figures across the fleet as they read once it has ended: its samples were kept to the microsecond."""
    return {**pooled, "ended": True, **{side: {name: pytest.approx(value, abs=1e-6) if isinstance(value, float)
                                               else value for name, value in pooled[side].items()}
                                        for side in ("cohort", "baseline")}}


def test_a_finished_fleet_rollout_keeps_its_figures_across_the_fleet_and_a_replica_s_own_keeps_no_samples(fleet):
    services, apps, router, app = fleet
    fleet_id = call(app, "POST", "/admin/rollouts", json=START).json()["fleet"]
    for i in range(6):
        answer = call(app, "POST", "/v1/completions", json={"prompt": f"hello {i}", "max_tokens": 2},
                      headers={"X-KVD-Tenant": f"tenant-{i}"})
        assert answer.status_code == 200
    assert settled(lambda: sum(s.rollouts.cohort.requests + s.rollouts.baseline.requests for s in services),
                   lambda count: count == 6) == 6
    live = call(app, "GET", f"/admin/rollouts/{fleet_id}").json()["fleet_figures"]
    assert live["ended"] is False and live["cohort"]["requests"] + live["baseline"]["requests"] == 6
    assert call(app, "POST", f"/admin/rollouts/{fleet_id}/complete").status_code == 200
    shown = call(app, "GET", f"/admin/rollouts/{fleet_id}").json()
    assert shown["state"] == "completed" and shown["fleet_figures"] == kept_as(live)
    [audited] = call(apps[0], "GET", "/admin/audit", params={"action": "rollout.complete"}).json()["entries"]
    assert audited["detail"] == {}  # (figures and samples stay in the rollout's record)
    own = call(apps[1], "POST", "/admin/rollouts", json=START).json()["id"]
    assert call(apps[1], "POST", f"/admin/rollouts/{own}/rollback", json={"reason": "x"}).status_code == 200
    assert "sides" not in call(apps[1], "GET", f"/admin/rollouts/{own}", params={"samples": "true"}).json()


def run_watch(router, until, replicas_of=None, timeout: float = 30.0) -> None:
    """The router's watch as kvd router runs it (every 0.05 s here), until `until()` or `timeout`."""
    import time

    router.rollout_watch.every_seconds = 0.05

    async def go():
        task = asyncio.create_task(fleet_rollouts.watch(replicas_of or (lambda: router.replicas), router.ask_each,
                                                        router.rollout_watch))
        deadline = time.monotonic() + timeout
        while not until() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    asyncio.run(go())


def test_the_router_s_watch_runs_by_itself_and_says_what_it_did_and_when_it_fails(fleet):
    _, apps, router, app = fleet
    fleet_id = call(app, "POST", "/admin/rollouts", json=START).json()["fleet"]
    call(apps[0], "POST", f"/admin/rollouts/{fleet_id}/rollback", json={"reason": "bad at 0"})
    book = router.rollout_watch
    run_watch(router, lambda: book.actions["rollback_after_replica"] > 0)
    assert newest(apps[1])["state"] == "rolled_back"
    said = call(app, "GET", "/router/status").json()["fleet_rollout_watch"]
    assert said["actions"] == {"rollback_after_replica": 1, "rollback_judged": 0, "join": 0}
    assert (said["error"], said["failures"], said["every_seconds"]) == (None, 0, 0.05) and said["checked_at"] > 0
    scraped = call(app, "GET", "/metrics").text.splitlines()
    assert 'kvd_router_fleet_rollout_actions_total{action="rollback_after_replica"} 1.0' in scraped
    assert 'kvd_router_fleet_rollout_actions_total{action="join"} 0.0' in scraped
    assert "kvd_router_fleet_rollout_watch_failures_total 0.0" in scraped

    def broken():
        raise RuntimeError("the fleet is not there")
    run_watch(router, lambda: book.failures >= 2, replicas_of=broken)
    assert book.error == "RuntimeError: the fleet is not there"
    code, status = kvctl_on(app, ["status"])
    assert code == 0
    assert (f"kvd router's fleet rollout watch: its latest check failed (RuntimeError: the fleet is not there; "
            f"{book.failures} so far; its log has each): it tries again every 0.05 s") in " ".join(status.split())
    run_watch(router, lambda: book.error is None)  # a check that runs to its end clears it
    assert book.error is None and book.actions["rollback_after_replica"] == 1


def test_judged_across_the_fleet_on_the_replicas_that_answer_and_the_rest_follow_when_they_do(fleet):
    services, apps, router, app = fleet
    body = {"policy": {"name": "pooled", "judged": "fleet", "min_requests": 2, "settings": {"reservation": "p95"}},
            "cohort": "50%", "stops": ["hit_ratio < 2"]}
    fleet_id = call(app, "POST", "/admin/rollouts", json=body).json()["fleet"]
    tenants = [f"tenant-{i}" for i in range(40)]
    sides = ([t for t in tenants if in_cohort(fleet_id, t, 0.5)][:2]
             + [t for t in tenants if not in_cohort(fleet_id, t, 0.5)][:2])
    for tenant in sides:  # all at replica-0
        call(apps[0], "POST", "/v1/completions", json={"prompt": "hello", "max_tokens": 1},
             headers={"X-KVD-Tenant": tenant})
    books = services[0].rollouts
    assert settled(lambda: (books.cohort.requests, books.baseline.requests), lambda got: got == (2, 2)) == (2, 2)
    down, _ = router_app(apps, "round_robin", down=(1,))
    [done] = asyncio.run(fleet_rollouts.watch_once(down.replicas, down.ask_each))
    assert done["reason"].startswith("stop condition tripped across the fleet (1 replica, 2 cohort and 2 baseline "
                                     "requests): hit_ratio < 2 (")
    assert done["rolled_back"] == ["replica-0"] and newest(apps[1])["state"] == "running"
    [then] = watch_once(router)  # replica-1 answers again: rolled back as replica-0 was
    assert (then["rolled_back_at"], then["rolled_back"]) == ("replica-0", ["replica-1"])
    assert then["reason"] == done["reason"] and newest(apps[1])["state"] == "rolled_back"
