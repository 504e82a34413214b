"""Operator actions at `kvd router` that every replica carries out: evict, pin, unpin, cancel, a
LoRA adapter's load and unload, and the listings an operator takes ids from (pins, prefixes, requests in flight).

Block keys are content-addressed and pin ids derive from the tenant and the prefix's keys, so a
prefix id, a tenant, a model revision or a pin id names the same thing on every replica. The
router sends the operator's call to each replica at once (`fan_out`) and adds the answers up
(`combine`): what each did stays beside the sum; the answer is `partial` when some replica could
not do all of it (blocks in use, a budget, an unreachable replica or Redis). A replica that does
not have the thing (404: no such prefix or pin there) has nothing to do: not a failure while
another one had it. With no replica that did it, the replicas' common refusal comes back as it
came (the same bad input is refused everywhere), or a 503 when none answered.

An eviction carries a token (`purge_once`) the replicas claim on their shared Redis: of the
replicas on one Redis, only the first to claim it searches that Redis for other daemons' entries
of a tenant or an old model revision (a SCAN of the whole space); the others delete only what they
wrote themselves and say so (`remote_purge: {"by_another_replica": true}`). Replicas on separate
Redis servers each search their own. Each replica audits the call under the router's principal.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Callable, Mapping, Sequence

import httpx

from .replica_errors import described, kvd_json

UPDATE_WAIT_MAX_S = 600.0  # the longest new weights wait for running requests to finish (weights_ops.py)
RESET_WAIT_MAX_S = 600.0  # the longest a cache reset (/reset_prefix_cache, /flush_cache) waits for requests in flight

Answer = tuple[int | None, dict]  # a replica's HTTP status (None: not reached) and body


async def fan_out(replicas: Sequence, method: str, path: str, content: bytes | None, timeout: float,
                  passed: Mapping[int, str] | None = None, heard: Callable | None = None) -> list[Answer]:
    """The same call to every replica at once: each one's (status, body). `passed`: the replicas
    (by id) not asked, each with why (not reached, for that reason); `heard(replica, call)`: awaits
    each call, noting what came of it (RouterService.heard: whether it answers)."""
    async def one(replica) -> Answer:
        if passed and id(replica) in passed:
            return None, {"error": passed[id(replica)]}
        try:
            call = replica.client.request(method, path, content=content, timeout=timeout,
                                          headers={"content-type": "application/json"} if content else None)
            answer = await (heard(replica, call) if heard is not None else call)
            return answer.status_code, kvd_json(answer)
        except (httpx.HTTPError, ValueError) as exc:
            return None, {"error": described(exc)}
    return list(await asyncio.gather(*(one(r) for r in replicas)))


def combine(names: Sequence[str], answers: Sequence[Answer], merge: Callable[[list[dict]], dict]) -> tuple[int, dict]:
    """(HTTP status, body) for the fleet. `merge` makes the summary of the bodies of the replicas
    that did it; the body adds `result`, each replica's answer (`replicas`) and a `message`
    naming what some replica could not do."""
    rows = [{"replica": name, "status": status, **body} for name, (status, body) in zip(names, answers)]
    done = [body for status, body in answers if status == 200]
    if not done:
        return none_did(names, answers)
    unreached = [r for r in rows if r["status"] is None]
    failed = [r for r in rows if r["status"] not in (None, 200, 404)]
    partial = unreached or failed or any(body.get("result", "ok") != "ok" for body in done)
    out = {**merge(done), "result": "partial" if partial else "ok", "replicas": rows}
    messages = [f"{r['replica']}: {r['message']}" for r in rows if r["status"] == 200 and r.get("message")]
    messages += [f"{r['replica']}: not reached ({r['error']})" for r in unreached]
    messages += [f"{r['replica']}: refused ({r['status']}: {error_said(r)})" for r in failed]
    if messages:
        out["message"] = "; ".join(messages)
    return 200, out


def none_did(names: Sequence[str], answers: Sequence[Answer]) -> tuple[int, dict]:
    """No replica did it: the replicas' most common refusal as it came, or a 503 naming each one
    that could not be reached."""
    refusals = Counter(status for status, _ in answers if status is not None)
    if refusals:
        status = refusals.most_common(1)[0][0]
        return status, next(body for s, body in answers if s == status)
    return 503, {"error": {"message": "no replica answered: " + "; ".join(
        f"{name} ({body.get('error')})" for name, (_, body) in zip(names, answers)), "type": "router_error",
        "param": None, "code": "no_replica"}}


def error_said(row: dict) -> str:
    """What a replica's error said: its message, or the error as it came."""
    error = row.get("error")
    return error.get("message", "") if isinstance(error, dict) else str(error)


