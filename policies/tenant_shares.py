"""Tenant shares of a cache: when room is needed, a tenant holding more idle cached blocks than
its share gives up its own first.

Prefix caching across tenants has a noisy neighbour: one tenant's burst of new prompts pushes
every other tenant's cached prefixes out (with LRU, whatever was released longest ago goes, whoever
it belongs to). A share bounds that. Nothing is evicted while there are free blocks, so a tenant
may use idle room beyond its share; but when an allocation must evict, the victims come first from
the tenants holding more evictable blocks than their share (each tenant's own least recently
released first, the most over its share first), and only then from the wrapped policy's order.

`TenantShares` wraps any `EvictionPolicy` and keeps its interface. It is fed plain data: block ids,
`tenant_of(block_id)` (the tenant a block's key was hashed under, a string) and the shares in
blocks; it reads no clock. Blocks in use and pinned blocks are never evictable, so they count
toward no share.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Iterable, Mapping, Sequence

from .tenant_map import parse_tenant_map

OTHERS = "*"  # the share of every tenant not named


def parse_shares(text: str | Mapping) -> tuple[tuple[str, float], ...]:
    """`acme=0.25,globex=0.25,*=0.5` (or a mapping) as (tenant, fraction of the cache) pairs.
    ValueError names what is wrong; `*` is every tenant not named."""
    def fraction(tenant: str, value) -> float:
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"share of {tenant!r} must be a number in (0, 1], got {value!r}") from None
        if not 0 < number <= 1:
            raise ValueError(f"share of {tenant!r} must be in (0, 1], got {value!r}")
        return number

    return parse_tenant_map(text, fraction, "fraction", others=True, noun="share")


def share_of(shares: Mapping[str, int], tenant: str) -> int | None:
    """`tenant`'s share from `share_blocks`' answer (`*` for a tenant not named); None: it has none."""
    return shares.get(tenant, shares.get(OTHERS))


def share_blocks(shares: Sequence[tuple[str, float]], num_blocks: int) -> dict[str, int]:
    """Each share as whole blocks of a cache of `num_blocks` (at least one)."""
    return {tenant: max(1, int(fraction * num_blocks)) for tenant, fraction in shares}


class TenantShares:
    """An eviction policy that evicts over-share tenants' idle blocks before asking `inner`."""

    def __init__(self, inner, tenant_of: Callable[[int], str | None], shares: Mapping[str, int]) -> None:
        self.inner = inner
        self.name = inner.name
        self.tenant_of = tenant_of
        self.shares = dict(shares)
        self._idle: dict[str, OrderedDict[int, None]] = {}  # tenant -> its evictable blocks, released order
        self._owner: dict[int, str] = {}  # evictable block -> its tenant
        self.evicted_for_share: dict[int, str] = {}  # the last pop's share victims -> their tenant

    def adopt(self, block_ids: Iterable[int]) -> None:
        """Learn the tenants of blocks the inner policy already holds (next victim first), when
        the shares wrap a policy in use."""
        owner, idle, tenant_of = self._owner, self._idle, self.tenant_of
        for block_id in block_ids:
            tenant = tenant_of(block_id) or ""
            owner[block_id] = tenant
            queue = idle.get(tenant)
            if queue is None:
                queue = idle[tenant] = OrderedDict()
            queue[block_id] = None

    # ---- what a tenant may keep --------------------------------------------------------------
    def share_of(self, tenant: str) -> int | None:
        """The tenant's share in blocks; None: it has none (no share for it and no `*`)."""
        return share_of(self.shares, tenant)

    def idle_blocks(self) -> dict[str, int]:
        """Evictable blocks per tenant now."""
        return {tenant: len(blocks) for tenant, blocks in self._idle.items() if blocks}

    def over_share(self) -> list[tuple[str, int]]:
        """(tenant, blocks beyond its share), most over first."""
        over = []
        for tenant, blocks in self._idle.items():
            share = self.share_of(tenant)
            if share is not None and len(blocks) > share:
                over.append((tenant, len(blocks) - share))
        return sorted(over, key=lambda item: (-item[1], item[0]))

    # ---- the EvictionPolicy interface ----------------------------------------------------------
    def on_insert(self, block_ids: Sequence[int], depths: Sequence[int], now: float, priority: int = 0) -> None:
        self.inner.on_insert(block_ids, depths, now, priority)

    def record_hits(self, block_ids: Sequence[int], now: float, priority: int = 0) -> None:
        self.inner.record_hits(block_ids, now, priority)

    def push(self, block_ids: Iterable[int], now: float) -> None:
        block_ids = list(block_ids)
        self.inner.push(block_ids, now)
        self.adopt(block_ids)

    def remove(self, block_id: int) -> None:
        self.inner.remove(block_id)
        self._drop(block_id)

    def forget(self, block_id: int) -> None:
        self.inner.forget(block_id)
        self._drop(block_id)

    def reprioritise(self, change: Callable[[int], int]) -> int:
        return self.inner.reprioritise(change)

    def pop(self, now: float) -> int:
        return self.pop_many(1, now)[0]

    def pop_many(self, count: int, now: float) -> list[int]:
        if count > len(self.inner):
            raise LookupError(f"asked for {count} victims, {len(self.inner)} evictable")
        victims: list[int] = []
        self.evicted_for_share = {}
        for tenant, excess in self.over_share():
            blocks = self._idle[tenant]
            for _ in range(min(excess, count - len(victims))):
                block_id = next(iter(blocks))
                self.inner.remove(block_id)
                self.inner.forget(block_id)
                self._drop(block_id)
                victims.append(block_id)
                self.evicted_for_share[block_id] = tenant
            if len(victims) == count:
                return victims
        rest = self.inner.pop_many(count - len(victims), now)
        for block_id in rest:
            self._drop(block_id)
        return victims + rest

    def __len__(self) -> int:
        return len(self.inner)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self.inner

    def order(self) -> list[int]:
        """Evictable blocks, next victim first: over-share tenants' excess, then the inner order."""
        first = [block_id for tenant, excess in self.over_share()
                 for block_id in list(self._idle[tenant])[:excess]]
        taken = set(first)
        return first + [b for b in self.inner.order() if b not in taken]

    def problems(self) -> list[str]:
        """Mismatches between the tenants' books and the inner policy (the pool's audit calls it)."""
        found = []
        if len(self._owner) != len(self.inner):
            found.append(f"tenant shares track {len(self._owner)} evictable blocks, the policy holds {len(self.inner)}")
        for block_id, tenant in self._owner.items():
            if block_id not in self.inner:
                found.append(f"block {block_id}: tracked for tenant {tenant!r} but not evictable")
            elif (self.tenant_of(block_id) or "") != tenant:
                found.append(f"block {block_id}: tracked for tenant {tenant!r}, holds {self.tenant_of(block_id)!r}'s")
        if sum(len(blocks) for blocks in self._idle.values()) != len(self._owner):
            found.append("tenant shares: per-tenant queues disagree with the owners")
        return found

    def _drop(self, block_id: int) -> None:
        tenant = self._owner.pop(block_id, None)
        if tenant is not None:
            blocks = self._idle[tenant]
            blocks.pop(block_id, None)
            if not blocks:
                del self._idle[tenant]
