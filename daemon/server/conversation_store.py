"""The conversations kvd keeps for OpenAI's Conversations API (`/v1/conversations`), which the
Responses API's `conversation` continues: the conversation's items, then the request's input,
are the prompt, and the input and the output items are added to it once the response ends.

In memory, within a budget of bytes (`conversations_store_bytes`, the JSON of each conversation's
metadata and items): when new items would not fit, the least recently used conversation of the
tenant holding the most bytes goes first (policies/kept_state.py; counted as dropped, and its
tenant's next request that names it is told so: gone_book.py). A request that would make one
conversation bigger than the whole budget is refused (ConversationError) and changes nothing.
Each is its tenant's: another tenant's id reads as unknown, as if it had never been. A
conversation is written to by one response at a time (`claim`): a second that would continue it
while the first runs is refused, since it could not see the first's items. With
`responses_store_file` every change is written to that file as well (conversation_file.py), and a
restart finds them there.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import weakref
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

from kvctl.policies.kept_state import KeptByTenant

from .conversation_file import ConversationFile
from .gone_book import GoneBook, GoneFile
from .kept_budget import ResizableBudget
from .responses_input import new_id

log = logging.getLogger("kvd")


class ConversationError(Exception):
    """A request the store cannot do; `status` is its HTTP status, the message names the field."""

    def __init__(self, status: int, message: str, param: str, code: str) -> None:
        super().__init__(message)
        self.status, self.param, self.code = status, param, code


@dataclass(slots=True)
class Conversation:
    id: str
    tenant: str
    created_at: int
    metadata: dict
    items: list[dict] = field(default_factory=list)
    size: int = 0  # bytes: the JSON of its metadata and of each item
    updated_at: int = 0  # when it was made or last changed (its items or metadata), for responses_max_age
    writer: weakref.ref | None = None  # the Turn of the response writing to it (claim)
    # the item (a user message) where truncation auto last cut it: the next turns' prompts start there too
    prompt_start: str | None = None

    def shown(self) -> dict:
        """As OpenAI's API shows a conversation (its items are listed apart)."""
        return {"id": self.id, "object": "conversation", "created_at": self.created_at,
                "metadata": dict(self.metadata)}

    def start(self) -> int:
        """The index of the item where truncation last cut it (0: none, or that item is gone)."""
        if self.prompt_start is None:
            return 0
        return next((i for i, item in enumerate(self.items) if item.get("id") == self.prompt_start), 0)

    def item(self, item_id: str) -> dict | None:
        return next((item for item in self.items if item.get("id") == item_id), None)

    def taken_id(self, items: list[dict]) -> int | None:
        """The index of the first of `items` whose id one of its own items has, or one before it
        in `items` (None: every id is new)."""
        held = {item["id"] for item in self.items}
        for i, item in enumerate(items):
            if item["id"] in held:
                return i
            held.add(item["id"])
        return None


class Turn:
    """A response's hold on the conversation it continues, from its start to its end. `end`
    adds its items (None: nothing, as for a failed or cancelled response) and lets go; a Turn
    dropped without `end` (a stream whose client left before it began) lets go as well."""

    def __init__(self, store: ConversationStore, conversation: Conversation, given: list[dict]) -> None:
        self.store, self.conversation, self.given, self.ended = store, conversation, given, False

    def end(self, output: list[dict] | None) -> None:
        """The response has ended: its input items (`given` at its start), then its `output`
        items, are added to the conversation; None: nothing is."""
        if self.ended:
            return
        self.ended = True
        self.store._end_turn(self, None if output is None else [*self.given, *output])


def _size(part) -> int:
    return len(json.dumps(part))


