"""Fleet rollouts at kvd router: one rollout of a policy at every replica, moved and stopped as one.

A rollout is a replica's own: its cohort, figures, stop conditions, store and number. `kvctl
rollout start` at the router starts one at every replica under one fleet id (`fleet-` and 12 hex
digits, in each one's policy as `fleet`):

- a tenant lands on the same side everywhere: each replica salts its cohort hash with the fleet id
  instead of its own number (policies/rollout.py), so a tenant's requests get the same settings
  wherever the router sends them;
- all or none: where a replica refuses it or is not reached, the replicas that started it roll it
  back at once, and the answer names the one that did not; a replica that joins the fleet
  later (or whose store was replaced) gets it from the watch, below, as it runs then;
- the fleet id names it at the router and at each replica: `kvctl rollout advance|pause|resume|
  rollback|complete fleet-…` moves it at every replica (`complete` first asks each that it still
  runs there: a fleet half completed and half rolled back is what it must not become);
- a stop at one is a stop at all: each replica judges the stop conditions on its own traffic, and
  the router's watch (`watch_once`, every FLEET_WATCH_S) rolls back at every replica a fleet
  rollout that one of them rolled back (a tripped stop condition, or an operator there), saying
  where and why. The watch keeps nothing of its own: it reads each replica's newest rollout, so a
  restarted router, or a second one, sees the same, and a replica that was not reached when the
  others rolled back is rolled back once it answers;
- or judged across the fleet, with `judged: fleet` in the policy: no replica judges its own
  traffic; the watch adds the replicas' sides up (totals summed, samples together:
  cohort_stats.py) and judges the stop conditions on that, so `min_requests` counts the fleet's
  requests, and a small unlucky sample at one of N replicas does not stop them all. Judged on the
  replicas that answer with their figures; not while one of them is paused. `kvctl rollout status
  FLEET` at the router shows the figures across the fleet either way (`fleet_figures`), and once
  it has ended, those at its end (each replica keeps its sides in its last transition).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Sequence

from kvctl.policies.rollout import FLEET_ID, new_fleet_id

from .cohort_stats import CohortStats, first_tripped
from .fleet_admin import Answer, error_said, none_did, replica_reports

log = logging.getLogger("kvd.router")

FLEET_WATCH_S = 5.0  # how often the router reads each replica's newest rollout
MOVE_TIMEOUT_S = 30.0  # a transition may wait for a replica's store (another process holding its write lock)
ACTIVE = ("running", "paused")
# what the watch did, by fleet rollout (kvd_router_fleet_rollout_actions_total{action}): rolled back at
# the other replicas after one rolled it back; rolled back on the fleet's figures (judged: fleet); started
# at a replica that joined since
WATCH_ACTIONS = ("rollback_after_replica", "rollback_judged", "join")
MOVES = ("advance", "pause", "resume", "rollback", "complete")
WATCH_ACTOR_NOTE = "kvd router's fleet rollout watch"

Ask = Callable[[Sequence, str, str, bytes | None, float], Awaitable[list[Answer]]]


def refused(status: int, message: str, code: str, param: str | None = None) -> tuple[int, dict]:
    return status, {"error": {"message": message, "type": "router_error", "param": param, "code": code}}


def fleet_named(given: str) -> tuple[int, dict] | None:
    """The refusal of a rollout named at the router by anything but a fleet id; None: a fleet id."""
    if FLEET_ID.fullmatch(given):
        return None
    return refused(400, f"rollout_id: at kvd router a rollout is named by its fleet id (fleet- and 12 hex digits, as "
                        f"kvctl rollout start here gave it), got {given[:80]!r}; a replica's rollout number is its "
                        "own: kvctl --socket REPLICA_SOCKET rollout ...", "invalid_request", "rollout_id")


def _names(replicas: Sequence, indexes) -> str:
    return ", ".join(replicas[i].name for i in indexes)


def _why(replica, answer: Answer) -> str:
    status, body = answer
    if status is None:
        return f"{replica.name} was not reached ({body.get('error')})"
    return f"{replica.name} refused it ({status}: {error_said(body)})"


async def start_everywhere(replicas: Sequence, ask: Ask, content: bytes) -> tuple[int, dict]:
    """`POST /admin/rollouts` at the router: the caller's body with a new fleet id in its policy, to
    every replica; (HTTP status, answer). All or none: see the module's docstring."""
    try:
        body = json.loads(content)
    except ValueError:
        body = None
    if not isinstance(body, dict):
        return refused(400, "body: expected a JSON object", "invalid_json")
    policy = body.get("policy")
    if isinstance(policy, dict) and "fleet" in policy:
        return refused(400, f"policy.fleet: kvd router names a fleet rollout itself; leave it out, got "
                            f"{str(policy['fleet'])[:80]!r}", "invalid_request", "policy")
    if not replicas:
        return refused(503, "no replica to start a rollout at", "no_replica")
    fleet = new_fleet_id()
    if isinstance(policy, dict):  # (else each replica refuses it, naming the field)
        body = {**body, "policy": {**policy, "fleet": fleet}}
    answers = await ask(replicas, "POST", "/admin/rollouts", json.dumps(body).encode(), MOVE_TIMEOUT_S)
    started = [i for i, (status, _) in enumerate(answers) if status == 200]
    if not started:
        return none_did([r.name for r in replicas], answers)
    if len(started) < len(replicas):
        missing = [i for i in range(len(replicas)) if i not in started]
        why = "; ".join(_why(replicas[i], answers[i]) for i in missing)
        reason = f"fleet rollout {fleet} did not start at every replica: {why}"
        undone = await ask([replicas[i] for i in started], "POST", f"/admin/rollouts/{fleet}/rollback",
                           json.dumps({"reason": reason}).encode(), MOVE_TIMEOUT_S)
        left = [i for i, (status, _) in zip(started, undone) if status != 200]
        statuses = [answers[i][0] for i in missing if answers[i][0] is not None]
        message = (f"fleet rollout not started: {why}; rolled back at {_names(replicas, started)} where it had "
                   "started" + (f" (not at {_names(replicas, left)}: roll it back there, kvctl rollout rollback "
                                f"{fleet} --reason ...)" if left else ""))
        return refused(statuses[0] if statuses else 503, message, "conflict" if statuses else "no_replica")
    status, out = replica_reports([r.name for r in replicas], answers)
    return status, {"fleet": fleet, "state": "running", **out}


