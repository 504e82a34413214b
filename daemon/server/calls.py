"""What every operation of kvd's service takes and may raise: who calls (`Principal`) and a
refusal with the HTTP status to answer it with (`ServiceError`).

Kept apart from service.py so that the modules of operations (pin_ops, evict_ops, tier_ops,
rollouts, ...) and the service that calls them import both without a cycle.
"""

from __future__ import annotations

from dataclasses import dataclass


class ServiceError(Exception):
    """An operator request that cannot be done; `status` is the HTTP status to answer with and
    `param` the request field it names (None: the request as a whole); `code` the error's code in
    the answer (None: none) and `retry_after` its Retry-After in seconds (None: none)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 retry_after: int | None = None) -> None:
        self.status, self.param, self.code, self.retry_after = status, param, code, retry_after
        super().__init__(message)


@dataclass
class Principal:
    tenant: str
    role: str  # "user" or "admin"
    actor: str  # who, for the audit log ("unix-socket", or the token's name)
