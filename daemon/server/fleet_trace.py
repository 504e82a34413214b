"""The fleet's trace at `kvd router` (`kvctl trace save` there): the replicas' traces as one.

Each replica keeps its own trace (daemon/server/request_trace.py). The router asks every one for
its lines with the block ids as keyed (`ids=keyed`) and Unix arrivals, puts them in arrival order,
keeps the `last` few, and numbers the ids from 0 as a replica does. Each line names the replica
that served it (`replica`), for a replay that routes as the live router did (`--routing
recorded`). A prompt served on two replicas has one id on both only where they key their ids
alike: every replica given one `trace_key_file`.
Replicas that draw their own keys would make a fleet that shares nothing, and a replay that
compares routing policies on it would be wrong; so the router refuses to merge them and says how
to give them one key. The merged trace replays with `kvctl bench replay --replicas N`.

A replica that does not answer is left out and named (`result: partial`).

The router names each request it forwards, each try at it, and when it first chose a replica for
it (request_trace.ROUTER_ATTEMPT_HEADER), and each replica keeps that name on the request's line:

- Arrivals are the router's, on its one clock, and the lines are in the order the router routed
  the requests. The replicas' own arrivals come later by the hop, and two requests routed at
  nearly the same moment can reach their replicas in the other order; a replay of round robin
  over that order would send later requests elsewhere than the router did. The router's receipt
  order would not do either: with `view: ask` it asks the replicas before it chooses, so requests
  are routed in the order their answers came. (A request sent to a replica directly, not through
  the router, keeps the replica's arrival.)
- A request one replica turned away (its queue full: 429) and the router then sent to another is
  in both replicas' traces, but it is one request of the fleet's traffic: the fleet's trace keeps
  its last try alone (`retries_merged` counts the lines left out). A request every replica turned
  away is kept once, as turned away.
- A request no replica took in is in no replica's trace: the router found none to take it or
  could reach none, or each one it asked was stopping, loading or draining (503, which keeps no
  line). The router notes when it gave up on each (RouterService.untraced), and the fleet's trace
  counts those in its span (`router_untraced`), so that a replay of a trace saved after an outage
  is known to lack that demand. A body a replica refused as invalid (400, 404, 413) is not
  demand to replay, and is counted nowhere.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

from kvctl.daemon.replay.trace import Served

from .fleet_admin import Answer, error_said, none_did
from .request_trace import Held, RouterAttempt, numbered


def trace_query(last: int | None) -> str:
    """What the router asks each replica for: its last `last` lines (every one kept: None), keyed."""
    return "/admin/trace?ids=keyed" + (f"&last={last}" if last is not None else "")


def _refusal(message: str) -> tuple[int, dict]:
    return 409, {"error": {"message": message, "type": "router_error", "param": None, "code": "trace_keys_differ"}}


def _apart(traced: Sequence[tuple[str, dict]]) -> str | None:
    """Why the answering replicas' traces cannot be one (None: they can)."""
    unkeyed = [name for name, body in traced if "key_id" not in body]
    if unkeyed:
        return (f"trace: {', '.join(unkeyed)} gave no keyed block ids (a kvd older than this router?); "
                f"upgrade it, or save each replica's trace (kvctl --socket REPLICA trace save FILE)")
    if len({body["block_tokens"] for _, body in traced}) > 1:
        sizes = "; ".join(f"{name}: {body['block_tokens']}" for name, body in traced)
        return (f"trace: the replicas cut prompts into blocks of different sizes for their ids ({sizes} tokens); "
                f"give every replica one trace_block_tokens to save the fleet's trace")
    if len(traced) < 2 or (all(body["key"] == "shared" for _, body in traced)
                           and len({body["key_id"] for _, body in traced}) == 1):
        return None
    keys = "; ".join(f"{name}: {'its own key, drawn at start' if body['key'] != 'shared' else 'key ' + body['key_id']}"
                     for name, body in traced)
    return (f"trace: the replicas key their block ids apart ({keys}), so one prompt on two of them would "
            f"look like two; give every replica the same trace_key_file (e.g. head -c 32 /dev/urandom > "
            f"/etc/kvd/trace.key; chmod 600; restart them) to save the fleet's trace, or save each "
            f"replica's (kvctl --socket REPLICA trace save FILE)")


