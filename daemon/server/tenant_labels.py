"""The `tenant` label of kvd's per-tenant metrics, bounded.

Every tenant kvd sees would otherwise be a series of its own in each per-tenant family, and a
scrape's series (and Prometheus's memory) would grow with the tenants: behind the Unix socket or
a trusted proxy, `X-KVD-Tenant` names them, so a caller can make as many as it likes. The first
`max_tenant_metric_series` tenants seen keep their own label; every later one is counted under
`*` (as in `tenant_cache_shares`: every tenant not named; no tenant can be called that). A
tenant's label never changes while kvd runs, so a counter summed under `*` only grows.
`kvctl tenants` still lists every tenant by name.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

OTHERS = "*"


class TenantLabels:
    def __init__(self, limit: int) -> None:
        if limit < 0:
            raise ValueError(f"max_tenant_metric_series: must be >= 0, got {limit}")
        self.limit = limit
        self._named: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, tenant: str) -> str:
        """The label for `tenant`: its own name while fewer than `limit` tenants have one."""
        with self._lock:
            if tenant in self._named:
                return tenant
            if len(self._named) < self.limit:
                self._named.add(tenant)
                return tenant
            return OTHERS

    def has_own(self, tenant: str) -> bool:
        """Whether `tenant` has a label of its own (it keeps it while kvd runs)."""
        with self._lock:
            return tenant in self._named

    def fold(self, values: Iterable[tuple[str, float]], others: float = 0) -> list[tuple[str, float]]:
        """(tenant, value) pairs as (label, sum of its tenants' values), by label; tenants taken in
        name order, so that which ones get their own label does not depend on a dict's order.
        `others` (the counters of tenants no longer tracked) is added under `*`."""
        sums: dict[str, float] = {OTHERS: others} if others else {}
        for tenant, value in sorted(values):
            label = self(tenant)
            sums[label] = sums.get(label, 0) + value
        return sorted(sums.items())
