"""The cache's event log: every block indexed in or removed from a tier, in order, with why.

A router that sends requests where their prefix is cached, or an operator asking "where did
my prefix go?", needs the removals as much as the stores (field notes 7 and 9). Each event::

    seq      1, 2, 3, ... in the order the daemon's books changed (a fresh count per start:
             `stream_id` tells starts apart); a change of more than EVENT_KEYS blocks is
             several events in a row
    kind     stored | removed
    tier     device | host | disk | remote
    keys     block keys; for `stored`, one chain: keys[i] extends keys[i-1], and keys[0]
             extends `parent` (None: keys[0] starts a chain) at block position `depth`
    reason   removed: capacity (the tier needed room), tenant_share (the tier needed room and the
             block's tenant held more idle blocks than its share), operator (kvctl evict or swap),
             corrupt (failed verification), unwritten (indexed by a step that never ran),
             gone (another daemon or Redis itself deleted it, or its disk segment was deleted
             outside kvd), space (written under scales or a
             format the daemon no longer serves: of no use to it, though still stored)
    tenant   stored: whose namespace the keys were hashed under, where known

Events carry block keys (SHA-256 digests), never token ids or text. The log keeps the newest
events up to a bound on the keys it holds; a consumer that falls behind is told (`gap`) and
starts again from a snapshot (`GET /admin/events/snapshot`, daemon/server/event_feed.py),
applying the events after the snapshot's `seq`: stores and removals are idempotent, so an event the snapshot already
reflects changes nothing.

Producers are the pool (engine thread, under the service lock) and the tiers (their writer
thread too); the log has its own lock, and each append is a few list operations.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass
from typing import Callable, Iterable, NamedTuple, Protocol, Sequence

KINDS = ("stored", "removed")
TIERS = ("device", "host", "disk", "remote")
REASONS = ("capacity", "tenant_share", "filesystem", "operator", "corrupt", "unwritten", "gone", "space", "sleep",
           "private")
DEFAULT_KEY_LIMIT = 1 << 17  # keys held across all events: ~10 MiB
EVENT_KEYS = 512  # at most per event (a larger change is several in a row): a page stays small


class CacheEvent(NamedTuple):
    """One change to a tier's index, as readers get it. The log holds each as a plain tuple of
    these fields: a plain tuple of plain values leaves the garbage collector's books at its first
    collection, and a serving kvd holds tens of thousands of events (up to DEFAULT_KEY_LIMIT keys
    in all), which every whole-heap collection walked as objects (daemon/server/gc_pauses.py)."""

    seq: int
    at: float  # wall-clock seconds
    kind: str
    tier: str
    keys: tuple[bytes, ...]
    reason: str | None = None
    parent: bytes | None = None
    depth: int | None = None
    tenant: str | None = None

    def to_json(self) -> dict:
        out = {"seq": self.seq, "at": round(self.at, 6), "kind": self.kind, "tier": self.tier,
               "keys": [k.hex() for k in self.keys]}
        if self.kind == "stored":
            out.update(parent=None if self.parent is None else self.parent.hex(), depth=self.depth,
                       tenant=self.tenant)
        else:
            out["reason"] = self.reason
        return out


@dataclass(frozen=True, slots=True)
class EventPage:
    events: list[CacheEvent]
    next_seq: int  # pass as `since` for the events after these
    oldest_seq: int  # the oldest event still held (next_seq + 1 when none is)
    gap: bool  # events after `since` were dropped before this read: resynchronise


class Placed(Protocol):
    """What a stored event reads of a block: the pool's `Block` and the tiers' `BlockMeta` have it."""

    key: bytes | None
    parent: bytes | None
    depth: int
    tenant: str | None


def chain_runs(blocks: Iterable[Placed]) -> list[tuple]:
    """Split blocks, in order, into runs where each extends the one before it under one tenant.
    Returns (keys, parent, depth, tenant) per run."""
    runs: list[list] = []
    for b in blocks:
        if runs:
            keys, _, depth, tenant = runs[-1]
            if b.parent == keys[-1] and b.tenant == tenant and b.depth == depth + len(keys):
                keys.append(b.key)
                continue
        runs.append([[b.key], b.parent, b.depth, b.tenant])
    return [(tuple(keys), parent, depth, tenant) for keys, parent, depth, tenant in runs]


@dataclass(frozen=True, slots=True)
class KeyPrefix:
    """Events naming a block whose key starts with these hex digits (4 to 64 of them): the life
    of one block, or of a prefix by its `kvctl prefixes` id."""

    whole: bytes  # the leading full bytes
    nibble: int | None  # the high half of the next byte, for an odd count of digits

    @classmethod
    def parse(cls, text: str) -> "KeyPrefix":
        digits = text.strip().lower()
        if not 4 <= len(digits) <= 64 or any(c not in "0123456789abcdef" for c in digits):
            raise ValueError(f"key: expected 4 to 64 hex digits of a block key, got {text!r}")
        even = len(digits) - len(digits) % 2
        return cls(bytes.fromhex(digits[:even]), int(digits[even], 16) if len(digits) % 2 else None)

    def matches(self, key: bytes) -> bool:
        if not key.startswith(self.whole):
            return False
        return self.nibble is None or key[len(self.whole)] >> 4 == self.nibble


# where a held event's fields are: the log keeps plain tuples in CacheEvent's order
_SEQ, _KIND, _TIER, _KEYS = (CacheEvent._fields.index(name) for name in ("seq", "kind", "tier", "keys"))


def _passes(event: tuple, kinds, tiers, key: KeyPrefix | None) -> bool:
    return ((kinds is None or event[_KIND] in kinds) and (tiers is None or event[_TIER] in tiers)
            and (key is None or any(key.matches(k) for k in event[_KEYS])))


class EventLog:
    """A bounded, ordered log of cache events, readable from any thread."""

    def __init__(self, key_limit: int = DEFAULT_KEY_LIMIT, clock: Callable[[], float] = time.time) -> None:
        if not isinstance(key_limit, int) or key_limit < 1:
            raise ValueError(f"key_limit: expected a positive integer, got {key_limit!r}")
        self.key_limit, self.clock = key_limit, clock
        self.stream_id = secrets.token_hex(8)
        self._events: deque[tuple] = deque()  # CacheEvent's fields, as a plain tuple
        self._keys_held = 0
        self._seq = 0
        self._lock = threading.Lock()
        self._waiters: list[Callable[[], None]] = []
        self.stopping = False  # set by stop_waits: reads answer at once
        self.dropped_events = 0  # trimmed before every consumer may have read them
        self.blocks: Counter[tuple[str, str, str]] = Counter()  # (kind, tier, reason or "") -> blocks, ever

    @property
    def seq(self) -> int:
        """The newest event's seq (0 before the first)."""
        return self._seq

    # ---- producers ---------------------------------------------------------------------------
    def stored(self, tier: str, blocks: Iterable[Placed]) -> None:
        """Blocks indexed in `tier`, in chain order (a chain's blocks in one event, or in
        several that each extend the one before)."""
        parts = []
        for keys, parent, depth, tenant in chain_runs(blocks):
            for start in range(0, len(keys), EVENT_KEYS):
                parts.append(("stored", tier, keys[start:start + EVENT_KEYS],
                              None, keys[start - 1] if start else parent, depth + start, tenant))
        if parts:
            self._append(parts)

    def removed(self, tier: str, keys: Iterable[bytes], reason: str) -> None:
        if reason not in REASONS:  # a producer's slip, caught where it is made
            raise ValueError(f"reason: unknown value {reason!r}; use {', '.join(REASONS)}")
        keys = tuple(keys)
        if keys:
            self._append([("removed", tier, keys[start:start + EVENT_KEYS], reason, None, None, None)
                          for start in range(0, len(keys), EVENT_KEYS)])

    def _append(self, parts: list[tuple]) -> None:
        now = self.clock()
        with self._lock:
            for kind, tier, keys, reason, parent, depth, tenant in parts:
                self._seq += 1
                self._events.append((self._seq, now, kind, tier, keys, reason, parent, depth, tenant))
                self._keys_held += len(keys)
                self.blocks[(kind, tier, reason or "")] += len(keys)
            while self._keys_held > self.key_limit and len(self._events) > 1:
                self._keys_held -= len(self._events.popleft()[_KEYS])
                self.dropped_events += 1
            waiters, self._waiters = self._waiters, []
        self._wake(waiters)

    @staticmethod
    def _wake(waiters: list[Callable[[], None]]) -> None:
        for wake in waiters:
            try:
                wake()
            except Exception:  # noqa: BLE001  (a waiter whose event loop has closed: nothing to wake)
                pass

    def stop_waits(self) -> None:
        """The daemon is stopping: wake every waiting reader now, and let none wait from here on
        (a held-open read would hold the server's shutdown for as long as it waits). Events are
        still logged."""
        with self._lock:
            self.stopping = True
            waiters, self._waiters = self._waiters, []
        self._wake(waiters)

    # ---- consumers ---------------------------------------------------------------------------
    def counts(self) -> dict[tuple[str, str, str], int]:
        """Blocks logged since the start, by (kind, tier, reason or ""): the metrics' source."""
        with self._lock:
            return dict(self.blocks)

    def since(self, seq: int, limit: int = 1000, kinds: Sequence[str] | None = None,
              tiers: Sequence[str] | None = None, key: KeyPrefix | None = None) -> EventPage:
        """Events after `seq`, oldest first, at most `limit` of them after filtering.
        `next_seq` moves past filtered-out events too, so a filtered reader never rereads.
        A `seq` this stream has not reached (the daemon restarted) reads as a gap."""
        with self._lock:
            events = self._events
            oldest = events[0][_SEQ] if events else self._seq + 1
            ahead = seq > self._seq
            if ahead:
                seq = oldest - 1
            gap = ahead or seq < oldest - 1
            picked: list[CacheEvent] = []
            next_seq = self._seq
            for i in range(max(seq + 1, oldest) - oldest, len(events)):
                event = events[i]
                if len(picked) == limit:
                    next_seq = event[_SEQ] - 1
                    break
                if _passes(event, kinds, tiers, key):
                    picked.append(CacheEvent._make(event))
        return EventPage(picked, next_seq, oldest, gap)

    def last(self, count: int, kinds: Sequence[str] | None = None,
             tiers: Sequence[str] | None = None, key: KeyPrefix | None = None) -> EventPage:
        """The newest `count` events that pass the filters, oldest first; `next_seq` is the
        newest event's, so that reading on from it starts after them."""
        picked: list[CacheEvent] = []
        with self._lock:
            for event in reversed(self._events):
                if len(picked) == count:
                    break
                if _passes(event, kinds, tiers, key):
                    picked.append(CacheEvent._make(event))
            picked.reverse()
            oldest = self._events[0][_SEQ] if self._events else self._seq + 1
            return EventPage(picked, self._seq, oldest, False)

    def notify_after(self, seq: int, wake: Callable[[], None]) -> bool:
        """Call `wake` (once, from the producing thread) when an event newer than `seq` exists.
        Returns False, without registering, when one exists already or the log is `stopping`."""
        with self._lock:
            if self._seq > seq or self.stopping:
                return False
            self._waiters.append(wake)
            return True

    def forget_waiter(self, wake: Callable[[], None]) -> None:
        with self._lock:
            if wake in self._waiters:
                self._waiters.remove(wake)
