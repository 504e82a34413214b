"""Per-tenant settings written as `acme=0.25,globex=1,*=0.5`, or as a YAML mapping."""

from __future__ import annotations

import math
import re
from typing import Any, Callable, Iterable, Mapping

TENANT_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")


def named_values(value: str | Mapping, form: str) -> list[tuple[str, Any]]:
    """(name, value) pairs in the order given, from `a=1,b=2` (each stripped) or a mapping (names as
    text, values as they are); ValueError names a part without `=`, showing `form` (NAME=DIR)."""
    if isinstance(value, Mapping):
        return [(str(k), v) for k, v in value.items()]
    items = []
    for part in (p.strip() for p in str(value).split(",") if p.strip()):
        name, sep, text = part.partition("=")
        if not sep:
            raise ValueError(f"expected {form}, got {part!r}")
        items.append((name.strip(), text.strip()))
    return items


def parse_tenant_map(value: str | Mapping, convert: Callable[[str, Any], Any], what: str,
                     others: bool = False, noun: str = "setting") -> tuple[tuple[str, Any], ...]:
    """(tenant, convert(tenant, value)) pairs, sorted by tenant: `what` names the value, `noun`
    the entry in messages. `others`: `*` names every tenant not named. ValueError says what is
    wrong (`convert` raises its own for a bad value)."""
    out: dict[str, Any] = {}
    for tenant, text in named_values(value, f"TENANT={what.upper()}"):
        if not tenant:
            raise ValueError(f"a {noun} names its tenant" + (" (or * for the others)" if others else ""))
        if not (TENANT_NAME.fullmatch(tenant) or (others and tenant == "*")):
            raise ValueError(f"tenant {tenant!r} is not a tenant name (letters, digits, . _ -"
                             + ("; or * for the others)" if others else ")"))
        if tenant in out:
            raise ValueError(f"tenant {tenant!r} is given twice")
        out[tenant] = convert(tenant, text)
    return tuple(sorted(out.items()))


def priority_of(tenant: str, value: Any) -> int:
    """A tenant's priority (`tenant_priorities`: an integer, lower first); ValueError names both."""
    try:
        return int(str(value))
    except ValueError:
        raise ValueError(f"priority of {tenant!r} must be an integer, got {value!r}") from None


def queue_wait_of(tenant: str, value: Any) -> float:
    """A tenant's own queue wait limit (`tenant_queue_waits`): seconds >= 0, 0 for none; ValueError
    names both."""
    try:
        seconds = float(str(value))
    except ValueError:
        seconds = -1.0
    if not (math.isfinite(seconds) and seconds >= 0):
        raise ValueError(f"queue wait of {tenant!r} must be a number of seconds >= 0 (0: no limit), got {value!r}")
    return seconds


def any_queue_wait(max_queue_wait: float, tenant_queue_waits: Iterable[tuple[str, float]] = ()) -> bool:
    """Whether any request can time out waiting: under a `max_queue_wait` for all, or a tenant's own
    limit (`tenant_queue_waits`' (tenant, seconds) pairs; 0 is none)."""
    return max_queue_wait > 0 or any(seconds > 0 for _, seconds in tenant_queue_waits)