def bodies_or_errors(answers: list[tuple[int | None, dict]]) -> list[dict]:
    """Each replica's answer (status, body) as its body where it was a 200, else {"error": why}
    (None: no answer, the body says why; else "STATUS: its message")."""
    return [body if status == 200 else {"error": body["error"] if status is None else f"{status}: {error_said(body)}"}
            for status, body in answers]


def merge_evictions(done: list[dict]) -> dict:
    skipped: Counter = Counter()
    for body in done:
        skipped.update(body.get("skipped") or {})
    out = {"target": done[0]["target"], "skipped": dict(skipped),
           **{k: sum(body.get(k) or 0 for body in done) for k in ("evicted_blocks", "lower_tier_blocks_dropped")}}
    still_moving = sum(body.get("lower_tier_blocks_still_moving") or 0 for body in done)
    if still_moving:  # blocks some replica was still writing down when it gave up waiting: not dropped
        out["lower_tier_blocks_still_moving"] = still_moving
    if done[0].get("dry_run"):  # what each replica would evict: nothing went
        out["dry_run"] = True
        not_counted = [note for body in done for note in body.get("not_counted", ())]
        if not_counted:
            out["not_counted"] = list(dict.fromkeys(not_counted))
    if "prompt_blocks" in done[0]:  # a prompt's eviction: its blocks, and those each replica kept as shared
        out["prompt_blocks"] = done[0]["prompt_blocks"]
        out["shared_blocks_kept"] = sum(body.get("shared_blocks_kept") or 0 for body in done)
    remote = [body["remote_purge"] for body in done if "remote_purge" in body
              and not body["remote_purge"].get("by_another_replica")]  # it left the search to the one below
    if remote:
        out["remote_purge"] = {"dropped": sum(r.get("dropped", 0) for r in remote),
                               "complete": all(r.get("complete") for r in remote),
                               "searches": sum("seen" in r for r in remote)}
    return out


def merge_lora_changes(done: list[dict]) -> dict:
    """A LoRA adapter loaded or unloaded (one name everywhere), with the ids the replicas read for it:
    one, unless their folders under that path hold different files."""
    return {"name": done[0]["name"], "digests": sorted({body["digest"] for body in done}),
            **{k: True for k in ("loaded", "unloaded") if done[0].get(k)}, **_stranded(done, "stranded_pins")}


def _stranded(done: list[dict], field: str) -> dict:
    """`field`'s pins (each a row with pin_id) of every replica's answer, each pin once: {field: rows}
    ({} where none has any)."""
    rows = {row["pin_id"]: row for body in done for row in body.get(field) or []}
    return {field: list(rows.values())} if rows else {}


SLEEP_FIGURES = ("cache_bytes", "weight_bytes", "dropped_blocks", "saved_blocks", "held_below", "discarded_blocks",
                 "pins_warming")


def merge_sleeps(done: list[dict]) -> dict:
    """Replicas put to sleep or woken (sleep_ops.py): the first one's answer, its figures summed
    over all of them; asleep while any one is, `already` where each one was."""
    out = {**done[0], **{f: sum(body.get(f) or 0 for body in done) for f in SLEEP_FIGURES if f in done[0]}}
    out["is_sleeping"] = any(body["is_sleeping"] for body in done)
    out["already"] = all(body.get("already") for body in done)
    if "still_released" in out:
        out["still_released"] = sorted({t for body in done for t in body.get("still_released") or []})
    return out


def merge_weight_updates(done: list[dict]) -> dict:
    """New weights on every replica (weights_ops.py): the revisions they serve now (one, unless the
    folders under that path differ between machines) and what they dropped, summed."""
    return {"success": True, "updated": any(body.get("updated") for body in done),
            "model_path": done[0]["model_path"], "revision": done[0]["revision"],
            "revisions": sorted({body["revision"] for body in done}),
            "previous_revision": done[0].get("previous_revision"),
            **{f: sum(body.get(f) or 0 for body in done) for f in ("dropped_blocks", "dropped_host_blocks")},
            **_stranded(done, "stranded_pins")}


