"""The responses kvd keeps for `previous_response_id` and `GET /v1/responses/{id}`.

In memory, within a budget of bytes (`responses_store_bytes`): the least recently used response
goes first when a new one would not fit, and a response bigger than the whole budget is not kept.
Each is its tenant's: another tenant's id reads as unknown, as if it had never been (a 404 that
says nothing about whose it is). Nothing is written to disk, and a restart forgets them all.

A response is counted at the JSON of itself, and of each message of its conversation and each
item that made it (`inputs`, which `GET /v1/responses/{id}/input_items` lists) once, however many
responses hold it: the turns of one conversation share their earlier messages and items in
memory (the same objects, continued by `previous_response_id`), so a conversation of N turns
takes what its messages take, not N times that. A message or item is let go with the last
response that holds it.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StoredResponse:
    tenant: str
    response: dict  # the Response object as it was answered
    conversation: tuple[dict, ...]  # the chat messages a next turn continues (no instructions)
    inputs: tuple[dict, ...]  # the items it was made from: the earlier turns' inputs and outputs, then its input
    size: int  # bytes of its own: the JSON of the response (its messages and items are counted where they are held)

    def parts(self) -> list[dict]:
        """The messages and items it holds, each of them perhaps held by other responses too."""
        return [*self.conversation, *self.inputs]


class ResponseStore:
    """Responses by id, each for its tenant, least recently used dropped first."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget = budget_bytes
        self.used = 0
        self.entries: OrderedDict[str, StoredResponse] = OrderedDict()
        # every message and item held, by id(): [responses that hold it, its bytes, itself (so its id stays its)]
        self.held: dict[int, list] = {}
        self.dropped = 0  # responses let go to make room (or too big to keep)
        self.runs: dict[str, object] = {}  # background responses still running (response_runs.Run), by id
        self.lock = threading.Lock()

    @property
    def keeps(self) -> bool:
        """Whether it keeps any response (responses_store_bytes 0: none)."""
        return self.budget > 0

    def put(self, tenant: str, response: dict, conversation: list[dict], inputs: list[dict] = ()) -> bool:
        """Keeps `response`, the conversation a next turn continues and the items it was made
        from; False (kept nothing) when it is bigger than the whole budget (counted as dropped),
        or the store keeps none."""
        if not self.keeps:
            return False
        entry = StoredResponse(tenant, response, tuple(conversation), tuple(inputs), len(json.dumps(response)))
        parts = {id(part): part for part in entry.parts()}  # (each once, as it is held once)
        with self.lock:
            sizes = {key: self.held[key][1] if key in self.held else len(json.dumps(part))
                     for key, part in parts.items()}
            if entry.size + sum(sizes.values()) > self.budget:  # it alone would not fit
                self.dropped += 1
                return False
            old = self.entries.pop(response["id"], None)
            if old is not None:
                self._release(old)
            for key, part in parts.items():  # held before any other goes: what it shares stays
                holding = self.held.setdefault(key, [0, sizes[key], part])
                holding[0] += 1
                self.used += sizes[key] if holding[0] == 1 else 0
            self.used += entry.size
            while self.used > self.budget:
                _, gone = self.entries.popitem(last=False)
                self._release(gone)
                self.dropped += 1
            self.entries[response["id"]] = entry
            return True

    def _release(self, entry: StoredResponse) -> None:
        """Lets `entry` go: its own bytes, and each message or item no other response holds."""
        self.used -= entry.size
        for key in {id(part) for part in entry.parts()}:
            holding = self.held[key]
            holding[0] -= 1
            if holding[0] == 0:
                del self.held[key]
                self.used -= holding[1]

    def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        """The tenant's response `response_id` (now the most recently used), or None."""
        with self.lock:
            entry = self.entries.get(response_id)
            if entry is None or entry.tenant != tenant:
                return None
            self.entries.move_to_end(response_id)
            return entry

    def delete(self, tenant: str, response_id: str) -> bool:
        with self.lock:
            entry = self.entries.get(response_id)
            if entry is None or entry.tenant != tenant:
                return False
            del self.entries[response_id]
            self._release(entry)
            return True

    def begin(self, response_id: str, run) -> None:
        """A background response starts: `run` (response_runs.Run) answers for it until it ends."""
        with self.lock:
            self.runs[response_id] = run

    def running(self, tenant: str, response_id: str):
        """The tenant's background response `response_id` while it runs, or None."""
        with self.lock:
            run = self.runs.get(response_id)
            return run if run is not None and run.tenant == tenant else None

    def ended(self, response_id: str) -> None:
        """A background response has ended (and been put, where it is kept)."""
        with self.lock:
            self.runs.pop(response_id, None)

    def figures(self) -> dict:
        with self.lock:
            return {"responses": len(self.entries), "bytes": self.used, "budget_bytes": self.budget,
                    "dropped": self.dropped, "running": len(self.runs)}
