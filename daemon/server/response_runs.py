"""A response served in the background (`background: true`), while it runs.

The request runs in kvd whether or not its client stays. The client comes back for it by id:
`GET /v1/responses/{id}` gives the response as it stands (`queued` until its first output,
then `in_progress` with the output so far); one made with `stream: true` streams its events
again from any point (`GET /v1/responses/{id}?stream=true&starting_after=N`); `POST
/v1/responses/{id}/cancel` cancels it. When it ends it is kept in the ResponseStore as any
response is, and its events stay a while longer (response_store.REPLAY_S), for a client whose
stream dropped near the end to stream the rest.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Callable

OPENING_EVENTS = ("response.created", "response.in_progress")


class Run:
    """One background response: its status, its events (where its client streams them), and the
    whole response once it has ended (`final`)."""

    def __init__(self, tenant: str, request_id: str, keeps_events: bool, snapshot: Callable[[str], dict]) -> None:
        self.tenant = tenant
        self.request_id = request_id  # the engine's, which cancelling it cancels
        self.events: list[dict] | None = [] if keeps_events else None  # by sequence_number
        self.status = "queued"  # until its first output
        self.snapshot = snapshot  # the response as it stands, given its status
        self.final: dict | None = None
        self.task: asyncio.Task | None = None
        self.cancel_asked = False  # its client (or an operator's purge) cancelled it: not kvd's stop
        self._changed = asyncio.Event()

    def now(self) -> dict:
        """The response as it stands: the whole one once it has ended."""
        return self.final if self.final is not None else self.snapshot(self.status)

    def publish(self, event: dict) -> None:
        if event["type"] not in OPENING_EVENTS:
            self.status = "in_progress"
        if self.events is not None:
            self.events.append(event)
        self._wake()

    def end(self, response: dict) -> None:
        self.final = response
        self._wake()

    def _wake(self) -> None:
        woken, self._changed = self._changed, asyncio.Event()
        woken.set()

    async def events_after(self, after: int) -> AsyncIterator[dict]:
        """Its events after sequence number `after` (-1: from the first), as they come, until it ends."""
        position = after + 1
        while True:
            changed = self._changed
            batch = self.events[position:]
            position += len(batch)
            for event in batch:
                yield event
            if self.final is not None and position >= len(self.events):
                return
            if not batch:
                await changed.wait()


async def settled(run: Run, cancel: Callable[[str], object]) -> dict:
    """Cancels a background response (`cancel`: the service's, by request id) and waits for it
    to end: the response as it ended (kept, where it is kept)."""
    run.cancel_asked = True
    cancel(run.request_id)
    await asyncio.wait({run.task})
    return run.final
