"""What `kvctl check` asks: is this kvd (or the fleet behind kvd router) fit to serve, check by
check, each ok, warning or critical with a line that says why and what to run.

`/readyz` answers one question for a load balancer; the alert rules need Prometheus. These are
for a person or a script after a deploy, a restart or an upgrade: a deploy gate
(`kvctl check --wait 300 || roll back`) or a monitoring plugin, by the exit status Nagios and
its heirs read (0 ok, 1 warning, 2 critical). Each check reads plain data, a kvd's
`/admin/status` body, so the router judges its replicas by the same rules (and adds the fleet's
own: replicas that do not answer, and where the answering ones differ, fleet_differences.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from .byte_sizes import format_bytes
from .calls import ServiceError
from .fleet_admin import bodies_or_errors
from .fleet_differences import FIELDS, MISSING, fleet_differences, value_at

OK, WARNING, CRITICAL = "ok", "warning", "critical"
SEVERITY = {OK: 0, WARNING: 1, CRITICAL: 2}  # also the exit status kvctl check gives
RECENT_FAILURE_S = 3600.0  # an engine step failed within the hour: a warning
UNSENT_WARN_S = 60.0  # a batch's requests have not gone through batch_via's router this long: a warning


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # OK, WARNING or CRITICAL
    detail: str

    def describe(self, prefix: str = "") -> dict:
        return {"check": prefix + self.name, "status": self.status, "detail": self.detail}


def worst(checks: list[dict]) -> str:
    """The most severe status of `checks` (OK for none)."""
    return max((c["status"] for c in checks), key=SEVERITY.__getitem__, default=OK)


def serving_check(not_ready: str | None, draining: bool, asleep: bool) -> Check:
    """Whether kvd takes completions: `not_ready` is /readyz's reason (None: ready). Drained or
    asleep, an operator chose it: a warning; anything else that keeps it from serving is critical."""
    if not_ready is None:
        return Check("serving", OK, "takes completions")
    return Check("serving", WARNING if draining or asleep else CRITICAL, not_ready)


def status_checks(status: dict, now: float | None = None) -> list[Check]:
    """The checks a kvd's `/admin/status` body answers (an older kvd's lacks some: those are left out)."""
    now = time.time() if now is None else now
    checks = [_engine(status.get("step_failures"), now), _cache(status.get("cache") or {}),
              _store(status.get("store") or {})]
    checks += [c for c in (_tiers(status.get("tiers")), _tls(status.get("tls")), _pins(status.get("stranded_pins")),
                           _reload(status.get("last_reload")), _weights(status.get("weights_updated")),
                           _responses_file(status.get("responses")), _batch_via(status.get("batch_via"), now))
               if c is not None]
    return checks


def identity(status: dict) -> dict:
    """The part of a status that fleet_differences compares (its FIELDS' paths, and the model's
    name it groups them by), shaped as the status."""
    out: dict = {}
    for key in ("model.name", *(field.key for field in FIELDS)):
        value = value_at(status, key)
        if value is MISSING:
            continue
        *path, last = key.split(".")
        place = out
        for part in path:
            place = place.setdefault(part, {})
        place[last] = value
    return out


def _at_the_router(row: dict) -> list[Check]:
    """What kvd router's book of one replica (RouterService.status()'s row) says is wrong: drained
    there, passed over for failing, or (events view) a feed it does not follow."""
    found = []
    if row.get("draining") in ("drained", "leaving"):
        found.append(Check("drained at the router", WARNING, f"{row['draining']}: takes no new request; "
                           f"`kvctl fleet resume {row['replica']}` takes it back"))
    if row.get("failing"):
        found.append(Check("passed over", WARNING, f"its latest {row['failing']['failed_in_a_row']} answers were "
                           f"failures of its own: the router asks it again in {row['failing']['seconds_left']:g} s"))
    view = row.get("view")
    if view is not None and not view["synced"]:
        found.append(Check("router view", WARNING, "the router does not follow its event feed"
                           + (f" ({view['feed_error']})" if view.get("feed_error") else "")
                           + ": each request asks it instead, on the request's path"))
    return found


def _ago(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min" if seconds < 7200 \
        else f"{seconds / 3600:.1f} h"


def _engine(failures: dict | None, now: float) -> Check:
    if not failures or not failures["total"]:
        return Check("engine", OK, "no step failed")
    since = now - failures["last_at"] if failures.get("last_at") else None
    said = (f"{failures['total']:,} steps failed, the latest {_ago(since)} ago ({failures['last_error']}); "
            "kvd's log has each traceback")
    if since is not None and since < RECENT_FAILURE_S:
        return Check("engine", WARNING, said)
    return Check("engine", OK, said)


def _cache(cache: dict) -> Check:
    dtype = cache.get("dtype", "auto")
    if cache.get("scales_verified") is False:
        return Check("cache scales", CRITICAL, f"{dtype}: the kernels do not read the applied scale set; "
                     "`kvctl calibrate --apply` loads it again")
    if cache.get("uncalibrated"):
        return Check("cache scales", WARNING, f"{dtype} on unit scales (no calibration applied); "
                     "`kvctl calibrate --apply` measures and loads them")
    if cache.get("scale_set"):
        return Check("cache scales", OK, f"{dtype}, scale set {cache['scale_set']['id']} loaded and read")
    if dtype == "auto":  # the model's dtype, as the layout names it
        return Check("cache scales", OK, f"{cache.get('layout', 'the model dtype')}: not quantised, no scales")
    return Check("cache scales", OK, dtype)


def _store(store: dict) -> Check:
    if store.get("file_ok") is False:
        return Check("store", CRITICAL, "the SQLite store's file was replaced or deleted: kvd refuses writes until "
                     "a restart; `kvctl db check` says more")
    said = []
    if store.get("audit_write_failures"):
        said.append(f"{store['audit_write_failures']:,} audit records the store did not take (kvd's log has each)")
    if store.get("failing_jobs"):
        said.append(f"housekeeping failing: {', '.join(store['failing_jobs'])}")
    if store.get("unstored_rollback") is not None:
        said.append(f"rollout {store['unstored_rollback']}'s rollback is not in the store yet")
    if said:
        return Check("store", WARNING, "; ".join(said))
    return Check("store", OK, "writable, every record taken")


def _tiers(tiers: dict | None) -> Check | None:
    if not tiers:
        return None
    said = []
    unwell = [f"{name} {t['health']}" for name, t in tiers.items() if t.get("health", "ok") != "ok"]
    if unwell:
        said.append(f"{', '.join(unwell)}: prefixes there are computed again")
    bound = (tiers.get("disk") or {}).get("filesystem_bound")
    if bound:
        said.append(f"disk: its filesystem holds it to {format_bytes(bound['holds_at_most_bytes'])} of its "
                    f"{format_bytes(tiers['disk']['capacity_bytes'])} (room for {format_bytes(bound['room_bytes'])} "
                    "more)")
    if said:
        return Check("tiers", WARNING, "; ".join(said) + "; `kvctl tiers` says more")
    return Check("tiers", OK, ", ".join(tiers) + " healthy")


def _tls(tls: dict | None) -> Check | None:
    if not tls:
        return None
    if tls.get("warning"):
        return Check("tls", CRITICAL if tls["days_left"] < 0 else WARNING, tls["warning"])
    return Check("tls", OK, f"{tls['subject']}, {tls['days_left']:g} days left")


def _pins(stranded: int | None) -> Check | None:
    if stranded is None:
        return None
    if stranded:
        return Check("pins", WARNING, f"{stranded:,} pins no request reaches any more hold blocks; `kvctl pins` "
                     "marks them, `kvctl unpin --stranded` lets them go")
    return Check("pins", OK, "every pin is reachable")


def _reload(last: dict | None) -> Check | None:
    if last is not None and last.get("result") == "refused":
        return Check("config", WARNING, f"the latest reload was refused, kvd runs on its earlier settings: "
                     f"{last.get('error')}")
    return None


def _weights(updated: dict | None) -> Check | None:
    if updated:
        return Check("weights", WARNING, f"serves {updated['model_path']} (revision {str(updated['revision'])[:12]}), "
                     "swapped in at run time: a restart serves the configured model again")
    return None


def _responses_file(responses: dict | None) -> Check | None:
    failed = (((responses or {}).get("file")) or {}).get("failed_writes", 0)
    if failed:
        return Check("responses file", WARNING, f"{failed:,} writes to responses_store_file did not land; "
                     "`kvctl responses` says more")
    return None


def _batch_via(via: dict | None, now: float) -> Check | None:
    if not via:
        return None
    unsent = via.get("unsent")
    if unsent and now - unsent["since"] >= UNSENT_WARN_S:
        return Check("batch via", WARNING, f"requests of /v1/batches have not gone through kvd router at "
                     f"{via['target']} for {_ago(now - unsent['since'])}: {unsent['why']}; they wait")
    return Check("batch via", OK, f"requests of /v1/batches go through kvd router at {via['target']}")


def kvd_report(service) -> dict:
    """`GET /admin/checks` at kvd: {"status": the worst, "checks": [{"check", "status", "detail"}],
    "identity": what fleet_differences compares, or None before the model is loaded}."""
    checks = [serving_check(service.not_ready(), service.draining, service.asleep is not None)]
    found = None
    try:
        status = service.status()
    except ServiceError:  # loading, failed to load, or the engine stalled: serving says which
        pass
    else:
        checks += status_checks(status)
        found = identity(status)
    described = [c.describe() for c in checks]
    return {"status": worst(described), "checks": described, "identity": found}


def fleet_report(answers: list[tuple[str, int | None, dict]], router: dict) -> dict:
    """`GET /admin/checks` at kvd router ("replicas": how many it asked): each replica's checks
    under its name (`answers`: its name and answer, status and body), a critical one for a replica
    that gave none (a warning for an older kvd, which has no checks: a 404), a warning for each way
    the answering replicas differ, one for each replica the router holds drained, and the router's
    own certificate (`router`: RouterService.status())."""
    checks: list[dict] = []
    reports = []
    for name, code, body in answers:
        if code == 404:
            checks.append(Check("answers", WARNING, "an older kvd, which has no checks: `kvctl status` there shows "
                                "its state").describe(f"{name}: "))
            continue
        [report] = bodies_or_errors([(code, body)])
        if "error" in report:
            said = f"does not answer its checks: {report['error']}"
            checks.append(Check("answers", CRITICAL, said).describe(f"{name}: "))
            continue
        reports.append((name, report))
        checks += [{**row, "check": f"{name}: {row['check']}"} for row in report["checks"]]
    known = [(name, report["identity"]) for name, report in reports if report.get("identity") is not None]
    for difference in fleet_differences(known):
        checks.append(Check(f"differ in {difference['label']}", WARNING,
                            f"{difference['held']} ({difference['why']})").describe("fleet: "))
    for row in router.get("replicas", []):
        checks += [c.describe(f"{row['replica']}: ") for c in _at_the_router(row)]
    tls = _tls(router.get("tls"))
    if tls is not None:
        checks.append(tls.describe("router: "))
    return {"status": worst(checks), "checks": checks, "replicas": len(answers)}