def merge_pins(done: list[dict]) -> dict:
    """One pin (the same id everywhere): its blocks cached summed over the replicas, and so are the
    blocks a pin by prefix id left out as a running request's own (pin_ops.pin_prefix). Pinned
    again (`was`: what it was before) where some replica had it: that one's `was` (each replica's
    answer is in `replicas`), whichever replica answers first."""
    left_out = sum(b.get("private_blocks_left_out") or 0 for b in done)
    was = next((b["was"] for b in done if b.get("was")), None)
    merged = {key: value for key, value in done[0].items() if key != "was"}
    return {**merged, "cached_blocks": sum(b["cached_blocks"] for b in done),
            "warmed": any(b["warmed"] for b in done), "refreshed": any(b.get("refreshed") for b in done),
            **({"was": was} if was is not None else {}),
            **({"private_blocks_left_out": left_out} if left_out else {})}


def merge_unpins(done: list[dict]) -> dict:
    return {"pin_id": done[0]["pin_id"], **_summed(done, "unpinned_blocks", "dropped_stale_blocks")}


def merge_many_unpins(done: list[dict]) -> dict:
    """The pins the replicas unpinned in one sweep (the stranded ones, or a tenant's), each once
    (`replicas` has each one's), and their blocks summed over the replicas."""
    return {"unpinned": _stranded(done, "unpinned").get("unpinned", []),
            **({"tenant": done[0]["tenant"]} if "tenant" in done[0] else {}),
            **_summed(done, "unpinned_blocks", "dropped_stale_blocks")}


def _summed(done: list[dict], always: str, where_any: str) -> dict:
    """`always` summed over the replicas' answers, and `where_any` too where some answer has it."""
    body = {always: sum(b[always] for b in done)}
    if any(b.get(where_any) for b in done):
        body[where_any] = sum(b.get(where_any, 0) for b in done)
    return body


def merge_pin_lists(names: Sequence[str], answers: Sequence[Answer]) -> tuple[int, dict]:
    """Every pin of the fleet once, with the replicas that hold it, its blocks cached on each
    (`cached_by_replica`) and summed (`cached_blocks`), and the replicas where no request reaches
    it any more (`stranded_on`; `stranded`: why, as the first of them says)."""
    by_id: dict[str, dict] = {}
    for name, (status, body) in zip(names, answers):
        if status != 200:
            continue
        for pin in body["pins"]:
            seen = by_id.setdefault(pin["pin_id"], {**pin, "cached_blocks": 0, "replicas": [],
                                                    "cached_by_replica": {}, "stranded": None, "stranded_on": []})
            seen["cached_blocks"] += pin["cached_blocks"]
            seen["cached_by_replica"][name] = pin["cached_blocks"]
            seen["replicas"].append(name)
            if pin.get("stranded"):
                seen["stranded"] = seen["stranded"] or pin["stranded"]
                seen["stranded_on"].append(name)
    if not any(status == 200 for status, _ in answers):
        return none_did(names, answers)
    missing = [f"{name} ({body.get('error') if status is None else status})"
               for name, (status, body) in zip(names, answers) if status != 200]
    out = {"pins": list(by_id.values()), "replica_count": len(names)}
    rooms = [{**body["room"], "replica": name} for name, (status, body) in zip(names, answers)
             if status == 200 and body.get("room")]
    if rooms:  # the replica whose pins leave a request the least room (room_beside_pins)
        out["room"] = min(rooms, key=lambda r: r["room_blocks"] * r["block_size"])
    if missing:
        out["message"] = "not listed: " + "; ".join(missing)
    return 200, out


def merge_prefix_lists(names: Sequence[str], answers: Sequence[Answer]) -> tuple[int, dict]:
    """Each replica's prefix rows, replica by replica, each row naming its replica (a prefix id
    is the same on every replica that holds the prefix). A replica without the row asked for
    (`under`, 404) lists none; the replicas' common refusal of bad input comes back as it came."""
    rows, listed = [], []
    for name, (status, body) in zip(names, answers):
        if status == 200:
            rows += [{**row, "replica": name} for row in body["prefixes"]]
            listed.append({"replica": name, "status": status, "total": body.get("total", len(body["prefixes"]))})
        else:
            listed.append({"replica": name, "status": status,
                           "error": error_said({"error": body.get("error")}) if status is not None else body.get("error")})
    if not any(r["status"] == 200 for r in listed):
        return none_did(names, answers)
    out = {"prefixes": rows, "total": sum(r.get("total", 0) for r in listed), "replicas": listed,
           "sort": next(body.get("sort") for status, body in answers if status == 200)}
    missing = [f"{r['replica']} ({r['error']})" for r in listed if r["status"] not in (200, 404)]
    if missing:
        out["message"] = "not listed: " + "; ".join(missing)
    return 200, out


