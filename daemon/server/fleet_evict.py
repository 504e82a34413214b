"""`kvctl evict` at `kvd router`: the eviction goes to every replica, and the answers add up.

Block keys are content-addressed, so a prefix id, a tenant or a model revision names the same
blocks on every replica; each replica evicts its own (device, host, disk) and purges the shared
Redis as it would alone (a second purge finds nothing left). The fleet's answer sums what went,
keeps each replica's answer beside it, and says `partial` when some replica could not do all of
it (blocks in use, an unreachable replica or Redis). A replica that does not hold the prefix
(404) has nothing to evict: that is not a failure while another one had it.
"""

from __future__ import annotations

from collections import Counter
from typing import Sequence

SUMMED = ("evicted_blocks", "lower_tier_blocks_dropped")


def fleet_answer(names: Sequence[str], answers: Sequence[tuple[int | None, dict]]) -> tuple[int, dict]:
    """(HTTP status, body) for the fleet from each replica's (status or None when it could not be
    reached, body). With no replica that evicted: the replicas' common refusal as it came (the
    same bad input is refused everywhere), else 503."""
    rows = [{"replica": name, "status": status, **body} for name, (status, body) in zip(names, answers)]
    done = [body for status, body in answers if status == 200]
    if not done:
        refusals = Counter(status for status, _ in answers if status is not None)
        if not refusals:
            return 503, _error("no replica answered: " + "; ".join(
                f"{r['replica']} ({r.get('error')})" for r in rows), "no_replica")
        status = refusals.most_common(1)[0][0]
        first = next(body for s, body in answers if s == status)
        return status, first
    skipped: Counter = Counter()
    for body in done:
        skipped.update(body.get("skipped") or {})
    unreached = [r["replica"] for r in rows if r["status"] is None]
    failed = [r["replica"] for r in rows if r["status"] not in (None, 200, 404)]
    partial = unreached or failed or any(body.get("result") != "ok" for body in done)
    out = {"target": done[0]["target"], "result": "partial" if partial else "ok",
           **{k: sum(body.get(k) or 0 for body in done) for k in SUMMED}, "skipped": dict(skipped),
           "replicas": rows}
    remote = [body["remote_purge"] for body in done if "remote_purge" in body]
    if remote:
        out["remote_purge"] = {"dropped": sum(r.get("dropped", 0) for r in remote),
                               "complete": all(r.get("complete") for r in remote)}
    messages = [f"{r['replica']}: {r['message']}" for r in rows if r["status"] == 200 and r.get("message")]
    messages += [f"{name}: not reached ({next(r['error'] for r in rows if r['replica'] == name)})"
                 for name in unreached]
    messages += [f"{r['replica']}: refused ({r['status']})" for r in rows if r["replica"] in failed]
    if messages:
        out["message"] = "; ".join(messages)
    return 200, out


def _error(message: str, code: str) -> dict:
    return {"error": {"message": message, "type": "router_error", "param": None, "code": code}}
