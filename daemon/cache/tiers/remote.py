"""The remote tier: block payloads in Redis (or a Redis Cluster), shared between daemons.

Each block is one key, `kvctl:blk:<space>:<block key>`, written with one SET (atomic: readers
see the whole payload or nothing). Every call has a bounded timeout; consecutive failures
open a circuit breaker, during which the tier is skipped (serving goes on) until a probe
succeeds. Capacity counts what this daemon wrote, evicting its own oldest entries; other
daemons' entries are theirs to manage (set a Redis maxmemory policy for the shared total).

Each daemon records the space it writes under in the hash `kvctl:spaces` (spaces.py), so that
any of them can find, and purge, the entries of a model revision none of them serves any more.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import Counter, OrderedDict
from typing import Callable, Sequence

from kvctl.policies.tenant_shares import share_blocks, share_of
from kvctl.policies.tiering import CircuitBreaker

from .payload import PEEK_BYTES, BlockMeta, MetaBook, PayloadError, payload_length, peek_meta
from .spaces import REGISTRY_KEY, is_space_hex, parse_record
from .vectored import write_vectored


log = logging.getLogger("kvd.tiers")

SEEN_LIMIT = 1 << 16  # other daemons' blocks remembered as held by the server (RemoteTier.seen)


CLAIM_PREFIX = b"kvctl:claim:"  # + a fleet eviction's token: the daemon that set it searches the server
CLAIM_SECONDS = 3600


class RemoteUnavailable(Exception):
    """The remote tier is down or its breaker is open; the caller goes on without it."""


def connect(url: str, timeout: float):
    """A client for `redis://`, `rediss://`, `unix://` or `redis+cluster://` (a Redis Cluster)."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    options = dict(socket_timeout=timeout, socket_connect_timeout=timeout, retry=Retry(NoBackoff(), 0))
    if url.startswith("redis+cluster://"):
        from redis.cluster import RedisCluster

        return RedisCluster.from_url("redis://" + url[len("redis+cluster://"):], **options)
    return redis.Redis.from_url(url, **options)