def merge_request_lists(names: Sequence[str], answers: Sequence[Answer]) -> tuple[int, dict]:
    """Every replica's requests in flight, oldest first, each row naming its replica (a request
    runs on one replica: its id is that replica's)."""
    rows, missing = [], []
    for name, (status, body) in zip(names, answers):
        if status == 200:
            rows += [{**row, "replica": name} for row in body["requests"]]
        else:
            missing.append(f"{name} ({body.get('error') if status is None else status})")
    if not any(status == 200 for status, _ in answers):
        return none_did(names, answers)
    rows.sort(key=lambda row: -row["age_seconds"])
    out = {"requests": rows, "running": sum(r["state"] != "waiting" for r in rows),
           "waiting": sum(r["state"] == "waiting" for r in rows),
           "replicas": [{"replica": name, "status": status} for name, (status, _) in zip(names, answers)]}
    orders = {body.get("queue_order") for status, body in answers if status == 200}
    if len(orders) == 1 and None not in orders:  # (each replica orders its own queue: said when all agree)
        out["queue_order"] = orders.pop()
    if missing:
        out["message"] = "not listed: " + "; ".join(missing)
    return 200, out


def merge_event_lists(names: Sequence[str], answers: Sequence[Answer], tail: int) -> tuple[int, dict]:
    """Every replica's newest cache events (`GET /admin/events?tail=N` of each), merged by time and
    cut to the fleet's newest `tail`, each naming its replica; and each replica's stream and the
    seqs it holds (each replica numbers its own events: following one is that replica's to do)."""
    if not any(status == 200 for status, _ in answers):
        return none_did(names, answers)
    events, books, missing = [], [], []
    for index, (name, (status, body)) in enumerate(zip(names, answers)):
        if status != 200:
            missing.append(f"{name} ({body.get('error') if status is None else status})")
            books.append({"replica": name, "status": status})
            continue
        events += [(e["at"], index, e["seq"], {**e, "replica": name}) for e in body["events"]]
        books.append({"replica": name, "status": status, "stream_id": body["stream_id"], "oldest": body["oldest"],
                      "latest": body["latest"]})
    events.sort(key=lambda item: item[:3])
    out = {"events": [e for *_, e in events][-tail:] if tail > 0 else [], "replicas": books}
    if missing:
        out["message"] = "not listed: " + "; ".join(missing)
    return 200, out


def merge_audit_lists(names: Sequence[str], answers: Sequence[Answer]) -> tuple[int, dict]:
    """Every replica's audit records (`GET /admin/audit` of each, its filters passed on: each
    replica keeps its own log), newest first across the fleet, each naming its replica: one record
    of what operators did, and had refused, everywhere."""
    if not any(status == 200 for status, _ in answers):
        return none_did(names, answers)
    entries, missing = [], []
    for index, (name, (status, body)) in enumerate(zip(names, answers)):
        if status != 200:
            missing.append(f"{name} ({error_said(body) if status is not None else body.get('error')})")
            continue
        entries += [(-e["at"], index, -e["id"], {**e, "replica": name}) for e in body["entries"]]
    entries.sort(key=lambda item: item[:3])
    out = {"entries": [e for *_, e in entries],
           "replicas": [{"replica": name, "status": status} for name, (status, _) in zip(names, answers)]}
    if missing:
        out["message"] = "not listed: " + "; ".join(missing)
    return 200, out


TENANT_SUMS = ("prompt_tokens", "hit_tokens", "recomputed_tokens", "running", "waiting", "rejected",
               "cached_blocks", "evicted_blocks", "retained_blocks", "explicit_requests", "pinned_blocks")


RETIRED_SUMS = ("tenants", "prompt_tokens", "hit_tokens", "recomputed_tokens", "rejected", "evicted_blocks",
                "retained_blocks", "explicit_requests", "tracked")
LOWER_TIER_FIGURES = ("disk_bytes", "disk_share_bytes", "remote_bytes", "remote_share_bytes")  # per tenant


