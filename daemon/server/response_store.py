"""The responses kvd keeps for `previous_response_id` and `GET /v1/responses/{id}`.

In memory, within a budget of bytes (`responses_store_bytes`): the least recently used response
goes first when a new one would not fit, and a response bigger than the whole budget is not kept.
Each is its tenant's: another tenant's id reads as unknown, as if it had never been (a 404 that
says nothing about whose it is). With `responses_store_file` they are written to disk as well
(response_file.py), and a restart finds them there; without it a restart forgets them all.

A response is counted at the JSON of itself, and of each message of its conversation and each
item that made it (`inputs`, which `GET /v1/responses/{id}/input_items` lists) once, however many
responses hold it: the turns of one conversation share their earlier messages and items in
memory (the same objects, continued by `previous_response_id`), so a conversation of N turns
takes what its messages take, not N times that. A message or item is let go with the last
response that holds it.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass

from .response_file import ResponseFile, ResponseFileError


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

    def __init__(self, budget_bytes: int, file: ResponseFile | None = None) -> None:
        """`file`: where they are written as well, and read back from now (response_file.py)."""
        if file is not None and budget_bytes == 0:
            file.close()
            raise ResponseFileError("responses_store_file: needs responses_store_bytes above 0 (with 0 kvd keeps no "
                                    "response, and would empty the file)")
        self.budget = budget_bytes
        self.used = 0
        self.entries: OrderedDict[str, StoredResponse] = OrderedDict()
        # every message and item held, by id(): [responses that hold it, its bytes, itself (so its id stays
        # its), the SHA-256 of its JSON (its name in the file)]
        self.held: dict[int, list] = {}
        self.dropped = 0  # responses let go to make room (or too big to keep)
        self.runs: dict[str, object] = {}  # background responses still running (response_runs.Run), by id
        self.lock = threading.Lock()
        self.file = file
        if file is not None:  # (the oldest first: those that no longer fit go, from the file too)
            for tenant, response, conversation, inputs in file.load():
                self.put(tenant, response, conversation, inputs, written=True)
            file.start()

    @property
    def keeps(self) -> bool:
        """Whether it keeps any response (responses_store_bytes 0: none)."""
        return self.budget > 0

    def put(self, tenant: str, response: dict, conversation: list[dict], inputs: list[dict] = (),
            written: bool = False) -> bool:
        """Keeps `response`, the conversation a next turn continues and the items it was made
        from (and writes it to the file, unless it was read from there: `written`); False (kept
        nothing) when it is bigger than the whole budget (counted as dropped), or the store keeps
        none."""
        if not self.keeps:
            return False
        entry = StoredResponse(tenant, response, tuple(conversation), tuple(inputs), len(json.dumps(response)))
        parts = {id(part): part for part in entry.parts()}  # (each once, as it is held once)
        with self.lock:
            fresh = {key: json.dumps(part, sort_keys=True) for key, part in parts.items() if key not in self.held}
            named = {key: [len(text), hashlib.sha256(text.encode()).hexdigest()] for key, text in fresh.items()}
            named.update({key: self.held[key][1::2] for key in parts if key in self.held})  # (size, digest)
            if entry.size + sum(size for size, _ in named.values()) > self.budget:  # it alone would not fit
                self.dropped += 1
                if written:
                    self.file.remove(response["id"])
                return False
            for key, part in parts.items():  # held before any other goes: what it shares stays
                size, digest = named[key]
                holding = self.held.setdefault(key, [0, size, part, digest])
                holding[0] += 1
                self.used += size if holding[0] == 1 else 0
            self.used += entry.size
            old = self.entries.pop(response["id"], None)  # (one of its id it replaces)
            if old is not None:
                self._release(old)
            while self.used > self.budget:
                gone_id, gone = self.entries.popitem(last=False)
                self._release(gone)
                self.dropped += 1
                if self.file is not None:
                    self.file.remove(gone_id)
            self.entries[response["id"]] = entry
            if self.file is not None and not written:
                self.file.add(tenant, response, [self.held[id(part)][3] for part in conversation],
                              [self.held[id(part)][3] for part in inputs],
                              {named[key][1]: text for key, text in fresh.items()})
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
            if self.file is not None:
                self.file.remove(response_id)
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

    def close(self) -> None:
        """Writes what is left to the file and closes it (at kvd's stop)."""
        if self.file is not None:
            self.file.close()

    def figures(self) -> dict:
        with self.lock:
            return {"responses": len(self.entries), "bytes": self.used, "budget_bytes": self.budget,
                    "dropped": self.dropped, "running": len(self.runs)}
