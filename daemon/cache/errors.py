"""Typed errors of the cache core. Messages name the request and the numbers, never tokens."""

from __future__ import annotations


class CacheError(Exception):
    """Base of every error the cache core raises on purpose."""


class CacheFull(CacheError):
    def __init__(self, request: str, needed: int, available: int, total: int) -> None:
        self.request, self.needed, self.available, self.total = request, needed, available, total
        super().__init__(
            f"request {request}: needs {needed} new blocks but only {available} of {total} "
            "are free or evictable"
        )


class PinBudgetExceeded(CacheError):
    def __init__(self, tenant: str, budget: int, in_use: int, requested: int) -> None:
        self.tenant, self.budget, self.in_use, self.requested = tenant, budget, in_use, requested
        super().__init__(
            f"tenant {tenant!r}: pin budget is {budget} blocks, {in_use} already pinned, "
            f"this pin adds {requested}"
        )


class PinLeavesNoRoom(CacheError):
    """A new pin would leave requests fewer blocks beside the pins than kvd keeps for them."""

    def __init__(self, added: int, pinned_after: int, total: int, floor: int) -> None:
        self.added, self.pinned_after, self.total, self.floor = added, pinned_after, total, floor
        super().__init__(
            f"this pin adds {added} blocks, so pins would hold {pinned_after} of the cache's {total}, "
            f"leaving {max(total - pinned_after, 0)}, and pins must leave {floor} for requests"
        )


class UnknownSequence(CacheError):
    def __init__(self, seq_id: str) -> None:
        self.seq_id = seq_id
        super().__init__(f"unknown sequence {seq_id!r}")


class DuplicateSequence(CacheError):
    def __init__(self, seq_id: str) -> None:
        self.seq_id = seq_id
        super().__init__(f"sequence {seq_id!r} already exists")


class UnknownPin(CacheError):
    def __init__(self, pin_id: str) -> None:
        self.pin_id = pin_id
        super().__init__(f"unknown pin {pin_id!r}")


class InvalidRequest(CacheError, ValueError):
    """A field of a call is out of range; the message names the field and the value."""


class AuditFailure(CacheError, AssertionError):
    """The cache's books do not balance; the message lists every mismatch found."""
