"""A tenant's files across kvd router's fleet: its budget (`tenant_files_bytes`) counts them all.

Each replica keeps the files uploaded to it and checks an upload, or a new batch's room for its
output, against the tenant's budget (batch_files.py). Behind a router a tenant's uploads are spread
over the replicas, so a budget each replica checked alone would let a tenant keep its budget at
every replica. The router asks each replica what the tenant's files take there (`/admin/files`)
and tells the one it sends the upload or the batch to what they take at the others
(X-KVD-Tenant-Files-Elsewhere), which counts them with its own: the refusal says "across the
fleet". A tenant's uploads and batches through one router go one at a time, so two at once cannot
both pass; a replica that does not answer in time is counted at nothing (its files unknown), and
uploads through two routers at once are each checked alone.
"""

from __future__ import annotations

import asyncio
import weakref
from typing import Sequence

from .batch_routes import ELSEWHERE_HEADER


def bytes_by_replica(replicas: Sequence, tenant: str, answers: Sequence[tuple]) -> dict[int, int]:
    """What `tenant`'s files take at each replica whose `/admin/files?tenant=` answer (status,
    body: fleet_admin's Answer) came, by id() of the replica; one that did not is left out."""
    held = {}
    for replica, (status, body) in zip(replicas, answers):
        if status == 200 and isinstance(body, dict) and isinstance(body.get("tenants"), dict):
            row = body["tenants"].get(tenant)
            held[id(replica)] = int(row["bytes"]) if isinstance(row, dict) else 0
    return held


def elsewhere_header(held: dict[int, int], replica) -> dict[str, str]:
    """The header that tells `replica` what the tenant's files take at the other replicas."""
    return {ELSEWHERE_HEADER: str(sum(b for key, b in held.items() if key != id(replica)))}


class TenantTurns:
    """One upload or new batch of a tenant at a time (each tenant's own lock, let go when unused)."""

    def __init__(self) -> None:
        self._locks: weakref.WeakValueDictionary[str, asyncio.Lock] = weakref.WeakValueDictionary()

    def of(self, tenant: str) -> asyncio.Lock:
        lock = self._locks.get(tenant)
        if lock is None:
            lock = self._locks[tenant] = asyncio.Lock()
        return lock
