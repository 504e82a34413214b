"""Rollouts of live policy settings to a cohort, with stop conditions that roll back by themselves.

A policy file versions the settings a cohort gets: the output `reservation`, and
`speculative_config` (speculative decoding on, off or tuned for the cohort alone, judged by its
time per output token). The eviction policy is one per cache pool and changes through the config
and SIGHUP. Requests join the cohort by a stable hash of their tenant (or of the request id with
`by: request`); cohort and baseline figures are kept apart. `evaluate()` runs on a schedule: when a stop
condition trips, the rollout rolls back and records which condition and the values. Every
transition is stored with who and when, with the cohort and baseline figures at that moment,
so a finished rollout still shows what it was judged on; a fleet rollout's (one of kvd router's)
last transition keeps each side's totals and latest samples too (`sides`), which kvd router adds
up across the fleet once the live ones are gone. A restart resumes the rollout in its
recorded state; the figures up to the stop are stored as a "shutdown" event, and the live
ones start again from zero (`figures_since` says from when).

A rollback kvd makes on a tripped stop condition is in force at once. When the store cannot take
it (another process holds its write lock, a full disk), kvd keeps it whole in
`STATE_DIR/rollback-pending.json` until the store does, so a restart meanwhile keeps the rollout
rolled back instead of resuming the cohort a stop condition had stopped.

Policy file (YAML)::

    name: reserve-p95
    by: tenant            # or: request
    min_requests: 50      # optional; else 5 a side, 20 for a p95 condition (`min_requests`)
    judged: replica       # or fleet: kvd router judges a fleet rollout on the fleet's figures (fleet_rollouts.py)
    settings:
      reservation: p95
      speculative_config: {num_speculative_tokens: 4}    # or null: none for the cohort
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from pathlib import Path

from kvctl.daemon.config import speculation_of, speculative_config
from kvctl.daemon.engine.requests import Request
from kvctl.daemon.engine.speculative import SpeculationOverride
from kvctl.daemon.store import Store, StoreUnavailable
from kvctl.daemon.whole_file import write_json_whole
from kvctl.policies.reservation import parse_reservation
from kvctl.policies.rollout import FLEET_ID, MIN_REQUESTS, StopCondition, cohort_salt, in_cohort, parse_fraction

from .calls import ServiceError
from .cohort_stats import CohortStats, first_tripped, kept_entry, min_requests
from .whole_numbers import whole_number

COHORT_SETTINGS = ("reservation", "speculative_config")
POOL_SETTINGS = ("eviction", "block_size", "cache_dtype", "num_blocks")
ACTIVE_STATES = ("running", "paused")

log = logging.getLogger("kvd")
UNSTORED = ("kvd rolled it back on a stop condition, and the store could not take that yet: kvd tries again at "
            "each check; a restart before then resumes the rollout")
PENDING_FIELDS = ("rollout_id", "at", "actor", "action", "detail")  # what that file holds of one
AUDIT_LEAVES_OUT = ("figures", "sides")  # a transition's figures and samples stay in the rollout's record
LISTING_LEAVES_OUT = ("sides",)  # status() lists no samples: a fleet rollout's are for kvd router to add up


def leaving_out(detail: dict, names: tuple[str, ...]) -> dict:
    """A transition's detail without the keys `names`."""
    return {key: value for key, value in detail.items() if key not in names}


def unstored_text(pending: dict) -> str:
    """What a rollback the store has not taken means for the operator: kept on disk beside the
    store (a restart keeps it), or only in kvd's memory (a restart resumes the rollout)."""
    if pending.get("kept"):
        return ("kvd rolled it back on a stop condition, and the store could not take that yet: kvd tries again at "
                f"each check and keeps it in {pending['kept']} meanwhile, so a restart keeps it rolled back")
    return UNSTORED


