"""Why a kept response or conversation is gone, for the next request of its tenant that names it.

A client whose conversation kvd let go for room, past `responses_max_age`, or in an operator's
purge would otherwise get the 404 of an id that never was, and could not tell a bug of its own
from kvd's retention. The book remembers the reason for the last GONE_KEPT ids (by tenant: another
tenant still learns nothing), and the 404 says it. One the client deleted itself is not noted.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict

GONE_KEPT = 10_000  # ids whose reason is remembered (about 150 bytes each)


class GoneBook:
    """(tenant, id) -> why and when it went, the oldest forgotten first."""

    def __init__(self, kept: int = GONE_KEPT, clock=time.time) -> None:
        self.kept, self.clock = kept, clock
        self.book: OrderedDict[tuple[str, str], tuple[str, float]] = OrderedDict()
        self.lock = threading.Lock()

    def note(self, tenant: str, key: str, why: str) -> None:
        with self.lock:
            self.book[(tenant, key)] = (why, self.clock())
            while len(self.book) > self.kept:
                self.book.popitem(last=False)

    def why(self, tenant: str, key: str) -> str | None:
        """"<why>, <when> (UTC)" for the tenant's `key`, or None where the book does not know it."""
        with self.lock:
            known = self.book.get((tenant, key))
        if known is None:
            return None
        why, at = known
        return f"{why}, {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(at))}"
