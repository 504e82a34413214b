"""A cap on the admin calls that change something, held on the event loop before they reach a
worker thread.

Sync handlers share one pool of worker threads (40, anyio's default). An admin call that
changes something writes to the SQLite store, and while another process holds the store's
write lock each such call holds its thread for up to the busy timeout (30 s). Enough of them
(a script pinning for every tenant) took every thread, and `kvctl status`, `/tokenize` and the
admin listings then waited for one, just when an operator looks. `AdminWriteSlots` lets at most
`slots` of them in at once; the rest wait on the event loop, where waiting costs no thread.
"""

from __future__ import annotations

import asyncio

ADMIN_WRITE_SLOTS = 16  # of the 40 shared worker threads
READS_BY_POST = ("/admin/explain", "/admin/route-facts", "/admin/evict/preview")  # POSTs that change nothing


def changes_something(scope) -> bool:
    """Whether a request is an admin call that changes something (a POST, PUT or DELETE under
    /admin/, but for the reads sent by POST)."""
    return (scope["type"] == "http" and scope["method"] in ("POST", "PUT", "DELETE")
            and scope["path"].startswith("/admin/") and scope["path"] not in READS_BY_POST)


class WriteSlots:
    """The slots, one set for every front of a kvd: its fronts share one pool of worker threads."""

    def __init__(self, slots: int = ADMIN_WRITE_SLOTS) -> None:
        self.slots = slots
        self._free: asyncio.Semaphore | None = None  # made on the serving loop, at the first such call

    def free(self) -> asyncio.Semaphore:
        if self._free is None:
            self._free = asyncio.Semaphore(self.slots)
        return self._free


class AdminWriteSlots:
    """ASGI middleware: at most `slots.slots` admin calls that change something run at once."""

    def __init__(self, app, slots: WriteSlots) -> None:
        self.app, self.slots = app, slots

    async def __call__(self, scope, receive, send) -> None:
        if not changes_something(scope):
            await self.app(scope, receive, send)
            return
        async with self.slots.free():
            await self.app(scope, receive, send)
