"""Per-tenant settings written as `acme=0.25,globex=1,*=0.5`, or as a YAML mapping."""

from __future__ import annotations

import re
from typing import Any, Callable, Mapping

TENANT_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")


def parse_tenant_map(value: str | Mapping, convert: Callable[[str, Any], Any], what: str,
                     others: bool = False, noun: str = "setting") -> tuple[tuple[str, Any], ...]:
    """(tenant, convert(tenant, value)) pairs, sorted by tenant: `what` names the value, `noun`
    the entry in messages. `others`: `*` names every tenant not named. ValueError says what is
    wrong (`convert` raises its own for a bad value)."""
    if isinstance(value, Mapping):
        items = [(str(k), v) for k, v in value.items()]
    else:
        items = []
        for part in (p.strip() for p in str(value).split(",") if p.strip()):
            tenant, sep, text = part.partition("=")
            if not sep:
                raise ValueError(f"expected TENANT={what.upper()}, got {part!r}")
            items.append((tenant.strip(), text.strip()))
    out: dict[str, Any] = {}
    for tenant, text in items:
        if not tenant:
            raise ValueError(f"a {noun} names its tenant" + (" (or * for the others)" if others else ""))
        if not (TENANT_NAME.fullmatch(tenant) or (others and tenant == "*")):
            raise ValueError(f"tenant {tenant!r} is not a tenant name (letters, digits, . _ -"
                             + ("; or * for the others)" if others else ")"))
        if tenant in out:
            raise ValueError(f"tenant {tenant!r} is given twice")
        out[tenant] = convert(tenant, text)
    return tuple(sorted(out.items()))
