"""Which replica keeps each response (`kvd router`): a Responses request that continues one
(`previous_response_id`) goes to the replica that answered it, which alone keeps its
conversation, and so do `GET` and `DELETE /v1/responses/{id}`.

The router learns a home from the `X-KVD-Response-Id` header of each answer to `/v1/responses`.
The book is bounded (the least recently used id goes first) and in memory: after the router
restarts, a continued response goes where the routing policy sends it, and a replica that does
not keep it answers 404.
"""

from __future__ import annotations

from collections import OrderedDict

RESPONSE_HOMES_KEPT = 100_000  # ids the router remembers a home for (about 100 bytes each)


class ResponseHomes:
    """Response id -> the name of the replica that answered it, least recently used dropped first."""

    def __init__(self, kept: int = RESPONSE_HOMES_KEPT) -> None:
        self.kept = kept
        self.homes: OrderedDict[str, str] = OrderedDict()

    def note(self, response_id: str, replica: str) -> None:
        self.homes[response_id] = replica
        self.homes.move_to_end(response_id)
        while len(self.homes) > self.kept:
            self.homes.popitem(last=False)

    def home(self, response_id) -> str | None:
        """The replica that answered `response_id` (None: unknown here, or not an id)."""
        if not isinstance(response_id, str) or response_id not in self.homes:
            return None
        self.homes.move_to_end(response_id)
        return self.homes[response_id]

    def forget(self, response_id: str) -> None:
        self.homes.pop(response_id, None)