class ConversationStore(ResizableBudget):
    """Conversations by id, each for its tenant; for room, the least recently used of the tenant
    holding the most bytes goes first."""

    SETTING = "conversations_store_bytes"

    def __init__(self, budget_bytes: int, file: ConversationFile | None = None, clock=time.time) -> None:
        """`file`: where they are written as well, and read back from now (with a budget of 0,
        kvd keeps none and leaves the file's as they are)."""
        self.budget = budget_bytes
        self.used = 0
        self.entries: OrderedDict[str, Conversation] = OrderedDict()
        self.kept = KeptByTenant()  # each tenant's, least recently used first, and its bytes: who gives room
        self.filed = file is not None  # (with a budget of 0, kvd reads nothing from it, and writes nothing)
        self.file = file if self.keeps else None
        # why those let go went, for their tenant's next request (not those it deleted); in the file too
        self.gone = GoneBook(file=GoneFile(self.file.file, "conversations") if self.file is not None else None)
        self.dropped = 0  # conversations let go to make room
        self.turns_lost = 0  # responses whose items did not fit in their conversation (it alone over the budget)
        self.expired = 0  # conversations let go once idle longer than responses_max_age (response_admin.expire)
        self.clock = clock  # wall-clock seconds: when a conversation was last changed
        self.lock = threading.Lock()
        if self.file is not None:  # (the least recently used first: those that no longer fit go, from the file too)
            for conversation_id, tenant, created_at, updated_at, metadata, items, start in self.file.load():
                conversation = Conversation(conversation_id, tenant, created_at, metadata, items,
                                            updated_at=updated_at, prompt_start=start)
                conversation.size = _size(metadata) + sum(_size(item) for item in items)
                self._keep(conversation)
                self._make_room(None)  # (one bigger than a smaller budget now goes too)

    @property
    def keeps(self) -> bool:
        """Whether it keeps any conversation (conversations_store_bytes 0: none)."""
        return self.budget > 0

    def _room(self, more: int, param: str) -> None:
        """ConversationError where `more` bytes would be more than the whole budget."""
        if not self.keeps:
            raise ConversationError(400, f"{param}: kvd keeps no conversation (conversations_store_bytes 0)", param,
                                    "conversations_disabled")
        if more > self.budget:
            raise ConversationError(413, f"{param}: the conversation would be {more} bytes, more than kvd keeps for "
                                         f"all conversations (conversations_store_bytes {self.budget})", param,
                                    "conversation_too_large")

    def _keep(self, conversation: Conversation) -> None:
        self.entries[conversation.id] = conversation
        self.used += conversation.size
        self.kept.add(conversation.tenant, conversation.id)
        self.kept.grew(conversation.tenant, conversation.size)

    def _let_go(self, conversation: Conversation) -> None:
        del self.entries[conversation.id]
        self.used -= conversation.size
        self.kept.remove(conversation.tenant, conversation.id)
        self.kept.grew(conversation.tenant, -conversation.size)
        if self.file is not None:
            self.file.delete(conversation.id)

    def _make_room(self, keep: str | None,
                   why: str = "kvd let it go for room (conversations_store_bytes; its tenant held the most)") -> None:
        """Lets go of conversations (not `keep`) until the rest fit: the least recently used of
        the tenant holding the most bytes first."""
        while self.used > self.budget:
            gone_id = self.kept.victim(keep)
            if gone_id is None:
                return
            gone = self.entries[gone_id]
            self._let_go(gone)
            self.dropped += 1
            self.gone.note(gone.tenant, gone_id, why)

    def budget_refusal(self, budget_bytes: int) -> str | None:
        """Why `resize(budget_bytes)` cannot be done live (None: it can): with a file, turning
        conversations off or on needs a restart."""
        if self.filed and (budget_bytes == 0) != (self.budget == 0):
            return (f"conversations_store_bytes: from {self.budget} to {budget_bytes} with responses_store_file needs "
                    "a restart (kvd reads the file's conversations at start, and leaves them there while it keeps "
                    "none)")
        return None

    def create(self, tenant: str, items: list[dict], metadata: dict, created_at: int) -> Conversation:
        """A new conversation of `items` (already shaped, each with its id); ConversationError
        where it alone would not fit."""
        conversation = Conversation(new_id("conv_"), tenant, created_at, dict(metadata), list(items),
                                    updated_at=created_at)
        conversation.size = _size(conversation.metadata) + sum(_size(item) for item in items)
        self._room(conversation.size, "items")
        with self.lock:
            self._keep(conversation)
            if self.file is not None:  # (written before room is made: a drop's delete follows it)
                self.file.create(conversation.id, tenant, created_at, conversation.metadata, conversation.items)
            self._make_room(conversation.id)
        return conversation

    def get(self, tenant: str, conversation_id: str) -> Conversation | None:
        """The tenant's conversation (now the most recently used), or None."""
        with self.lock:
            conversation = self.entries.get(conversation_id)
            if conversation is None or conversation.tenant != tenant:
                return None
            self.entries.move_to_end(conversation_id)
            self.kept.used(tenant, conversation_id)
            return conversation

    def set_metadata(self, conversation: Conversation, metadata: dict) -> None:
        with self.lock:
            grown = _size(metadata) - _size(conversation.metadata)
            self._room(conversation.size + grown, "metadata")
            conversation.metadata = dict(metadata)
            self._written(conversation, "set_metadata", conversation.metadata)
            self._grew(conversation, grown)

    def _written(self, conversation: Conversation, change: str, *args) -> None:
        """`change` made to a conversation: it was updated now, and so it is in the file (where
        there is one, and the conversation is still kept)."""
        conversation.updated_at = int(self.clock())
        if self.file is not None and self.entries.get(conversation.id) is conversation:
            getattr(self.file, change)(conversation.id, conversation.updated_at, *args)

    def _grew(self, conversation: Conversation, grown: int) -> None:
        conversation.size += grown
        if self.entries.get(conversation.id) is conversation:  # (not one dropped or deleted meanwhile)
            self.used += grown
            self.kept.grew(conversation.tenant, grown)
            self._make_room(conversation.id)

    def add(self, conversation: Conversation, items: list[dict]) -> None:
        """Adds `items` (shaped, each with its id) at the end; ConversationError where the
        conversation would not fit, or an item's id is one of its own already."""
        with self.lock:
            self._add(conversation, items)

    def _add(self, conversation: Conversation, items: list[dict]) -> None:
        i = conversation.taken_id(items)
        if i is not None:
            raise ConversationError(400, f"items[{i}].id: the conversation has an item {items[i]['id']!r} already",
                                    f"items[{i}].id", "duplicate_item")
        grown = sum(_size(item) for item in items)
        self._room(conversation.size + grown, "items")
        conversation.items.extend(items)
        self._written(conversation, "add", items)
        self._grew(conversation, grown)

    def set_start(self, conversation: Conversation, item_id: str | None) -> None:
        """Truncation auto cut the conversation at `item_id`: its next prompts start there too
        (Conversation.start), after a restart as well."""
        with self.lock:
            if conversation.prompt_start == item_id:
                return
            conversation.prompt_start = item_id
            if self.file is not None and self.entries.get(conversation.id) is conversation:
                self.file.set_start(conversation.id, item_id)

    def delete_item(self, conversation: Conversation, item_id: str) -> bool:
        with self.lock:
            item = conversation.item(item_id)
            if item is None:
                return False
            conversation.items.remove(item)
            self._written(conversation, "delete_item", item_id)
            self._grew(conversation, -_size(item))
            return True

    def delete(self, tenant: str, conversation_id: str) -> bool:
        with self.lock:
            conversation = self.entries.get(conversation_id)
            if conversation is None or conversation.tenant != tenant:
                return False
            self._let_go(conversation)
            return True

    def claim(self, conversation: Conversation, given: list[dict]) -> Turn:
        """The hold of a response on `conversation` while it runs (`given`: its input items, added
        with its output as it ends); ConversationError (409) where another response holds it."""
        with self.lock:
            writer = conversation.writer() if conversation.writer is not None else None
            if writer is not None and not writer.ended:
                raise ConversationError(409, f"conversation: another response is running on conversation "
                                             f"{conversation.id!r}; send this one once it has ended",
                                        "conversation", "conversation_locked")
            turn = Turn(self, conversation, given)
            conversation.writer = weakref.ref(turn)
            return turn

    def _end_turn(self, turn: Turn, items: list[dict] | None) -> None:
        conversation = turn.conversation
        with self.lock:
            if conversation.writer is not None and conversation.writer() is turn:
                conversation.writer = None
            if items and self.entries.get(conversation.id) is conversation:
                try:
                    self._add(conversation, items)
                except ConversationError as exc:  # (too big now: the conversation stays as it was)
                    self.turns_lost += 1
                    log.warning("conversation %s: a response's items were not added: %s", conversation.id, exc)

    def tenants(self) -> dict[str, dict]:
        """Each tenant's conversations (`GET /admin/responses`): how many, their bytes and items."""
        rows: dict[str, dict] = {}
        with self.lock:
            for conversation in self.entries.values():
                row = rows.setdefault(conversation.tenant, {"conversations": 0, "conversation_bytes": 0})
                row["conversations"] += 1
                row["conversation_bytes"] += conversation.size
        return rows

    def purge(self, tenant: str | None, idle_since: float | None, dry_run: bool = False,
              expired: bool = False, ids: set[str] | None = None) -> dict:
        """Lets go of the conversations of `tenant` (None: every tenant's) last changed before
        `idle_since` (None: whenever), of `ids` (None: any), from the file too; with `dry_run`,
        only counts them; `expired`: counted as let go past their age. {"conversations", "bytes",
        "tenants"}, and with `ids`, "ids": those it found."""
        with self.lock:
            chosen = [conversation for conversation in self.entries.values()
                      if (tenant is None or conversation.tenant == tenant)
                      and (idle_since is None or conversation.updated_at < idle_since)
                      and (ids is None or conversation.id in ids)]
            if not dry_run:
                self.expired += len(chosen) if expired else 0
                why = "unchanged for longer than responses_max_age" if expired else \
                    "an operator purged it (kvctl responses purge)"
                for conversation in chosen:
                    self._let_go(conversation)
                    self.gone.note(conversation.tenant, conversation.id, why)
        found = {"ids": [c.id for c in chosen]} if ids is not None else {}
        return {"conversations": len(chosen), "bytes": sum(c.size for c in chosen),
                "tenants": dict(Counter(c.tenant for c in chosen)), **found}

    def close(self) -> None:
        """Writes the order of use to the file (at kvd's stop, before the file closes)."""
        if self.file is not None:
            with self.lock:
                self.file.save_order(list(self.entries))

    def figures(self) -> dict:
        with self.lock:
            return {"conversations": len(self.entries), "bytes": self.used, "budget_bytes": self.budget,
                    "dropped": self.dropped, "expired": self.expired, "turns_lost": self.turns_lost}