def fleet_state(rows: list[dict]) -> str:
    """A fleet rollout's state from its replicas' reports: the one they share, else each one's."""
    states = {row["replica"]: row["report"]["state"] if "report" in row else
              "none" if row["status"] == 404 else "not known" for row in rows}
    if len(set(states.values())) == 1:
        return next(iter(states.values()))
    return "mixed: " + ", ".join(f"{state} at {name}" for name, state in states.items())


def pooled_sides(reports: list[dict]) -> tuple[CohortStats, CohortStats]:
    """(cohort, baseline) across the replicas' live reports of one fleet rollout (each with its
    `sides`: totals and latest samples, asked with samples=true)."""
    return (CohortStats.pooled([report["sides"]["cohort"] for report in reports]),
            CohortStats.pooled([report["sides"]["baseline"] for report in reports]))


async def status_everywhere(replicas: Sequence, ask: Ask, fleet: str, figures: bool = True) -> tuple[int, dict]:
    """`GET /admin/rollouts/FLEET` at the router: each replica's rollout of it, their state, and
    its figures across the fleet (`fleet_figures`: the replicas' totals added and their samples put
    together, as a policy's `judged: fleet` is judged): live while it runs, and once it has ended
    at every replica, as each one's was at its end (`ended` true); `figures` False: not asked."""
    path = f"/admin/rollouts/{fleet}" + ("?samples=true" if figures else "")
    answers = await ask(replicas, "GET", path, None, MOVE_TIMEOUT_S)
    status, out = replica_reports([r.name for r in replicas], answers)
    if status != 200:
        return status, out
    live = [row for row in out["replicas"] if (row.get("report") or {}).get("sides")]
    pooled = None
    if live:
        cohort, baseline = pooled_sides([row["report"] for row in live])
        pooled = {"replicas": [row["replica"] for row in live], "cohort": cohort.figures(),
                  "baseline": baseline.figures(), "ended": all(row["report"].get("sides_ended") for row in live)}
    for row in live:
        del row["report"]["sides"]  # (samples: the router's to add up, not the caller's to read)
        row["report"].pop("sides_ended", None)
    return 200, {"fleet": fleet, "state": fleet_state(out["replicas"]), "fleet_figures": pooled, **out}