def merge_tenant_lists(names: Sequence[str], answers: Sequence[Answer]) -> tuple[int, dict]:
    """Each tenant across the fleet: its counts summed over the replicas (shares, idle blocks and
    pin budgets too, as the fleet's), its hit ratio from the sums, its TTFT percentiles the slowest
    replica's; its hit curve summed size by size (each replica's cache `times` its own blocks)."""
    merged: dict[str, dict] = {}
    missing = []
    for name, (status, body) in zip(names, answers):
        if status != 200:
            missing.append(f"{name} ({body.get('error') if status is None else status})")
            continue
        for row in body["tenants"]:
            into = merged.setdefault(row["tenant"], {"tenant": row["tenant"], **dict.fromkeys(TENANT_SUMS, 0),
                                                     "idle_blocks": None, "share_blocks": None,
                                                     "host_blocks": None, "host_share_blocks": None,
                                                     **dict.fromkeys(LOWER_TIER_FIGURES),
                                                     "pin_budget_blocks": 0, "ttft_p50_s": None, "ttft_p95_s": None})
            for key in TENANT_SUMS + ("pin_budget_blocks",):
                into[key] += row.get(key, 0)  # a replica of an earlier kvd may lack one
            for key in ("idle_blocks", "share_blocks", "host_blocks", "host_share_blocks", *LOWER_TIER_FIGURES):
                if row.get(key) is not None:
                    into[key] = (into[key] or 0) + row[key]
            for key in ("ttft_p50_s", "ttft_p95_s"):  # percentiles do not add up: the slowest replica's
                if row.get(key) is not None:
                    into[key] = max(into.get(key) or 0.0, row[key])
            if row.get("hit_curve") is not None:  # (a replica with no curve, or an older kvd, adds nothing)
                alone = (into.get("hit_curve") or {}).get("alone")
                if row["hit_curve"].get("alone") is not None:  # followed alone at this replica
                    alone = add_alone_figures(alone, row["hit_curve"]["alone"])
                into["hit_curve"] = {**add_curve_figures(into.get("hit_curve"), row["hit_curve"]), "alone": alone}
    if not any(status == 200 for status, _ in answers):
        return none_did(names, answers)
    rows = [merged[t] for t in sorted(merged)]
    for row in rows:
        row["hit_ratio"] = row["hit_tokens"] / row["prompt_tokens"] if row["prompt_tokens"] else 0.0
        row.setdefault("hit_curve", None)
    out = {"tenants": rows, "shares": any(body.get("shares") for status, body in answers if status == 200),
           "blocks": sum(body["blocks"] for status, body in answers if status == 200),
           "replicas": [{"replica": name, "status": status} for name, (status, _) in zip(names, answers)]}
    retired = [body["retired"] for status, body in answers if status == 200 and body.get("retired")]
    if retired:  # each replica's tenants no longer tracked, summed (one tenant may be retired at several)
        out["retired"] = {key: sum(r.get(key, 0) for r in retired) for key in RETIRED_SUMS}
        out["retired"]["limit"] = min(r["limit"] for r in retired)
    out["hit_curve"] = merge_curve_heads([body["hit_curve"] for status, body in answers
                                          if status == 200 and body.get("hit_curve")])
    if missing:
        out["message"] = "not listed: " + "; ".join(missing)
    return 200, out


def add_curve_figures(into: dict | None, figures: dict) -> dict:
    """Hit-curve figures (prompts, tokens, what kvd served, hit tokens by size) added to `into` (None: none yet)."""
    if into is None:
        into = {"prompts": 0, "prompt_tokens": 0, "served_tokens": 0, "looked_tokens": 0, "hit_tokens": {}}
    hits = dict(into["hit_tokens"])
    for times, tokens in figures["hit_tokens"].items():
        hits[times] = hits.get(times, 0) + tokens
    return {**{key: into[key] + figures[key] for key in ("prompts", "prompt_tokens", "served_tokens", "looked_tokens")},
            "hit_tokens": hits}


def add_alone_figures(into: dict | None, figures: dict) -> dict:
    """A tenant's curve alone at one more replica added to `into` (None: none yet), with its recent
    windows (each the shortest span of the replicas'); None for them where a replica has none (an
    older kvd): a sum that left one out would say less than the fleet served."""
    recent = figures.get("recent")
    if into is not None:
        mine = into.get("recent")
        recent = None if mine is None or recent is None else [
            {"window": a["window"], "seconds": min(a["seconds"], b["seconds"]), **add_curve_figures(a, b)}
            for a, b in zip(mine, recent) if a["window"] == b["window"]]
    return {**add_curve_figures(into, figures), "recent": recent}