def traffic_split(rollout: dict, cohort: dict, baseline: dict) -> dict:
    """How the requests actually split, beside what was asked, and whether the stop conditions
    are being checked: with cohorts by tenant and few tenants the split is coarse (one tenant
    puts all traffic on one side), and a side with too few requests leaves the stops unchecked."""
    total = cohort["requests"] + baseline["requests"]
    needed = max((min_requests(rollout, StopCondition.parse(text)) for text in rollout["stops"]),
                 default=rollout["policy"].get("min_requests") or MIN_REQUESTS)
    short = [f"{side} has {figures['requests']}" for side, figures in (("cohort", cohort), ("baseline", baseline))
             if figures["requests"] < needed]
    return {"by": rollout["policy"].get("by", "tenant"), "requests": total,
            "cohort_share": cohort["requests"] / total if total else None,
            "stops_checked": not short,
            "stops_waiting_for": None if not short else f"{needed} requests on each side ({', '.join(short)})"}


def validate_policy(policy: object) -> dict:
    if not isinstance(policy, dict):
        raise ServiceError(400, "policy: expected a mapping with 'settings'", "policy")
    settings = policy.get("settings")
    if not isinstance(settings, dict) or not settings:
        raise ServiceError(400, "policy.settings: give at least one setting, e.g. reservation: p95", "policy")
    for key, value in settings.items():
        if key in POOL_SETTINGS:
            raise ServiceError(400, f"policy.settings.{key}: is one per cache pool and cannot differ by cohort; "
                                    "change it in the config (SIGHUP or restart)", "policy")
        if key not in COHORT_SETTINGS:
            raise ServiceError(400, f"policy.settings.{key}: unknown; cohort settings are "
                                    f"{', '.join(COHORT_SETTINGS)}", "policy")
        if key == "reservation":
            try:
                parse_reservation(str(value))
            except ValueError as exc:
                raise ServiceError(400, f"policy.settings.reservation: {exc}", "policy") from None
        if key == "speculative_config":
            try:
                speculative_config(value)
            except ValueError as exc:
                raise ServiceError(400, f"policy.settings.speculative_config: {exc}", "policy") from None
    wanted = policy.get("min_requests")
    if wanted is not None and (not isinstance(wanted, int) or isinstance(wanted, bool) or wanted < 1):
        raise ServiceError(400, f"policy.min_requests: must be a whole number of at least 1, got {wanted!r}",
                           "policy")
    fleet = policy.get("fleet")
    if fleet is not None and not (isinstance(fleet, str) and FLEET_ID.fullmatch(fleet)):
        raise ServiceError(400, f"policy.fleet: expected a fleet rollout's id (fleet- and 12 hex digits, as kvd "
                                f"router names one), got {fleet!r}", "policy")
    judged = policy.get("judged", "replica")
    if judged not in ("replica", "fleet"):
        raise ServiceError(400, f"policy.judged: invalid value {judged!r}; use replica (each replica judges the stop "
                                "conditions on its own traffic) or fleet (kvd router judges them on the fleet's)",
                           "policy")
    if judged == "fleet" and fleet is None:
        raise ServiceError(400, "policy.judged: fleet is for a fleet rollout: start it at kvd router (kvctl rollout "
                                "start there), which judges the stop conditions on every replica's traffic", "policy")
    if policy.get("by", "tenant") not in ("tenant", "request"):
        raise ServiceError(400, f"policy.by: invalid value {policy.get('by')!r}; use tenant or request", "policy")
    return policy


