"""Requests' prompt cache breakpoint holds across kvd's stop and start.

A hold (cache_breakpoints.py, KVCacheManager.hold) is a pin a request asked for, up to 12 hours:
not stored as it is made (that would be a write a request), so a restart would forget every one,
and a client that asked for 12 hours would find its prefix gone after an upgrade. kvd's stop
writes the holds still running to `breakpoint_holds.json` in the state directory (mode 0600,
written aside and renamed over: whole or not at all) and the next start reads them back, after
the operator's pins (theirs come first), each for what is left of its time, and deletes the file.
A hold whose keys no request can reach any more (made in a block space, or under LoRA weights, that
kvd no longer serves: a new model revision, cache format or block size) is not held again: it
would take its tenant's pin budget and room for up to 12 hours and keep nothing.
A hold re-pins its blocks as requests fill them again (or a disk or Redis tier gives them back:
tier_ops.warm_pins). The file holds tenants and block keys (SHA-256 digests), never a prompt's
text or token ids. Holds made after the last stop are lost to a crash, as their blocks may be.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Collection
from pathlib import Path

from kvctl.daemon.cache import PinBudgetExceeded, PinLeavesNoRoom
from kvctl.daemon.cache.pins import Pin, unreachable_origin
from kvctl.daemon.whole_file import write_whole

from .durations import clock_reading, unix_time

log = logging.getLogger("kvd")

FILE_NAME = "breakpoint_holds.json"
VERSION = 1


def save_holds(pins: list[Pin], clock: float, state_dir: str | Path) -> int:
    """Writes the breakpoint holds among `pins` (their times on the engine's clock, `clock` its
    reading now) to `state_dir`'s file, replacing it whole (none: the file is removed); how many.
    OSError where it cannot."""
    holds = [{"tenant": pin.tenant, "keys": [key.hex() for key in pin.keys], "space": pin.space,
              "adapter_id": pin.adapter_id, "created_at": unix_time(pin.created_at, clock),
              "expires_at": unix_time(pin.expires_at, clock)} for pin in pins if pin.breakpoint]
    path = Path(state_dir) / FILE_NAME
    if not holds:
        path.unlink(missing_ok=True)
        return 0

    def fill(aside: Path) -> None:
        aside.write_text(json.dumps({"version": VERSION, "holds": holds}))

    write_whole(path, fill, mode=0o600)
    return len(holds)


def restore_holds(cache, clock: float, state_dir: str | Path,
                  served: tuple[str, Collection[str]] | None = None) -> dict[str, int]:
    """Holds each one the file names again in `cache` (KVCacheManager; `clock`: its clock's reading
    now), for what is left of its time, and removes the file:
    {"held", "lapsed" (its time ran out while kvd was down), "stranded" (made where no request
    reaches it now: `served`, the block space and the LoRA adapters' ids kvd serves, as
    pins.stranded_reason reads them), "refused" (past its tenant's pin budget or the room pins may
    take now, or a line that is no hold)}. A file that cannot be read is left with a warning."""
    path = Path(state_dir) / FILE_NAME
    counts = {"held": 0, "lapsed": 0, "stranded": 0, "refused": 0}
    if not path.exists():
        return counts
    try:
        document = json.loads(path.read_text())
        holds = document["holds"] if document.get("version") == VERSION else None
        if not isinstance(holds, list):
            raise ValueError(f"version {document.get('version')!r} is not {VERSION}")
    except (OSError, ValueError, KeyError, AttributeError) as exc:
        log.warning("%s cannot be read (%s); the requests' breakpoint holds before the restart are not held again",
                    path, exc)
        return counts
    now = time.time()
    for hold in holds:
        try:
            left = hold["expires_at"] - now
            if left <= 0:
                counts["lapsed"] += 1
                continue
            if served is not None and unreachable_origin(hold.get("space"), hold.get("adapter_id"), *served):
                counts["stranded"] += 1
                continue
            keys = [bytes.fromhex(key) for key in hold["keys"]]
            cache.hold(hold["tenant"], keys, left, space=hold.get("space"), adapter_id=hold.get("adapter_id"),
                       created_at=clock_reading(hold.get("created_at"), now, clock))
            counts["held"] += 1
        # (InvalidRequest, an empty hold, is a ValueError)
        except (PinBudgetExceeded, PinLeavesNoRoom, KeyError, TypeError, ValueError) as exc:
            counts["refused"] += 1
            log.warning("a request's breakpoint hold of tenant %s is not held again after the restart: %s",
                        hold.get("tenant") if isinstance(hold, dict) else "?", exc)
    path.unlink(missing_ok=True)
    return counts
