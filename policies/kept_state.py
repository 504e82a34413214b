"""Which kept response or conversation goes when kvd needs room for another (the stores of
`/v1/responses` and `/v1/conversations`): the least recently used of the tenant that holds the
most bytes.

With one least-recently-used order across tenants, one tenant's burst of long conversations
pushes out every other tenant's state (whatever was used longest ago goes, whoever's it is),
and their clients' next turns get 404s. Taking the room from the tenant that holds the most
bounds that: a tenant's own state goes first once it holds more than any other tenant, and a
tenant alone is served by plain LRU.

`KeptByTenant` is fed plain data (keys, tenants, byte counts) and reads no clock.
"""

from __future__ import annotations

from collections import OrderedDict


class KeptByTenant:
    """Each tenant's keys, least recently used first, and the bytes each tenant holds."""

    def __init__(self) -> None:
        self.order: dict[str, OrderedDict[str, None]] = {}
        self.bytes: dict[str, int] = {}

    def add(self, tenant: str, key: str) -> None:
        """`key` is kept for `tenant` (the most recently used of its keys)."""
        keys = self.order.setdefault(tenant, OrderedDict())
        keys[key] = None
        keys.move_to_end(key)

    def used(self, tenant: str, key: str) -> None:
        keys = self.order.get(tenant)
        if keys is not None and key in keys:
            keys.move_to_end(key)

    def remove(self, tenant: str, key: str) -> None:
        keys = self.order.get(tenant)
        if keys is not None:
            keys.pop(key, None)
            self._forget(tenant)

    def grew(self, tenant: str, delta: int) -> None:
        """`tenant` holds `delta` bytes more (fewer, where negative)."""
        self.bytes[tenant] = self.bytes.get(tenant, 0) + delta
        self._forget(tenant)

    def _forget(self, tenant: str) -> None:
        if not self.order.get(tenant) and not self.bytes.get(tenant):
            self.order.pop(tenant, None)
            self.bytes.pop(tenant, None)

    def victim(self, keep: str | None = None) -> str | None:
        """The key to let go of: the least recently used of the tenant holding the most bytes
        (ties: the tenant named first in sort order), never `keep`; None when there is none."""
        for tenant in sorted(self.order, key=lambda t: (-self.bytes.get(t, 0), t)):
            for key in self.order[tenant]:
                if key != keep:
                    return key
        return None