class RolloutManager:
    """The rollout in force, its live figures, and its transitions.

    NOTE: two locks. `lock` guards the state in memory and is held only briefly: the engine
    thread takes it for every request it admits (`assign`) and finishes (`observe`). `_moves`
    puts the transitions one after another and is held across their store writes, which wait
    while another process holds the store's write lock; held under `lock`, such a wait stopped
    every token."""

    def __init__(self, store: Store, clock=time.time, pending_path: str | Path | None = None) -> None:
        self.store, self.clock = store, clock
        self.pending_path = None if pending_path is None else Path(pending_path)  # see the module's docstring
        self.lock = threading.RLock()
        self._moves = threading.Lock()
        self.active: dict | None = None  # the running or paused rollout
        # a rollback kvd made on a tripped stop condition that the store could not take yet: in
        # force (the cohort is gone), stored by the next evaluate() that can; lost if kvd stops first
        self.unstored: dict | None = None
        self.candidate = None  # its reservation policy instance (learns as its cohort finishes)
        self.candidate_speculation = None  # its cohort's SpeculationOverride (speculative_config); None: the engine's
        self.cohort = CohortStats()
        self.baseline = CohortStats()
        self.figures_since: float | None = None  # when the live figures started counting
        self.restore()

    # ---- persistence -------------------------------------------------------------------------
    def _row(self, rollout_id: int) -> dict:
        row = self.store.read_one("SELECT id, created_at, state, fraction, policy, stops, adr_id, actor "
                                  "FROM rollouts WHERE id = ?", (rollout_id,))
        if row is None:
            raise ServiceError(404, f"rollout {rollout_id}: no such rollout", "rollout_id")
        return {"id": row[0], "created_at": row[1], "state": row[2], "fraction": row[3],
                "policy": json.loads(row[4]), "stops": json.loads(row[5]), "adr_id": row[6], "actor": row[7]}

    def _event(self, conn, rollout_id: int, actor: str, action: str, detail: dict, at: float | None = None) -> None:
        conn.execute("INSERT INTO rollout_events (rollout_id, at, actor, action, detail) VALUES (?, ?, ?, ?, ?)",
                     (rollout_id, self.clock() if at is None else at, actor, action, json.dumps(detail, sort_keys=True)))

    def resolve(self, given: str) -> int:
        """A rollout named in a path: by its number, or by the fleet rollout it is one of (the
        newest of this replica's rollouts with that fleet id; kvd router names a fleet rollout so)."""
        number = whole_number(given)
        if number is not None:
            return number
        if not FLEET_ID.fullmatch(given):
            raise ServiceError(400, f"rollout_id: expected a rollout's number or a fleet rollout's id (fleet- and 12 "
                                    f"hex digits), got {given[:80]!r}", "rollout_id")
        row = self.store.read_one("SELECT id FROM rollouts WHERE json_extract(policy, '$.fleet') = ? "
                                  "ORDER BY id DESC LIMIT 1", (given,))
        if row is None:
            raise ServiceError(404, f"rollout {given}: no rollout of that fleet rollout here", "rollout_id")
        return row[0]

    def restore(self) -> None:
        row = self.store.read_one("SELECT id FROM rollouts WHERE state IN ('running', 'paused') "
                                  "ORDER BY id DESC LIMIT 1")
        pending = self._read_pending()
        if pending is not None and row is not None and row[0] == pending["rollout_id"]:
            # kvd rolled it back before it stopped, and the store had not taken that: it stays rolled back
            self.unstored = {**pending, "kept": str(self.pending_path), "said": True}
            log.warning("rollout %d: kvd rolled it back before it stopped (%s), and the store had not taken that; "
                        "it stays rolled back", pending["rollout_id"], pending["detail"]["reason"])
            with self._moves:
                try:  # a moment at most: a store another process holds locked must not hold up the start
                    self._store_unstored(wait=1.0)
                except StoreUnavailable as exc:
                    log.error("rollout %d: its rollback is still not stored (%s): kvd tries again at each check",
                              pending["rollout_id"], exc)
            return
        if pending is not None:  # stored after all, or moved on since (an operator with kvctl): nothing to do
            self._forget_pending()
        if row is not None:
            self._activate(self._row(row[0]))

    def _read_pending(self) -> dict | None:
        """The rollback kept beside the store by a kvd that stopped before the store took it, if
        one is there and whole; one that does not parse is named in the log and left where it is."""
        if self.pending_path is None or not self.pending_path.exists():
            return None
        try:
            pending = json.loads(self.pending_path.read_text())
            if not (isinstance(pending, dict) and isinstance(pending.get("rollout_id"), int)
                    and isinstance(pending.get("at"), (int, float)) and isinstance(pending.get("actor"), str)
                    and pending.get("action") == "rollback" and isinstance(pending.get("detail"), dict)
                    and isinstance(pending["detail"].get("reason"), str)):
                raise ValueError("not a pending rollback")
        except (OSError, ValueError) as exc:
            log.error("%s: cannot be read as a pending rollback (%s); left where it is, and ignored",
                      self.pending_path, exc)
            return None
        return {key: pending[key] for key in PENDING_FIELDS}

    def _keep_pending(self) -> None:
        """Write the rollback the store could not take beside it (the lock held); say where it went."""
        if self.pending_path is None:
            return
        record = {key: self.unstored[key] for key in PENDING_FIELDS}
        try:
            write_json_whole(self.pending_path, record)
        except OSError as exc:
            log.error("rollout %d: its rollback could not be kept in %s either (%s): a restart before the store "
                      "takes it resumes the rollout", record["rollout_id"], self.pending_path, exc)
            return
        self.unstored["kept"] = str(self.pending_path)

    def _forget_pending(self) -> None:
        if self.pending_path is not None:
            try:
                self.pending_path.unlink(missing_ok=True)
            except OSError as exc:  # the next start finds the rollout stored and deletes it then
                log.warning("%s: not deleted (%s)", self.pending_path, exc)

    def _activate(self, rollout: dict | None) -> None:
        self.active = rollout
        self.cohort, self.baseline = CohortStats(), CohortStats()
        self.figures_since = None if rollout is None else self.clock()
        self.candidate = None
        self.candidate_speculation = None  # the cohort's SpeculationOverride; None: the engine's speculation
        settings = {} if rollout is None else rollout["policy"]["settings"]
        if "reservation" in settings:
            self.candidate = parse_reservation(str(settings["reservation"]))
        if "speculative_config" in settings:
            self.candidate_speculation = SpeculationOverride(speculation_of(speculative_config(
                settings["speculative_config"])))

    # ---- transitions -------------------------------------------------------------------------
    def start(self, policy: dict, fraction: str | float, stops: list[str], adr_id: int | None,
              actor: str) -> dict:
        policy = validate_policy(policy)
        try:
            share = parse_fraction(fraction)
            conditions = [StopCondition.parse(s).text for s in stops]
        except ValueError as exc:
            raise ServiceError(400, str(exc), "stop" if "stop" in str(exc) else "cohort") from None
        if adr_id is not None and self.store.read_one("SELECT 1 FROM adrs WHERE id = ?", (adr_id,)) is None:
            raise ServiceError(404, f"adr: no record {adr_id}", "adr")
        with self._moves:
            self._store_unstored()
            with self.lock:
                if self.active is not None:
                    raise ServiceError(409, f"rollout {self.active['id']} is {self.active['state']}; complete or "
                                            "roll it back first")
            versioned = {key: value for key, value in policy.items() if key != "fleet"}  # the same policy, alone or not
            digest = hashlib.sha256(json.dumps(versioned, sort_keys=True).encode()).hexdigest()[:12]
            policy = {**policy, "version": digest}
            with self.store.write() as conn:
                rollout_id = conn.execute(
                    "INSERT INTO rollouts (created_at, state, fraction, policy, stops, adr_id, actor) "
                    "VALUES (?, 'running', ?, ?, ?, ?, ?)",
                    (self.clock(), share, json.dumps(policy), json.dumps(conditions), adr_id, actor)).lastrowid
                self._event(conn, rollout_id, actor, "start", {"fraction": share, "stops": conditions})
            row = self._row(rollout_id)
            with self.lock:
                self._activate(row)
        self.store.audit(actor=actor, tenant="-", action="rollout.start", target=f"rollout:{rollout_id}",
                         result="ok", detail={"fraction": share, "policy_version": policy["version"]})
        return self.status(rollout_id)

    def _move(self, rollout_id: int, state: str, actor: str, action: str, allowed: tuple[str, ...],
              detail: dict, fraction: float | None = None) -> dict:
        """An operator's transition: stored, then in force; one the store cannot take is refused
        whole (StoreUnavailable: 503). (A tripped stop condition is `evaluate`'s.)"""
        with self._moves:
            self._store_unstored()  # a tripped rollback first: this one then sees it
            row = self._row(rollout_id)
            if row["state"] not in allowed:
                raise ServiceError(409, f"rollout {rollout_id}: cannot {action} while {row['state']}")
            with self.lock:
                if self.active is not None and self.active["id"] == rollout_id:  # what it was judged on
                    detail = {**detail, "figures": {"cohort": self.cohort.figures(),
                                                    "baseline": self.baseline.figures(),
                                                    "since": self.figures_since}}
                    sides = None if state in ACTIVE_STATES else self._final_sides(self.active)
                    if sides is not None:
                        detail["sides"] = sides
            with self.store.write() as conn:
                if fraction is not None:
                    conn.execute("UPDATE rollouts SET fraction = ? WHERE id = ?", (fraction, rollout_id))
                conn.execute("UPDATE rollouts SET state = ? WHERE id = ?", (state, rollout_id))
                self._event(conn, rollout_id, actor, action, detail)
            row = self._row(rollout_id)
            with self.lock:
                if self.unstored is not None and self.unstored["rollout_id"] == rollout_id:
                    pass  # a stop condition tripped meanwhile: rolled back, stored next
                elif state in ACTIVE_STATES:
                    figures = (self.cohort, self.baseline, self.figures_since)
                    self._activate(row)
                    self.cohort, self.baseline, self.figures_since = figures
                else:
                    self._activate(None)
        self.store.audit(actor=actor, tenant="-", action=f"rollout.{action}", target=f"rollout:{rollout_id}",
                         result="ok", detail=leaving_out(detail, AUDIT_LEAVES_OUT))
        return self.status(rollout_id)

    def _store_unstored(self, wait: float | None = None) -> None:
        """Store the rollback that waits for the store, if one does (under `_moves`). Raises
        StoreUnavailable while the store still cannot take it (`wait`: as `Store.write`'s)."""
        pending = self.unstored
        if pending is None:
            return
        with self.store.write(wait) as conn:
            conn.execute("UPDATE rollouts SET state = 'rolled_back' WHERE id = ?", (pending["rollout_id"],))
            self._event(conn, pending["rollout_id"], pending["actor"], pending["action"], pending["detail"],
                        pending["at"])
        self.unstored = None
        self._forget_pending()
        if pending.get("said"):
            log.info("rollout %d: its rollback is stored now", pending["rollout_id"])
        self.store.audit(actor=pending["actor"], tenant="-", action="rollout.rollback",
                         target=f"rollout:{pending['rollout_id']}", result="ok",
                         detail=leaving_out(pending["detail"], AUDIT_LEAVES_OUT))

    def _final_sides(self, rollout: dict) -> dict | None:
        """Each side's totals and latest samples as a fleet rollout ends here (kept in its last
        transition for kvd router's figures across the fleet); None for a replica's own (under `lock`)."""
        if not rollout["policy"].get("fleet"):
            return None
        return {side: kept_entry(stats.sides_entry()) for side, stats in (("cohort", self.cohort),
                                                                          ("baseline", self.baseline))}

    def record_figures(self, action: str, actor: str, wait: float | None = None) -> None:
        """Store the running or paused rollout's live figures as an event that changes nothing
        (at shutdown: they would otherwise be lost with the process); nothing without a rollout
        or before its first request. What the store cannot take within `wait` seconds (default:
        its busy timeout) is logged whole."""
        if not self._moves.acquire(timeout=-1 if wait is None else wait):
            log.error("rollout figures at %s not stored: a transition held the store past %.0f s", action, wait)
            return
        try:
            with self.lock:
                rollout = self.active
                if rollout is None or self.cohort.requests + self.baseline.requests == 0:
                    figures = None
                else:
                    figures = {"cohort": self.cohort.figures(), "baseline": self.baseline.figures(),
                               "since": self.figures_since}
            try:
                self._store_unstored(wait)
                if figures is not None:
                    with self.store.write(wait) as conn:
                        self._event(conn, rollout["id"], actor, action, {"figures": figures})
            except StoreUnavailable as exc:
                if self.unstored is not None and self.unstored.get("kept"):
                    log.error("rollout %d: kvd rolled it back (%s) and the store has not taken it (%s): %s keeps "
                              "it, and the next start stores it", self.unstored["rollout_id"],
                              self.unstored["detail"]["reason"], exc, self.unstored["kept"])
                elif self.unstored is not None:
                    log.error("rollout %d: kvd rolled it back (%s) and the store never took it (%s): it resumes "
                              "at the next start; roll it back then (kvctl rollout rollback %d)",
                              self.unstored["rollout_id"], self.unstored["detail"]["reason"], exc,
                              self.unstored["rollout_id"])
                if figures is not None:
                    log.error("rollout %d: its figures at %s were not stored (%s): %s", rollout["id"], action, exc,
                              json.dumps(figures, sort_keys=True))
        finally:
            self._moves.release()

    def advance(self, rollout_id: int, to: str | float, actor: str) -> dict:
        try:
            share = parse_fraction(to)
        except ValueError as exc:
            raise ServiceError(400, str(exc), "to") from None
        return self._move(rollout_id, "running", actor, "advance", ("running", "paused"), {"to": share},
                          fraction=share)

    def pause(self, rollout_id: int, actor: str) -> dict:
        return self._move(rollout_id, "paused", actor, "pause", ("running",), {})

    def resume(self, rollout_id: int, actor: str) -> dict:
        return self._move(rollout_id, "running", actor, "resume", ("paused",), {})

    def rollback(self, rollout_id: int, reason: str, actor: str) -> dict:
        return self._move(rollout_id, "rolled_back", actor, "rollback", ACTIVE_STATES, {"reason": reason})

    def complete(self, rollout_id: int, actor: str) -> dict:
        return self._move(rollout_id, "completed", actor, "complete", ACTIVE_STATES, {})

    # ---- traffic -----------------------------------------------------------------------------
    def assign(self, tenant: str, request_id: str):
        """(reservation policy, SpeculationOverride, cohort label) for a new request: the cohort's
        own where the policy sets them, else None (the engine's); (None, None, None) with no rollout."""
        with self.lock:
            rollout = self.active
            if rollout is None:
                return None, None, None
            key = request_id if rollout["policy"].get("by") == "request" else tenant
            salt = cohort_salt(rollout["id"], rollout["policy"].get("fleet"))
            chosen = rollout["state"] == "running" and in_cohort(salt, key, rollout["fraction"])
            return (self.candidate, self.candidate_speculation, "candidate") if chosen else (None, None, "baseline")

    def observe(self, request: Request) -> None:
        with self.lock:
            if self.active is None or request.cohort is None or request.cancelled:
                return
            (self.cohort if request.cohort == "candidate" else self.baseline).add(request)

    def evaluate(self) -> dict | None:
        """Check the stop conditions that have enough requests on each side (`min_requests`);
        when one trips, roll back (and say why): in force at once, then stored (`unstored` until
        the store takes it; each evaluate tries again, and raises StoreUnavailable while it
        still cannot)."""
        with self.lock:
            rollout = self.active
            tripped = None
            # (a fleet rollout judged across the fleet is kvd router's to stop: fleet_rollouts.py)
            if rollout is not None and rollout["state"] == "running" and rollout["policy"].get("judged") != "fleet":
                tripped = first_tripped(rollout, self.cohort, self.baseline)
                if tripped is not None:
                    tripped["figures"]["since"] = self.figures_since
                    sides = self._final_sides(rollout)
                    if sides is not None:
                        tripped["sides"] = sides
            if tripped is not None:  # the cohort goes now, whatever the store does
                self._activate(None)
                self.unstored = {"rollout_id": rollout["id"], "at": self.clock(), "actor": "kvd",
                                 "action": "rollback", "detail": tripped}
        with self._moves:
            try:
                self._store_unstored()
            except StoreUnavailable as exc:
                if tripped is not None:
                    self._keep_pending()
                    kept = self.unstored.get("kept")
                    log.error("rollout %d rolled back (%s); the store cannot take that now (%s): kvd tries again "
                              "at each check%s; the record: %s", rollout["id"], tripped["reason"], exc,
                              f" and keeps it in {kept} meanwhile (a restart keeps it rolled back)" if kept else
                              ", and a restart before it does resumes the rollout",
                              json.dumps({k: v for k, v in self.unstored.items() if k != "kept"}, sort_keys=True))
                    self.unstored["said"] = True
                    return self.status(rollout["id"])
                raise
        return None if tripped is None else self.status(rollout["id"])

    def status(self, rollout_id: int | None = None, samples: bool = False) -> dict:
        """A rollout (default: the active one, else the latest) with its transitions, and its live
        figures while it is active (`samples`: each side's totals and latest samples too, `sides`,
        which kvd router adds up across the fleet; once a fleet rollout has ended, those its last
        transition kept, with `sides_ended` true). NOTE: the store is read outside `lock`, which the
        engine thread takes: no file I/O under it."""
        active = self.active
        if rollout_id is None:
            if active is None:
                row = self.store.read_one("SELECT max(id) FROM rollouts")
                if row[0] is None:
                    raise ServiceError(404, "rollout: none has been started", "rollout_id")
                rollout_id = row[0]
            else:
                rollout_id = active["id"]
        row = self._row(rollout_id)
        events = [{"at": e[0], "actor": e[1], "action": e[2], "detail": json.loads(e[3])}
                  for e in self.store.read("SELECT at, actor, action, detail FROM rollout_events "
                                           "WHERE rollout_id = ? ORDER BY id", (rollout_id,))]
        with self.lock:
            pending = self.unstored
            unstored = pending is not None and pending["rollout_id"] == rollout_id
            if unstored:  # in force, not yet in the store
                row["state"] = "rolled_back"
                events.append({key: pending[key] for key in ("at", "actor", "action", "detail")})
            live = self.active is not None and self.active["id"] == rollout_id
            cohort = self.cohort.figures() if live else None
            baseline = self.baseline.figures() if live else None
            since = self.figures_since if live else None
            sides = {"cohort": self.cohort.sides_entry(), "baseline": self.baseline.sides_entry()} \
                if live and samples else None
        kept = [e["detail"]["sides"] for e in events if "sides" in e["detail"]]
        ended_sides = samples and not live and bool(kept)
        if ended_sides:
            sides = kept[-1]
        events = [{**e, "detail": leaving_out(e["detail"], LISTING_LEAVES_OUT)} for e in events]
        recorded = [e for e in events if "figures" in e["detail"]]
        return {**row, "events": events, "cohort": cohort, "baseline": baseline,
                **({"unstored": unstored_text(pending)} if unstored else {}),
                "figures_since": since,
                "last_figures": None if not recorded else {
                    "at": recorded[-1]["at"], "action": recorded[-1]["action"], **recorded[-1]["detail"]["figures"]},
                "traffic": traffic_split(row, cohort, baseline) if live else None,
                **({"sides": sides, "sides_ended": ended_sides} if sides is not None else {})}

    def summary(self) -> dict | None:
        """The running or paused rollout in a line's worth of fields (for `kvctl status`); None without one."""
        with self.lock:
            rollout = self.active
            if rollout is None:
                return None
            return {"id": rollout["id"], "state": rollout["state"], "fraction": rollout["fraction"],
                    **({"fleet": rollout["policy"]["fleet"]} if rollout["policy"].get("fleet") else {}),
                    "policy": rollout["policy"].get("name") or "", "version": rollout["policy"]["version"],
                    "settings": rollout["policy"]["settings"]}

    def counts(self) -> dict | None:
        """`summary()` with each side's running totals (for /metrics); None without a rollout.
        Totals start again from zero when kvd restarts (counters may reset)."""
        with self.lock:
            summary = self.summary()
            if summary is None:
                return None
            summary["sides"] = {side: {"requests": stats.requests, "prompt_tokens": stats.prompt_tokens,
                                       "hit_tokens": stats.hit_tokens, "recomputed_tokens": stats.recomputed_tokens,
                                       "preemptions": stats.preemptions, "finished_blocks": stats.finished_blocks,
                                       "reserved_unused_blocks": stats.reserved_unused_blocks,
                                       "ttft_buckets": list(stats.ttft_buckets),
                                       "ttft_sum": stats.ttft_sum}
                                for side, stats in (("cohort", self.cohort), ("baseline", self.baseline))}
            return summary

    def history(self, limit: int) -> list[dict]:
        """The newest `limit` rollouts, each with its latest transition."""
        rows = self.store.read(
            "SELECT r.id, r.created_at, r.state, r.fraction, r.policy, r.adr_id, r.actor, "
            "(SELECT at FROM rollout_events WHERE rollout_id = r.id ORDER BY id DESC LIMIT 1), "
            "(SELECT action FROM rollout_events WHERE rollout_id = r.id ORDER BY id DESC LIMIT 1) "
            "FROM rollouts r ORDER BY r.id DESC LIMIT ?", (limit,))
        listed = [{"id": r[0], "created_at": r[1], "state": r[2], "fraction": r[3], "policy": json.loads(r[4]),
                   "adr_id": r[5], "actor": r[6], "last_at": r[7], "last_action": r[8]} for r in rows]
        pending = self.unstored
        for rollout in listed:
            if pending is not None and rollout["id"] == pending["rollout_id"]:
                rollout.update(state="rolled_back", last_at=pending["at"], last_action=pending["action"],
                               unstored=unstored_text(pending))
        return listed