def merge_curve_heads(curves: list[dict]) -> dict | None:
    """The sizes every replica's hit curve has (each one's blocks summed: the fleet's caches at
    `times` their own) and their retired tenants' figures summed; None where no replica follows one."""
    if not curves:
        return None
    retired = None
    for curve in curves:
        retired = add_curve_figures(retired, curve["retired"])
    return {"sizes": _summed_sizes([curve["sizes"] for curve in curves]),
            "alone_sizes": _summed_sizes([curve["alone_sizes"] for curve in curves if curve.get("alone_sizes")]),
            "retired": {"tenants": sum(curve["retired"]["tenants"] for curve in curves), **retired}}


def _summed_sizes(lists: list[list[dict]]) -> list[dict]:
    """The sizes (times, blocks) every list has, each one's blocks summed over the lists."""
    if not lists:
        return []
    common = set.intersection(*({row["times"] for row in sizes} for sizes in lists))
    blocks: dict[str, int | None] = dict.fromkeys(sorted(common, key=float), 0)
    for sizes in lists:
        for row in sizes:
            if row["times"] in common:
                held = blocks[row["times"]]
                blocks[row["times"]] = None if row["blocks"] is None or held is None else held + row["blocks"]
    return [{"times": times, "blocks": n} for times, n in blocks.items()]


def merge_response_purges(bodies: list[dict]) -> dict:
    """The replicas' purges of kept responses added up (each replica keeps its own)."""
    tenants: Counter = Counter()
    talks: dict = {"conversations": 0, "bytes": 0, "tenants": Counter()}
    for body in bodies:
        tenants.update(body["tenants"])
        theirs = body.get("conversations") or {}  # (an older replica keeps none)
        talks["conversations"] += theirs.get("conversations", 0)
        talks["bytes"] += theirs.get("bytes", 0)
        talks["tenants"].update(theirs.get("tenants", {}))
    named = {}
    if "ids" in bodies[0]:  # an id is not found where no replica that answered keeps it
        missing = set.intersection(*(set(body.get("ids_not_found", body.get("ids", []))) for body in bodies))
        named = {"ids": bodies[0]["ids"], "ids_not_found": sorted(missing)}
    return {**{key: sum(body[key] for body in bodies) for key in ("responses", "bytes", "cancelled", "running")},
            "tenants": dict(tenants), "conversations": {**talks, "tenants": dict(talks["tenants"])},
            **{key: bodies[0][key] for key in ("dry_run", "tenant", "older_than_s", "all")}, **named}


def merge_webhook_retries(bodies: list[dict]) -> dict:
    """The waiting webhook events each replica tried now, added up (each sends its own)."""
    return {"retried": sum(body["retried"] for body in bodies)}


def replica_reports(names: Sequence[str], answers: Sequence[Answer]) -> tuple[int, dict]:
    """Each replica's report as it came, in the replicas' order, for what does not add up across
    machines: tiers (each has its own host memory and disk, and a shared Redis would count once per
    replica), profiles. A replica that did not answer says why."""
    if not any(status == 200 for status, _ in answers):
        return none_did(names, answers)
    rows = []
    for name, (status, body) in zip(names, answers):
        row: dict = {"replica": name, "status": status}
        if status == 200:
            row["report"] = body
        else:
            error = body.get("error")
            row["error"] = error.get("message") if isinstance(error, dict) else error
        rows.append(row)
    return 200, {"replicas": rows}


def merge_profiles(done: list[dict]) -> dict:
    """Profiles started or written, one per replica (each one's answer stays in its row): how many,
    and a start's limit."""
    out: dict = {"replicas_profiled": len(done)}
    if "max_seconds" in done[0]:  # a start
        out.update(profiling=True, max_seconds=done[0]["max_seconds"], max_steps=done[0].get("max_steps"))
    return out


def merge_verifies(done: list[dict]) -> dict:
    """Disk verifications begun or stopped: each replica's report stays in its row; the segments
    they read together."""
    return {"segments_total": sum(body["verify"]["segments_total"] for body in done)}


def merge_cancels(done: list[dict]) -> dict:
    """The requests each replica cancelled; `not_found`: the ids none of them had in flight."""
    not_found = set(done[0].get("not_found") or [])
    for body in done[1:]:
        not_found &= set(body.get("not_found") or [])
    return {"cancelled": [row for body in done for row in body["cancelled"]],
            "not_found": [r for r in done[0].get("not_found") or [] if r in not_found],
            "held_blocks": sum(body["held_blocks"] for body in done)}