class RemoteTier:
    name = "remote"

    def __init__(self, url: str, capacity_bytes: int, space: bytes, *, timeout: float = 0.5,
                 breaker: CircuitBreaker | None = None, clock: Callable[[], float] = time.monotonic,
                 client=None) -> None:
        self.url, self.capacity_bytes, self.clock = url, capacity_bytes, clock
        self.breaker = breaker or CircuitBreaker()
        self.client = client if client is not None else connect(url, timeout)
        self.lock = threading.Lock()
        self.written: OrderedDict[bytes, int] = OrderedDict()  # our keys -> bytes, oldest first
        # what we wrote under a space we no longer serve: redis key -> (block key, bytes), oldest
        # first; it still counts against our bytes and goes first when room is needed
        self.retired: OrderedDict[bytes, tuple[bytes, int]] = OrderedDict()
        self.used_bytes = 0
        self.meta: MetaBook = MetaBook()  # chain positions of the blocks we wrote
        self.seen: OrderedDict[bytes, None] = OrderedDict()  # blocks we read that others wrote, newest last
        self.last_error: str | None = None
        # the outage in progress: when its first call failed, and how many have failed since
        self.down_since: float | None = None
        self.failed_calls = 0
        self.events = None  # an EventLog: each block this daemon writes or forgets here is logged there
        self.records: dict[bytes, dict] = {}  # what each space we served is (spaces.py), to record
        self._recorded: set[bytes] = set()  # spaces recorded on the server
        # tenant shares of our bytes (tenant_cache_shares): bytes and keys (oldest first) per tenant
        self.shares: dict[str, int] = {}
        self.tenant_bytes: Counter[str] = Counter()
        self._by_tenant: dict[str, OrderedDict[bytes, None]] = {}
        self.share_evictions = 0  # entries deleted because their tenant held more than its share
        self.space = space

    def set_tenant_shares(self, shares) -> None:
        """(tenant, fraction) pairs as `tenant_cache_shares` gives them: when this daemon's bytes
        run out, a tenant holding more than its fraction of them loses its own oldest entries
        first (the most over first), before the oldest of all. No shares without a byte budget."""
        unbounded = self.capacity_bytes >= 2**62
        with self.lock:
            self.shares = {} if unbounded or not shares else share_blocks(shares, self.capacity_bytes)

    def _book(self, meta: BlockMeta, length: int) -> None:
        """Put a block we wrote on the books (the lock held)."""
        tenant = meta.tenant or ""
        self.written[meta.key] = length
        self.used_bytes += length
        self.meta[meta.key] = meta
        self.tenant_bytes[tenant] += length
        self._by_tenant.setdefault(tenant, OrderedDict())[meta.key] = None

    def _unbook(self, key: bytes) -> int | None:
        """Take a block we wrote off the books (the lock held); its bytes, or None."""
        size = self.written.pop(key, None)
        meta = self.meta.pop(key, None)
        if size is None:
            return None
        self.used_bytes -= size
        tenant = (meta.tenant if meta is not None else None) or ""
        self.tenant_bytes[tenant] -= size
        if self.tenant_bytes[tenant] <= 0:
            del self.tenant_bytes[tenant]
        entries = self._by_tenant.get(tenant)
        if entries is not None:
            entries.pop(key, None)
            if not entries:
                del self._by_tenant[tenant]
        return size

    def _share_victim(self) -> bytes | None:
        """The oldest entry of the tenant most over its share, or None when none is over."""
        if not self.shares:
            return None
        over = [(held - share, tenant) for tenant, held in self.tenant_bytes.items()
                if (share := share_of(self.shares, tenant)) is not None and held > share]
        if not over:
            return None
        _, tenant = max(over)
        return next(iter(self._by_tenant[tenant]))

    @staticmethod
    def space_prefix(space: bytes) -> bytes:
        """The Redis key prefix of a block space's entries."""
        return b"kvctl:blk:" + space[:8].hex().encode() + b":"

    @property
    def space(self) -> bytes:
        return self._space

    @space.setter
    def space(self, space: bytes) -> None:
        """Serve another block space (new scales or format): entries are written and looked up
        under its prefix, where other daemons serving it look. What this daemon wrote under the
        old one is of no use to it any more: it leaves the books of held blocks (a `space`
        removal) but still counts against its bytes, and goes first when room is needed."""
        old = getattr(self, "_space", None)
        self._space, self.prefix = space, self.space_prefix(space)
        if old is None or old == space:
            return
        old_prefix = self.space_prefix(old)
        with self.lock:
            leaving = list(self.written.items())
            for key, size in leaving:
                self.retired[old_prefix + key.hex().encode()] = (key, size)
                self.meta.pop(key, None)
            self.written.clear()
            self.tenant_bytes.clear()
            self._by_tenant.clear()
            self.seen.clear()
            if leaving and self.events is not None:
                self.events.removed("remote", [key for key, _ in leaving], "space")

    def redis_key(self, key: bytes) -> bytes:
        return self.prefix + key.hex().encode()

    def record_space(self, space: bytes, record: dict) -> None:
        """Say what `space` is (its record goes to the server with the first write under it, or
        now when the server answers)."""
        self.records[space] = record
        try:
            self._record_current()
        except RemoteUnavailable:
            pass  # the next write records it

    def _record_current(self) -> None:
        record = self.records.get(self.space)
        if record is not None and self.space not in self._recorded:
            space = self.space
            self._call(lambda: self.client.hsetnx(REGISTRY_KEY, space.hex(), json.dumps(record, sort_keys=True)))
            self._recorded.add(space)

    def spaces(self) -> dict[str, dict]:
        """Every space any daemon recorded on the server: {space digest (hex): record}. Raises
        RemoteUnavailable."""
        raw = self._call(lambda: self.client.hgetall(REGISTRY_KEY))
        out = {}
        for space, text in raw.items():
            space = space.decode() if isinstance(space, bytes) else space
            record = parse_record(text)
            if is_space_hex(space) and record is not None:
                out[space] = record
        if self.space.hex() not in out and self.space in self.records:  # the server lost it (its memory policy)
            self._recorded.discard(self.space)
            self._record_current()
            out[self.space.hex()] = self.records[self.space]
        return out

    def _call(self, fn):
        now = self.clock()
        if not self.breaker.allow(now):
            raise RemoteUnavailable(f"circuit open after {self.breaker.failures} failures ({self.last_error})")
        try:
            result = fn()
        except Exception as exc:  # redis.ConnectionError, TimeoutError, ResponseError, ...
            self.breaker.failure(self.clock())
            self.last_error = type(exc).__name__
            self._note_failure(f"{type(exc).__name__}: {exc}")
            raise RemoteUnavailable(f"{type(exc).__name__}: {exc}") from None
        self.breaker.success()
        self.last_error = None
        if self.down_since is not None:
            self._note_recovery()
        return result

    def _note_failure(self, reason: str) -> None:
        """One warning when an outage starts, not one per failed call or probe (a Redis down for an
        hour would otherwise log every few seconds)."""
        with self.lock:
            self.failed_calls += 1
            if self.down_since is not None:
                return
            self.down_since = self.clock()
        log.warning("tier remote failing: %s; skipped while its breaker is open, probed every %.0f s",
                    reason, self.breaker.cooldown)

    def _note_recovery(self) -> None:
        with self.lock:
            if self.down_since is None:
                return
            seconds, failed = self.clock() - self.down_since, self.failed_calls
            self.down_since, self.failed_calls = None, 0
        log.warning("tier remote answering again after %.1f s (%d failed calls)", seconds, failed)

    def health(self) -> str:
        state = self.breaker.state(self.clock())
        return "ok" if state == "closed" else ("down" if state == "open" else "probing")

    def write_group(self, items: Sequence[tuple[BlockMeta, object]]) -> int:
        """SET each payload (pipelined: one round trip); evict our oldest entries beyond capacity.
        A payload is bytes-like or a list of buffers: on a single server the buffers are streamed
        as one RESP bulk string (one atomic SET, no concatenated copy)."""
        if not items:
            return 0
        self._record_current()
        parts = [(self.redis_key(meta.key), p if isinstance(p, list) else [p]) for meta, p in items]
        if hasattr(self.client, "connection_pool") and not hasattr(self.client, "nodes_manager"):
            self._call(lambda: self._set_streamed(parts))
        else:  # a cluster client routes by key slot: plain pipelined SETs of joined values
            def go():
                pipe = self.client.pipeline(transaction=False)
                for key, buffers in parts:
                    pipe.set(key, b"".join(buffers))
                pipe.execute()
            self._call(go)
        with self.lock:
            for meta, payload in items:
                self._unbook(meta.key)
                self._book(meta, payload_length(payload))
            victims, for_share, doomed = [], [], []
            while self.used_bytes > self.capacity_bytes and self.retired:
                redis_key, (_, size) = self.retired.popitem(last=False)
                self.used_bytes -= size
                doomed.append(redis_key)
            while self.used_bytes > self.capacity_bytes and self.written:
                key = self._share_victim()
                if key is not None:
                    for_share.append(key)
                else:
                    key = next(iter(self.written))
                    victims.append(key)
                self._unbook(key)
                doomed.append(self.redis_key(key))
            self.share_evictions += len(for_share)
            if self.events is not None:  # under the lock: the log's order is the books' order
                self.events.stored("remote", [meta for meta, _ in items])
                self.events.removed("remote", for_share, "tenant_share")
                self.events.removed("remote", victims, "capacity")
        if doomed:
            try:
                self._call(lambda: self.client.delete(*doomed))
            except RemoteUnavailable:
                pass  # they age out under the server's own policy
        return sum(payload_length(p) for _, p in items)

    def _set_streamed(self, parts: list[tuple[bytes, list]]) -> None:
        """Pipelined SETs whose values go out in pieces: `*3 $3 SET $klen key $vlen` + buffers."""
        pool = self.client.connection_pool
        try:
            conn = pool.get_connection()  # redis-py >= 5.3
        except TypeError:
            conn = pool.get_connection("SET")  # older redis-py wants a command name
        try:
            stream = []
            for key, buffers in parts:
                total = sum(memoryview(b).nbytes for b in buffers)
                head = b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (len(key), key, total)
                stream += [head, *buffers, b"\r\n"]
            sock = getattr(conn, "_sock", None)
            if sock is None:
                conn.connect()
                sock = getattr(conn, "_sock", None)
            if sock is not None and hasattr(sock, "sendmsg"):
                write_vectored(sock.sendmsg, stream)  # a few system calls for the whole group
            else:
                conn.send_packed_command(stream, check_health=False)
            for _ in parts:
                reply = conn.read_response()
                if reply not in (b"OK", "OK", True):
                    raise RuntimeError(f"SET answered {reply!r}")
        except BaseException:
            conn.disconnect()  # the stream may be mid-command: never reuse it
            raise
        finally:
            pool.release(conn)

    def read(self, key: bytes) -> bytes | None:
        return self._call(lambda: self.client.get(self.redis_key(key)))

    def read_many(self, keys: Sequence[bytes]) -> dict[bytes, bytes]:
        """Payloads of those `keys` the server holds, in one pipelined round trip."""
        def go():
            pipe = self.client.pipeline(transaction=False)
            for key in keys:
                pipe.get(self.redis_key(key))
            return pipe.execute()

        if not keys:
            return {}
        found = dict(zip(keys, self._call(go)))
        gone = [k for k, v in found.items() if v is None and self.holds(k)]
        if gone:  # deleted on the server since (its memory policy, or another daemon's purge)
            self._forget(gone, "gone")
        return {k: v for k, v in found.items() if v is not None}

    def drop(self, key: bytes, reason: str = "operator") -> None:
        self.drop_many([key], reason)

    def drop_many(self, keys: Sequence[bytes], reason: str = "operator") -> set[bytes]:
        """Forget `keys` and delete them on the server (pipelined); a server that is down lets
        them age out under its own policy. Returns the keys this call deleted there (not those
        already gone, say because another daemon's purge took them first)."""
        try:
            return self._call(lambda: self._unlink_each([(self.redis_key(k), k) for k in keys], reason))
        except RemoteUnavailable:
            self._forget(keys, reason)  # nothing here may count on them any more
            return set()

    def _unlink_each(self, chosen: list[tuple[bytes, bytes]], reason: str) -> set[bytes]:
        """`_unlink`, saying which block keys were still on the server."""
        removed: set[bytes] = set()
        self._unlink(chosen, reason, removed)
        return removed

    def claim(self, token: str, seconds: int = CLAIM_SECONDS) -> bool:
        """True for the first daemon to claim `token` on this server (SET NX, expiring after
        `seconds`): of the replicas a router hands one eviction, one per shared server searches it
        (the others would SCAN it again to find nothing). Raises RemoteUnavailable."""
        key = CLAIM_PREFIX + token.encode("ascii")
        return bool(self._call(lambda: self.client.set(key, b"1", nx=True, ex=seconds)))

    def purge(self, select: Callable[[BlockMeta], bool], time_limit: float = 30.0,
              batch: int = 500) -> dict:
        """Delete every entry of this block space on the server, whichever daemon wrote it, whose
        header `select` accepts (an operator's eviction by tenant, or of everything): SCAN for the
        space's keys, read each one's header with GETRANGE, UNLINK the chosen ones, a batch per
        round trip. Entries whose header does not parse are left alone. Stops after `time_limit`
        seconds and says so. Returns {"dropped", "seen", "complete"}; raises RemoteUnavailable."""
        def chosen(keys: list[bytes]) -> list[tuple[bytes, bytes]]:
            pipe = self.client.pipeline(transaction=False)
            for key in keys:
                pipe.getrange(key, 0, PEEK_BYTES - 1)
            out = []
            for key, head in zip(keys, pipe.execute()):
                try:
                    meta = peek_meta(head or b"")
                except PayloadError:
                    continue
                if key == self.redis_key(meta.key) and select(meta):
                    out.append((key, meta.key))
            return out

        return self._sweep(self.prefix, chosen, time_limit, batch)

    def purge_space(self, space: bytes, time_limit: float = 30.0, batch: int = 500) -> dict:
        """Delete every entry of another block space on the server, whichever daemon wrote it (an
        operator's eviction of a model revision no daemon here serves any more): SCAN for its
        prefix and UNLINK, a batch per round trip; nothing is read. Values under the prefix that
        are not named like a block are left alone. Same answer as `purge`."""
        if space == self.space:
            raise ValueError("space: this daemon serves it; evict its blocks through the cache instead")
        prefix = self.space_prefix(space)

        def chosen(keys: list[bytes]) -> list[tuple[bytes, bytes]]:
            out = []
            for key in keys:
                name = key[len(prefix):].decode("ascii", "replace")
                if is_space_hex(name):  # named like a block: 64 lowercase hex digits
                    out.append((key, bytes.fromhex(name)))
            return out

        return self._sweep(prefix, chosen, time_limit, batch)

    def _sweep(self, prefix: bytes, chosen: Callable[[list[bytes]], list[tuple[bytes, bytes]]],
               time_limit: float, batch: int) -> dict:
        """SCAN the keys under `prefix`, a batch at a time, and UNLINK those `chosen` picks (as
        (redis key, block key) pairs), until done or `time_limit` seconds have passed."""
        started, seen, dropped = self.clock(), 0, 0

        def go() -> bool:
            nonlocal seen, dropped
            pending: list[bytes] = []
            for key in self.client.scan_iter(match=prefix + b"*", count=batch):
                pending.append(key if isinstance(key, bytes) else key.encode())
                if len(pending) >= batch:
                    seen, dropped = seen + len(pending), dropped + self._unlink(chosen(pending))
                    pending = []
                    if self.clock() - started > time_limit:
                        return False
            if pending:
                seen, dropped = seen + len(pending), dropped + self._unlink(chosen(pending))
            return True

        complete = self._call(go)
        return {"dropped": dropped, "seen": seen, "complete": complete}

    def note_read(self, key: bytes) -> None:
        """A block read from the server (another daemon's, maybe): remembered, up to SEEN_LIMIT of
        the latest, so that write-through does not write it back."""
        with self.lock:
            self.seen[key] = None
            self.seen.move_to_end(key)
            while len(self.seen) > SEEN_LIMIT:
                self.seen.popitem(last=False)

    def holds(self, key: bytes) -> bool:
        """Whether the server holds the block as far as this daemon knows (it wrote or read it)."""
        return key in self.written or key in self.seen

    def purge_keys(self, keys: Sequence[bytes]) -> dict:
        """Delete these blocks on the server whichever daemon wrote them (keys are the same for
        the same tokens everywhere), in one pipelined round trip. Same answer as `purge`."""
        dropped = self._call(lambda: self._unlink([(self.redis_key(k), k) for k in keys])) if keys else 0
        return {"dropped": dropped, "seen": len(keys), "complete": True}

    def _unlink(self, chosen: list[tuple[bytes, bytes]], reason: str = "operator",
                found: set[bytes] | None = None) -> int:
        """Delete (redis key, block key) pairs on the server and from this daemon's books; `found`
        collects the block keys the server still held."""
        if not chosen:
            return 0
        pipe = self.client.pipeline(transaction=False)
        for redis_key, _ in chosen:
            pipe.unlink(redis_key)
        results = pipe.execute()
        removed = sum(results)
        if found is not None:
            found.update(key for (_, key), gone in zip(chosen, results) if gone)
        with self.lock:
            for redis_key, _ in chosen:
                _, size = self.retired.pop(redis_key, (None, 0))
                self.used_bytes -= size
        self._forget([key for redis_key, key in chosen if redis_key.startswith(self.prefix)], reason)
        return removed

    def _forget(self, keys: Sequence[bytes], reason: str) -> None:
        """Take blocks off this daemon's books (what it wrote, their bytes, their positions)."""
        forgotten = []
        with self.lock:
            for key in keys:
                if self._unbook(key) is not None:
                    forgotten.append(key)
                self.meta.pop(key, None)
                self.seen.pop(key, None)
            if forgotten and self.events is not None:
                self.events.removed("remote", forgotten, reason)

    @property
    def index(self) -> OrderedDict[bytes, int]:
        """Blocks this daemon wrote (other daemons' blocks are found by `read_many`)."""
        return self.written
