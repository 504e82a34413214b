"""The token ids of kvd's recent chat replies, so that a next turn is prompted with them.

A chat client sends the model's reply back as text, and kvd renders the conversation and
tokenizes it again. The text often does not tokenize back to the ids the model made: a BPE
tokenizer spells it its own way ("hel"+"lo" made, "hello" read back), and a byte-level one
reads a reply cut inside a character (U+FFFD) as other bytes. Every block of the reply then
misses the cache that holds it, and the next turn computes it again. kvd keeps each reply's
ids by its text (per tenant, and per tokenizer: a new one never reads another's ids), and a
chat that sends that text back as an assistant message is prompted with them
(reply_splice.py): the same text, split as the model split it.

In memory, within `reply_ids_bytes`: for room, the least recently used reply of the tenant
holding the most bytes goes first (policies/kept_state.py), as for the kept responses. A turn
that finds its reply refreshes it, so a conversation in use keeps its replies; one let go is
read back as text, as before (the turn misses the reply's blocks, and the turns after it
follow that prompt). Where the cache outlives the process (a disk or Redis tier), kvd writes them
to the state directory as it stops and reads them back as it starts (reply_ids_file.py), so a
conversation's next turn after a restart hits its replies there too.
"""

from __future__ import annotations

import hashlib
import threading
from array import array

from kvctl.policies.kept_state import KeptByTenant

from .kept_budget import ResizableBudget
from .reply_splice import reply_ids_of

REPLY_IDS_BYTES = 64 * 2**20  # kvd's reply_ids_bytes, and kvd router's, unless set
KEPT_ENDINGS = ("stop", "length")  # how a reply ends for its ids to be kept (by itself, or at its length)

ENTRY_BYTES = 128  # what a kept reply is counted at beside its ids (4 bytes each): its key and books


def entry_bytes(ids) -> int:
    """What a kept reply of these ids is counted at against the budget."""
    return ENTRY_BYTES + 4 * len(ids)


def reply_key(tenant: str, space: str, text: str) -> str:
    """A reply's name: its tenant's, for the tokenizer `space` names, by its text's SHA-256."""
    return hashlib.sha256("\0".join((tenant, space, text)).encode("utf-8", "surrogatepass")).hexdigest()


class ReplyIds(ResizableBudget):
    """Reply token ids by (tenant, tokenizer, text); for room, the least recently used of the
    tenant holding the most bytes goes first."""

    SETTING = "reply_ids_bytes"

    def __init__(self, budget_bytes: int) -> None:
        self.budget = budget_bytes
        self.used = 0
        self.entries: dict[str, tuple[str, str, array]] = {}  # key -> (tenant, tokenizer, ids)
        self.kept = KeptByTenant()
        self.lock = threading.Lock()
        self.remembered = 0  # replies kept (again, when sent again)
        self.dropped = 0  # let go for room
        self.spliced = 0  # assistant messages a chat was prompted with by the reply's own ids
        self.template_changed = 0  # chats read back as text: the template writes a kept reply otherwise

    @property
    def keeps(self) -> bool:
        """Whether it keeps any (reply_ids_bytes 0: none; every chat is tokenized from its text)."""
        return self.budget > 0

    def fits(self, ids) -> bool:
        """Whether a reply of these ids can be kept at all (not bigger than the whole budget)."""
        return self.keeps and entry_bytes(ids) <= self.budget

    def remember_reply(self, tenant: str, tokenizer, output_ids, text: str) -> bool:
        """Keeps a finished reply's ids by its text (as answered) under `tokenizer`'s digest, where
        its ids say that text exactly (reply_splice.reply_ids_of); False where none are kept."""
        if not self.keeps:
            return False
        ids = reply_ids_of(output_ids, text, tokenizer.decode, tokenizer.hidden_specials)
        return ids is not None and self.remember(tenant, tokenizer.digest, text, ids)

    def remember(self, tenant: str, space: str, text: str, ids: list[int]) -> bool:
        """Keeps `ids` as the reply `text` (False: none kept, or bigger than the whole budget)."""
        if not self.fits(ids):
            return False
        with self.lock:
            self._keep(reply_key(tenant, space, text), tenant, space, array("i", ids))
            self.remembered += 1
        return True

    def _keep(self, key: str, tenant: str, space: str, ids: array) -> None:
        self._let_go(key)
        size = entry_bytes(ids)
        self.entries[key] = (tenant, space, ids)
        self.kept.add(tenant, key)
        self.kept.grew(tenant, size)
        self.used += size
        self._make_room(key)

    def kept_in_order(self) -> list[tuple[str, str, str, array]]:
        """Every kept reply as (key, tenant, tokenizer, ids), each tenant's least recently used first:
        what `restore` takes back in the same order of use."""
        with self.lock:
            return [(key, tenant, *self.entries[key][1:]) for tenant, keys in self.kept.order.items() for key in keys]

    def restore(self, rows) -> int:
        """Keeps (key, tenant, tokenizer, ids) rows as `kept_in_order` gave them, within the budget
        (for room, as ever); how many it kept."""
        kept = 0
        with self.lock:
            for key, tenant, space, ids in rows:
                if self.fits(ids):
                    self._keep(key, tenant, space, ids)
                    kept += 1
        return kept

    def ids_for(self, tenant: str, space: str, text: str) -> list[int] | None:
        """The ids of the tenant's reply `text` (now its most recently used), or None."""
        key = reply_key(tenant, space, text)
        with self.lock:
            entry = self.entries.get(key)
            if entry is None:
                return None
            self.kept.used(tenant, key)
            return entry[2].tolist()

    def counted(self, spliced: int, template_changed: bool) -> None:
        """A chat was prompted with `spliced` replies' own ids, or read back as text where
        `template_changed`."""
        with self.lock:
            self.spliced += spliced
            self.template_changed += int(template_changed)

    def budget_refusal(self, budget_bytes: int) -> str | None:
        return None  # (any budget can be set live: lowered, what no longer fits goes)

    def _make_room(self, keep: str | None, why: str = "") -> None:
        while self.used > self.budget:
            victim = self.kept.victim(keep)
            if victim is None:
                break
            self._let_go(victim)
            self.dropped += 1

    def _let_go(self, key: str) -> None:
        entry = self.entries.pop(key, None)
        if entry is not None:
            tenant, _, ids = entry
            size = entry_bytes(ids)
            self.used -= size
            self.kept.remove(tenant, key)
            self.kept.grew(tenant, -size)

    def figures(self) -> dict:
        """For `GET /admin/status` and /metrics."""
        with self.lock:
            return {"budget_bytes": self.budget, "bytes": self.used, "replies": len(self.entries),
                    "remembered": self.remembered, "dropped": self.dropped, "spliced": self.spliced,
                    "template_changed": self.template_changed}
