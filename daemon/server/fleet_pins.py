"""`kvctl fleet sync-pins` at kvd router: every pin of the fleet on every replica that serves the
same block space.

A pin is stored as block keys, never as tokens, so a replica that joins the fleet (or one that
was down while a pin was made at another) does not have it, and could not make it from the
text it never saw. The router lists every replica's pins with their keys (`GET
/admin/pins?keys=true`), and hands each pin a replica lacks to it as keys (`POST /admin/pins`
with `keys`, its tenant, owner, note and the time it has left). The replica pins the keys:
what its lower tiers hold of the prefix (a shared Redis, a disk that kept it) comes up pinned
at once, and the rest is pinned as the prefix is computed there. Keys are made under a block
space (model revision, tokenizer, cache format, scales, block size), which the pin records; a
replica that serves another one is left out of that pin, and the answer says so (a pin stranded
where it is, its scales recalibrated say, goes nowhere).

A replica that joins a running router (`--replicas-file` and SIGHUP) gets the fleet's pins this
way by itself, once it answers ready (`RouterService.add`); `kvctl fleet sync-pins` does it for
every replica at once, on demand. A request's prompt cache breakpoint holds its prefix where it ran
(its next turns go there): that pin is not copied.
"""

from __future__ import annotations

import asyncio
import json
from typing import Awaitable, Callable, Sequence

from .fleet_admin import Answer, fan_out, none_did

SYNC_TIMEOUT_S = 150.0  # a copy may restore its blocks from a lower tier


Ask = Callable[[Sequence, str, str, bytes | None, float], Awaitable[list[Answer]]]


async def sync_pins(replicas: Sequence, ask: Ask = fan_out, only: str | None = None) -> tuple[int, dict]:
    """Copy every pin to the replicas of its block space that lack it (`only`: to that replica
    alone, as when it joins the fleet): (HTTP status, answer). `ask` makes the calls: at the
    router, RouterService.ask_each (a replica resting unanswering is not listed, nor copied to)."""
    names = [r.name for r in replicas]
    listed = await ask(replicas, "GET", "/admin/pins?keys=true", None, SYNC_TIMEOUT_S)
    if not any(status == 200 for status, _ in listed):
        return none_did(names, listed)
    spaces = {i: body.get("space") for i, (status, body) in enumerate(listed) if status == 200}
    held: dict[str, dict] = {}  # pin id -> the pin as its first holder lists it, and who holds it
    for i, (status, body) in enumerate(listed):
        if status != 200:
            continue
        for pin in body["pins"]:
            if pin.get("breakpoint"):  # a request's hold (cache_breakpoints.py) stays where the request ran
                continue
            # the space its keys were made in (a pin a recalibration stranded names the earlier one)
            entry = held.setdefault(pin["pin_id"], {"pin": pin, "space": pin.get("space") or spaces[i], "on": []})
            entry["on"].append(i)
    copies = []  # (pin id, replica index, request body)
    rows = []
    for pin_id, entry in held.items():
        pin = entry["pin"]
        row = {"pin_id": pin_id, "tenant": pin["tenant"], "blocks": pin["blocks"],
               "already_on": [names[i] for i in entry["on"]], "copied_to": {}, "left_out": {}}
        left = pin.get("expires_in_seconds")
        for i in spaces:
            if i in entry["on"] or (only is not None and names[i] != only):
                continue
            if spaces[i] != entry["space"]:  # (a pin stranded where it is: its keys are of a space gone there)
                row["left_out"][names[i]] = ("the pin is stranded: its keys were made in a block space no longer "
                                             "served" if pin.get("stranded") == "space" else
                                             "serves another block space")
            elif left is not None and left <= 0:
                row["left_out"][names[i]] = "the pin has expired"
            else:
                body = {"keys": pin["keys"], "tenant": pin["tenant"], "owner": pin.get("owner"),
                        "note": pin.get("note", ""), "ttl": left}
                if pin.get("adapter_id") is not None:  # the LoRA adapter its keys were made under
                    body["adapter_id"] = pin["adapter_id"]
                copies.append((row, i, body))
        rows.append(row)
    results = await asyncio.gather(*(_copy(ask, replicas[i], body) for _, i, body in copies))
    for (row, i, _), (status, answer) in zip(copies, results):
        if status == 200:
            row["copied_to"][names[i]] = {"cached_blocks": answer["cached_blocks"]}
        else:
            row["left_out"][names[i]] = _why(status, answer)
    unreached = [f"{names[i]} ({body.get('error') if status is None else status})"
                 for i, (status, body) in enumerate(listed) if status != 200]
    failed = any(status != 200 for status, _ in results)
    out = {"pins": rows, "copied": sum(len(r["copied_to"]) for r in rows),
           "replicas": [{"replica": names[i], "status": status, "space": spaces.get(i)}
                        for i, (status, _) in enumerate(listed)],
           "result": "partial" if unreached or failed else "ok"}
    if unreached:
        out["message"] = "not listed: " + "; ".join(unreached)
    return 200, out


async def _copy(ask: Ask, replica, body: dict) -> tuple[int | None, dict]:
    [(status, answer)] = await ask([replica], "POST", "/admin/pins", json.dumps(body).encode(), SYNC_TIMEOUT_S)
    return status, answer


def _why(status: int | None, answer: dict) -> str:
    error = answer.get("error")
    said = error.get("message", "") if isinstance(error, dict) else str(error)
    return f"not copied ({status}): {said}" if status is not None else f"not reached: {said}"