async def move_everywhere(replicas: Sequence, ask: Ask, fleet: str, action: str,
                          content: bytes | None) -> tuple[int, dict]:
    """`POST /admin/rollouts/FLEET/ACTION` at the router: the move at every replica (each one finds
    its own rollout of the fleet rollout). A replica that never had it (404: one that joined since)
    has nothing to move; one that refused or was not reached is named, and the answer is `partial`."""
    if action == "complete":
        held = await _unfinished(replicas, ask, fleet)
        if held is not None:
            return held
    answers = await ask(replicas, "POST", f"/admin/rollouts/{fleet}/{action}", content or b"{}", MOVE_TIMEOUT_S)
    if not any(status == 200 for status, _ in answers):
        return none_did([r.name for r in replicas], answers)
    status, out = replica_reports([r.name for r in replicas], answers)
    failed = [i for i, (status, _) in enumerate(answers) if status not in (200, 404)]
    state = fleet_state(out["replicas"])
    if failed:  # where it was refused, its state as the replica says it now
        status, now = await status_everywhere(replicas, ask, fleet, figures=False)
        state = now["state"] if status == 200 else state
    out = {"fleet": fleet, "action": action, "state": state, "result": "partial" if failed else "ok", **out}
    if failed:
        out["message"] = (f"{action} not done at every replica: " + "; ".join(
            _why(replicas[i], answers[i]) for i in failed))
    return 200, out


async def _unfinished(replicas: Sequence, ask: Ask, fleet: str) -> tuple[int, dict] | None:
    """The refusal of a fleet rollout's completion while some replica's rollout of it is not
    running or paused, or a replica cannot say; None: complete it."""
    answers = await ask(replicas, "GET", f"/admin/rollouts/{fleet}", None, MOVE_TIMEOUT_S)
    not_reached = [i for i, (status, _) in enumerate(answers) if status is None or status >= 500]
    if not_reached:
        return refused(503, f"fleet rollout {fleet} not completed: every replica must say it still runs it, and "
                            + "; ".join(_why(replicas[i], answers[i]) for i in not_reached), "no_replica")
    ended = {i: body["state"] for i, (status, body) in enumerate(answers)
             if status == 200 and body["state"] not in ACTIVE}
    if ended:
        return refused(409, f"fleet rollout {fleet} not completed: it is " + ", ".join(
            f"{state} at {replicas[i].name}" for i, state in ended.items())
            + ("; kvd router's watch rolls it back at the others" if "rolled_back" in ended.values() else ""),
            "conflict", "rollout_id")
    return None


def rollback_reason(body: dict) -> str:
    """Why a replica's rollout was rolled back, from its status (the latest rollback's reason)."""
    for event in reversed(body.get("events") or []):
        if event.get("action") == "rollback":
            return str(event.get("detail", {}).get("reason") or "no reason given")
    return "no reason recorded"