def last_tries(where: list[tuple[Held, str]]) -> list[tuple[Held, str]]:
    """The lines of `where` (each with its replica) less those of a routed request's earlier tries:
    of the lines that name one router id, those of the highest try stay."""
    final: dict[str, int] = {}
    for line, _ in where:
        if line.routed is not None:
            final[line.routed.request] = max(line.routed.attempt, final.get(line.routed.request, 0))
    return [(line, name) for line, name in where
            if line.routed is None or line.routed.attempt == final[line.routed.request]]


def _held(line: dict, replica: str) -> Held:
    """A keyed trace line of `replica` (RequestTrace.report, keyed) as held, its arrival the
    router's where a router sent it."""
    routed = None if line.get("router") is None else RouterAttempt.from_object(line["router"])
    return Held(line["arrival"] if routed is None else routed.arrival, line["input_length"], line["output_length"],
                tuple(int(i, 16) for i in line["keyed_ids"]), line["tenant"],
                None if line.get("served") is None else Served.parse(line["served"], replica, line["input_length"]),
                routed, line.get("priority", 0), line.get("max_tokens"),
                tuple(int(i, 16) for i in line.get("keyed_output_ids", ())))


def merge_traces(names: Sequence[str], answers: Sequence[Answer], last: int | None,
                 untraced: Sequence[float] = ()) -> tuple[int, dict]:
    """(HTTP status, body) of the fleet's trace: `GET /admin/trace`'s body as a replica's, over
    every replica that answered (`replicas`: each one's status and lines), a retried request's
    last try alone (`retries_merged`: the earlier tries' lines left out), how many requests no
    replica took in fell in its span (`router_untraced`, of `untraced`: when the router gave up on
    each, Unix time; with no line, every one), `result` partial and a `message` naming the
    replicas that did not answer."""
    traced = [(name, body) for name, (status, body) in zip(names, answers) if status == 200]
    if not traced:
        return none_did(names, answers)
    why = _apart(traced)
    if why is not None:
        return _refusal(why)
    every = [(_held(line, name), name) for name, body in traced for line in body["requests"]]  # and its replica
    kept = last_tries(every)
    where: list[tuple[Held, str]] = sorted(kept, key=lambda pair: pair[0].arrival)  # the router's order
    if last is not None:
        where = where[-last:]
    held = [line for line, _ in where]
    block_tokens = traced[0][1]["block_tokens"]
    lines = [replace(line, replica=name)
             for line, (_, name) in zip(numbered(held, "default", block_tokens), where)]
    rows = [{"replica": name, "status": status,
             **({"requests": len(body["requests"]), "key": body["key"]} if status == 200 else {"error": body.get("error")})}
            for name, (status, body) in zip(names, answers)]
    out = {"capacity": sum(body["capacity"] for _, body in traced),
           "observed": sum(body["observed"] for _, body in traced), "block_tokens": block_tokens,
           "key": traced[0][1]["key"], "key_id": traced[0][1]["key_id"],
           "started_at": held[0].arrival if held else None, "requests": [line.to_object() for line in lines],
           "retries_merged": len(every) - len(kept),
           "router_untraced": sum(1 for when in untraced if not held or when >= held[0].arrival),
           "replicas": rows, "result": "ok" if len(traced) == len(names) else "partial"}
    missing = [f"{row['replica']} ({'not reached' if row['status'] is None else row['status']}: "
               f"{error_said(row)})" for row in rows if row["status"] != 200]
    if missing:
        out["message"] = "not in the trace: " + "; ".join(missing)
    return 200, out
