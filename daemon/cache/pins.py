"""Pins: prefixes an operator keeps in the cache, with owner, note, TTL and per-tenant budgets.

A pin names a prefix by its chain of block keys. Its blocks are never evicted
while the pin lives; blocks of the prefix that are not cached yet get pinned the
moment a request fills them. Budgets count distinct pinned blocks per tenant, so
two pins sharing a system prompt cost its blocks once. Pinning the same prefix
again for the same tenant refreshes that pin (owner, note, TTL) instead of
adding a second one.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass
from typing import Collection

from .errors import PinBudgetExceeded, UnknownPin
from .keys import BlockKey, Namespace


@dataclass(slots=True)
class Pin:
    pin_id: str  # "pin-" + 16 hex digits, derived from tenant and the prefix's last key
    tenant: str  # whose budget pays for it
    keys: tuple[BlockKey, ...]  # the pinned prefix, root first; never empty
    owner: str  # who asked (an operator, a team, a job)
    note: str  # why, in the operator's words
    created_at: float  # clock value when first pinned
    expires_at: float | None  # clock value when it lapses; None = until unpinned
    # where its keys were made, so that kvd can tell a pin no request reaches any more (its
    # weights replaced, scales recalibrated): the block space (Namespace.space_key, hex) and the
    # LoRA adapter (its digest; "": the base model); None where not known (pinned before kvd
    # recorded them)
    space: str | None = None
    adapter_id: str | None = None
    # held for a request's prompt cache breakpoint (KVCacheManager.hold): not stored (kvd's stop writes
    # those running for the next start: breakpoint_holds_file.py), its TTL only ever extended by the
    # requests that mark it again; an operator's pin of the same keys makes it theirs
    breakpoint: bool = False

    @property
    def num_blocks(self) -> int:
        return len(self.keys)

    def describe(self) -> dict[str, object]:
        return {
            "pin_id": self.pin_id, "tenant": self.tenant, "blocks": len(self.keys),
            "owner": self.owner, "note": self.note, "created_at": self.created_at,
            "expires_at": self.expires_at, "space": self.space, "adapter_id": self.adapter_id,
            **({"breakpoint": True} if self.breakpoint else {}),
        }


BREAKPOINT_OWNER = "prompt_cache_breakpoint"  # the owner of a pin held for a request's breakpoint


def pin_id_for(tenant: str, keys: tuple[BlockKey, ...]) -> str:
    digest = hashlib.sha256(b"kvctl/pin/v1" + tenant.encode("utf-8") + b"\0" + keys[-1]).hexdigest()
    return "pin-" + digest[:16]


def pin_origin(namespace: Namespace) -> dict[str, str]:
    """Where a pin's keys were made when they are hashed under `namespace` (Pin.space, Pin.adapter_id)."""
    return {"space": namespace.space_key().hex(), "adapter_id": namespace.adapter_id}


def stranded_reason(pin: Pin, space: str, adapter_ids: Collection[str]) -> str | None:
    """Why no request can reach `pin` at a daemon serving block space `space` and the LoRA
    adapters `adapter_ids` (digests): "space" where its keys were made in another block space (a
    model revision, tokenizer, cache format, scales or block size since changed), "adapter"
    where under LoRA weights not served; None where it can be reached, or where kvd does not
    know where it was made."""
    return unreachable_origin(pin.space, pin.adapter_id, space, adapter_ids)


def unreachable_origin(made_in: str | None, adapter_id: str | None, space: str,
                       adapter_ids: Collection[str]) -> str | None:
    """`stranded_reason` of keys made in block space `made_in` under LoRA weights `adapter_id`."""
    if made_in is not None and made_in != space:
        return "space"
    if adapter_id and adapter_id not in adapter_ids:
        return "adapter"
    return None


class PinRegistry:
    """Bookkeeping of pins; the pool applies their effect on blocks."""

    def __init__(self, default_budget: int, budgets: dict[str, int] | None = None) -> None:
        self.default_budget = default_budget
        self.budgets = dict(budgets or {})
        self._pins: dict[str, Pin] = {}
        self._tenant_keys: dict[str, Counter[BlockKey]] = {}

    def budget(self, tenant: str) -> int:
        return self.budgets.get(tenant, self.default_budget)

    def used(self, tenant: str) -> int:
        return len(self._tenant_keys.get(tenant, ()))

    def get(self, pin_id: str) -> Pin:
        try:
            return self._pins[pin_id]
        except KeyError:
            raise UnknownPin(pin_id) from None

    def __contains__(self, pin_id: str) -> bool:
        return pin_id in self._pins

    def all(self) -> list[Pin]:
        return sorted(self._pins.values(), key=lambda p: (p.tenant, p.created_at, p.pin_id))

    def key_counts(self) -> Counter[BlockKey]:
        total: Counter[BlockKey] = Counter()
        for pin in self._pins.values():
            total.update(pin.keys)
        return total

    def check_budget(self, tenant: str, keys: tuple[BlockKey, ...]) -> None:
        held = self._tenant_keys.get(tenant, Counter())
        added = sum(1 for key in set(keys) if key not in held)
        if len(held) + added > self.budget(tenant):
            raise PinBudgetExceeded(tenant, self.budget(tenant), len(held), added)

    def add(self, pin: Pin) -> None:
        """Record a new pin (the caller checked the budget and that the id is new)."""
        self._pins[pin.pin_id] = pin
        self._tenant_keys.setdefault(pin.tenant, Counter()).update(pin.keys)

    def remove(self, pin_id: str) -> Pin:
        pin = self.get(pin_id)
        del self._pins[pin_id]
        held = self._tenant_keys[pin.tenant]
        held.subtract(pin.keys)
        remaining = +held  # drops keys no other pin of the tenant holds
        if remaining:
            self._tenant_keys[pin.tenant] = remaining
        else:
            del self._tenant_keys[pin.tenant]
        return pin

    def expired(self, now: float) -> list[str]:
        return [p.pin_id for p in self.all() if p.expires_at is not None and p.expires_at <= now]