async def watch_once(replicas: Sequence, ask: Ask, said: set | None = None) -> list[dict]:
    """Roll back, at every replica where it still runs, each fleet rollout that some replica rolled
    back; start one that runs at a replica that never had it (it joined the fleet since, or its
    store was replaced) with the settings it has now. What was done, one entry per fleet rollout
    and action; [] when nothing was. `said`: (fleet, replica) pairs already logged as left out."""
    if len(replicas) < 2:
        return []
    said = set() if said is None else said
    newest = await ask(replicas, "GET", "/admin/rollouts/history?limit=1", None, MOVE_TIMEOUT_S)
    running: dict[str, list[int]] = {}  # fleet id -> the replicas whose newest rollout is it, running or paused
    for i, (status, body) in enumerate(newest):
        rollouts = body.get("rollouts") if status == 200 else None
        if rollouts and rollouts[0]["state"] in ACTIVE and rollouts[0]["policy"].get("fleet"):
            running.setdefault(rollouts[0]["policy"]["fleet"], []).append(i)
    done = []
    for fleet, where in running.items():
        others = [i for i in range(len(replicas)) if i not in where]
        if not others:
            continue
        states = await ask([replicas[i] for i in others], "GET", f"/admin/rollouts/{fleet}", None, MOVE_TIMEOUT_S)
        stopped = [(i, body) for i, (status, body) in zip(others, states)
                   if status == 200 and body.get("state") == "rolled_back"]
        if not stopped:
            lacking = [i for i, (status, _) in zip(others, states) if status == 404]
            if lacking:
                done += await _join(replicas, ask, fleet, where[0], lacking, newest, said)
            continue
        at, body = stopped[0]
        reason = (f"fleet rollout {fleet} was rolled back at {replicas[at].name} ({rollback_reason(body)}): "
                  f"{WATCH_ACTOR_NOTE} rolls it back at every replica")
        entry = await _roll_back(replicas, ask, fleet, where, reason)
        log.warning("fleet rollout %s was rolled back at %s (%s): rolled back at %s too%s", fleet, replicas[at].name,
                    rollback_reason(body), ", ".join(entry["rolled_back"]) or "no other replica",
                    _not_yet(entry))
        done.append({**entry, "rolled_back_at": replicas[at].name, "reason": rollback_reason(body)})
    for fleet, where in running.items():
        if any(entry["fleet"] == fleet for entry in done):
            continue
        judged = await _judge(replicas, ask, fleet, where, newest)
        if judged is not None:
            done.append(judged)
    return done


async def _roll_back(replicas: Sequence, ask: Ask, fleet: str, where: list[int], reason: str) -> dict:
    """Roll fleet rollout `fleet` back at the replicas `where`, for `reason`: where it was, and
    where not (a 409 is one rolled back meanwhile, by kvd or another router: not a failure)."""
    answers = await ask([replicas[i] for i in where], "POST", f"/admin/rollouts/{fleet}/rollback",
                        json.dumps({"reason": reason}).encode(), MOVE_TIMEOUT_S)
    rolled = [replicas[i].name for i, (status, _) in zip(where, answers) if status == 200]
    left = {replicas[i].name: _why(replicas[i], answer) for i, answer in zip(where, answers)
            if answer[0] not in (200, 409)}
    return {"fleet": fleet, "action": "rollback", "rolled_back": rolled, "not_rolled_back": left}


def _not_yet(entry: dict) -> str:
    left = entry["not_rolled_back"]
    return "; not at " + "; ".join(left.values()) + ": tried again at the next check" if left else ""


async def _judge(replicas: Sequence, ask: Ask, fleet: str, where: list[int], newest: list[Answer]) -> dict | None:
    """A fleet rollout whose policy says `judged: fleet`, running at every replica that has it: its
    stop conditions against its figures across those that answer with them (pooled_sides: a
    replica not reached serves none of its traffic); tripped, it is rolled back at each. Not judged
    while one of them is paused."""
    first = newest[where[0]][1]["rollouts"][0]
    if first["policy"].get("judged") != "fleet" or any(newest[i][1]["rollouts"][0]["state"] != "running"
                                                        for i in where):
        return None
    answers = await ask([replicas[i] for i in where], "GET", f"/admin/rollouts/{fleet}?samples=true", None,
                        MOVE_TIMEOUT_S)
    reports = [body for status, body in answers if status == 200 and body.get("sides") and not body.get("sides_ended")]
    if not reports:
        return None
    cohort, baseline = pooled_sides(reports)
    tripped = first_tripped(reports[0], cohort, baseline)
    if tripped is None:
        return None
    compared = ", ".join(f"{name} {tripped[name]:.4g}" for name in ("observed", "threshold", "baseline")
                         if isinstance(tripped.get(name), (int, float)))
    counted = f"{len(reports)} replica{'s' if len(reports) != 1 else ''}"
    reason = (f"stop condition tripped across the fleet ({counted}, {cohort.requests:,} cohort and "
              f"{baseline.requests:,} baseline requests): {tripped['condition']} ({compared}); judged by "
              f"{WATCH_ACTOR_NOTE}")
    entry = await _roll_back(replicas, ask, fleet, where, reason)
    log.warning("fleet rollout %s: %s; rolled back at %s%s", fleet, reason, ", ".join(entry["rolled_back"]) or
                "no replica", _not_yet(entry))
    return {**entry, "rolled_back_at": None, "reason": reason, "figures": tripped["figures"]}


