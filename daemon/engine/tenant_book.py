"""Per-tenant counters for the tenants seen lately, so kvd's memory does not grow with its tenants.

Behind the Unix socket or a trusted proxy, `X-KVD-Tenant` names the tenant, and a gateway that
keeps each end user's prefixes apart sends as many tenants as it has users. Each tenant's counters
(prompt tokens, hits, recomputed tokens, requests turned away, cached blocks evicted, blocks written
down for a "24h" prompt_cache_retention, requests served in explicit prompt cache mode) are kept for
the `limit` tenants active most recently. When one more arrives, the least recently active tenant
is retired: its counters are added to `retired`, so the totals over every tenant stay exact, and a
tenant that comes back starts a row of its own again.

A tenant `keep` names (one with a metric series of its own) is never retired: its series then only
grows, and what is retired is summed under `tenant="*"`, which only grows too.

A book of other counters (the hit curve's, per tenant: daemon/cache/hit_curve.py) gives their
number as `width`; its rows are retired the same way.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable

# evicted_blocks: its cached blocks the pool evicted to make room (for anyone's request);
# retained_blocks: blocks its requests' prompt_cache_retention "24h" wrote to disk and Redis;
# explicit_requests: its requests served in explicit prompt cache mode (cached up to their marks alone)
FIELDS = ("prompt_tokens", "hit_tokens", "recomputed_tokens", "rejected", "evicted_blocks", "retained_blocks",
          "explicit_requests")
PROMPT, HIT, RECOMPUTED, REJECTED, EVICTED, RETAINED, EXPLICIT = range(len(FIELDS))
DEFAULT_LIMIT = 10_000  # max_tracked_tenants when nothing sets it


class TenantBook:
    def __init__(self, limit: int, keep: Callable[[str], bool] = lambda tenant: False,
                 width: int = len(FIELDS)) -> None:
        if limit < 1:
            raise ValueError(f"max_tracked_tenants: must be >= 1, got {limit}")
        self.limit, self.keep, self.width = limit, keep, width
        self._rows: OrderedDict[str, list[int]] = OrderedDict()  # least recently active first
        self.retired = [0] * width  # the counters of every tenant retired, summed
        self.retired_tenants = 0  # rows retired (a tenant retired twice counts twice)

    def row(self, tenant: str) -> list[int]:
        """`tenant`'s counters (indexed by PROMPT, HIT, RECOMPUTED, REJECTED), to add to; it becomes
        the most recently active, and a tenant new to the book may retire the least recent."""
        row = self._rows.get(tenant)
        if row is not None:
            self._rows.move_to_end(tenant)
            return row
        row = self._rows[tenant] = [0] * self.width
        self._retire_beyond_limit(spare=tenant)
        return row

    def add_quietly(self, tenant: str, index: int, value: int) -> None:
        """Add to one of `tenant`'s counters without making it the most recently active (losing
        blocks to another tenant's requests is not activity); a tenant not tracked adds to
        `retired`, so the totals stay exact."""
        row = self._rows.get(tenant)
        if row is None:
            self.retired[index] += value
        else:
            row[index] += value

    def resize(self, limit: int) -> None:
        """Keep `limit` tenants from now on, retiring the least recently active beyond it."""
        if limit < 1:
            raise ValueError(f"max_tracked_tenants: must be >= 1, got {limit}")
        self.limit = limit
        self._retire_beyond_limit()

    def _retire_beyond_limit(self, spare: str | None = None) -> None:
        looked = 0  # tenants kept (or spared) move to the end; each is looked at once per call
        while len(self._rows) > self.limit and looked < len(self._rows):
            tenant = next(iter(self._rows))
            looked += 1
            if tenant == spare or self.keep(tenant):
                self._rows.move_to_end(tenant)
                continue
            row = self._rows.pop(tenant)
            for i, value in enumerate(row):
                self.retired[i] += value
            self.retired_tenants += 1

    def items(self, only: str | None = None) -> list[tuple[str, list[int]]]:
        """(tenant, a copy of its counters), least recently active first; `only`: that tenant's
        alone (none where it has no row)."""
        if only is not None:
            row = self._rows.get(only)
            return [] if row is None else [(only, list(row))]
        return [(tenant, list(row)) for tenant, row in self._rows.items()]

    def names(self) -> set[str]:
        """The tenants that have a row (a copy: cheaper than `items()` where only they count)."""
        return set(self._rows)

    def __len__(self) -> int:
        return len(self._rows)

    def totals(self) -> list[int]:
        """Each counter summed over every tenant, retired or not."""
        out = list(self.retired)
        for row in self._rows.values():
            for i, value in enumerate(row):
                out[i] += value
        return out