async def _join(replicas: Sequence, ask: Ask, fleet: str, source: int, lacking: list[int],
                newest: list[Answer], said: set) -> list[dict]:
    """Start fleet rollout `fleet` at the replicas `lacking` it, as it is now at replica `source`
    (policy, cohort share, stop conditions, paused or not): each one that runs no rollout of its
    own (one that does is left out, and the log says so once)."""
    free, busy = [], []
    for i in lacking:
        if getattr(replicas[i], "leaving", False):
            continue
        status, body = newest[i]
        rollouts = body.get("rollouts") if status == 200 else None
        if status != 200:
            continue
        (busy if rollouts and rollouts[0]["state"] in ACTIVE else free).append(i)
    for i in busy:
        if (fleet, replicas[i].name) not in said:
            said.add((fleet, replicas[i].name))
            log.warning("fleet rollout %s: not started at %s, which joined the fleet since it started: a rollout "
                        "of its own runs there (roll that back for it to join)", fleet, replicas[i].name)
    if not free:
        return []
    (status, now), = await ask([replicas[source]], "GET", f"/admin/rollouts/{fleet}", None, MOVE_TIMEOUT_S)
    if status != 200 or now["state"] not in ACTIVE:
        return []
    policy = {key: value for key, value in now["policy"].items() if key != "version"}
    body = json.dumps({"policy": policy, "cohort": now["fraction"], "stops": now["stops"], "adr": now["adr_id"]})
    answers = await ask([replicas[i] for i in free], "POST", "/admin/rollouts", body.encode(), MOVE_TIMEOUT_S)
    started = [i for i, (status, _) in zip(free, answers) if status == 200]
    if now["state"] == "paused" and started:
        await ask([replicas[i] for i in started], "POST", f"/admin/rollouts/{fleet}/pause", b"{}", MOVE_TIMEOUT_S)
    for i, answer in zip(free, answers):
        if answer[0] != 200 and (fleet, replicas[i].name) not in said:
            said.add((fleet, replicas[i].name))
            log.warning("fleet rollout %s: not started at %s, which joined the fleet since it started: %s", fleet,
                        replicas[i].name, _why(replicas[i], answer))
    if not started:
        return []
    log.info("fleet rollout %s started at %s, which joined the fleet since it started (cohort %.0f%%, %s)", fleet,
             _names(replicas, started), now["fraction"] * 100, now["state"])
    return [{"fleet": fleet, "action": "join", "started_at": [replicas[i].name for i in started],
             "state": now["state"]}]


@dataclass
class WatchBook:
    """What the router's watch has done (its /router/status, kvctl status, and /metrics)."""

    every_seconds: float = FLEET_WATCH_S
    checked_at: float | None = None  # the latest check that ran to its end (wall clock)
    error: str | None = None  # why the latest check failed; None once one runs to its end again
    failures: int = 0
    actions: Counter = field(default_factory=Counter)  # WATCH_ACTIONS: fleet rollouts acted on
    said: set = field(default_factory=set)  # (fleet, replica) pairs already logged as left out of a join

    def noted(self, done: list[dict]) -> None:
        for entry in done:
            self.actions["join" if entry["action"] == "join" else
                         "rollback_judged" if entry["rolled_back_at"] is None else "rollback_after_replica"] += 1

    def report(self) -> dict:
        return {"every_seconds": self.every_seconds, "checked_at": self.checked_at, "error": self.error,
                "failures": self.failures, "actions": {name: self.actions[name] for name in WATCH_ACTIONS}}


async def watch(replicas_of: Callable[[], Sequence], ask: Ask, book: WatchBook) -> None:
    """`watch_once` every `book.every_seconds` until cancelled (`replicas_of()`: the fleet as it is
    now), noting in `book` what it did; a check that fails is logged and the next one tries again."""
    while True:
        await asyncio.sleep(book.every_seconds)
        try:
            book.noted(await watch_once(list(replicas_of()), ask, book.said))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the watch outlives one bad answer
            book.failures += 1
            book.error = f"{type(exc).__name__}: {exc}"[:300]
            log.exception("fleet rollout watch: the check failed; the next one tries again")
        else:
            book.checked_at, book.error = time.time(), None
