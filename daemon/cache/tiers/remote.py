"""The remote tier: block payloads in Redis (or a Redis Cluster), shared between daemons.

Each block is one key, `kvctl:blk:<space>:<block key>`, written with one SET (atomic: readers
see the whole payload or nothing). Every call has a bounded timeout; consecutive failures
open a circuit breaker, during which the tier is skipped (serving goes on) until a probe
succeeds. Capacity counts what this daemon wrote, evicting its own oldest entries; other
daemons' entries are theirs to manage (set a Redis maxmemory policy for the shared total).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Callable, Sequence

from kvctl.policies.tiering import CircuitBreaker

from .payload import BlockMeta


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
        self.url, self.capacity_bytes, self.space, self.clock = url, capacity_bytes, space, clock
        self.breaker = breaker or CircuitBreaker()
        self.client = client if client is not None else connect(url, timeout)
        self.prefix = b"kvctl:blk:" + space[:8].hex().encode() + b":"
        self.lock = threading.Lock()
        self.written: OrderedDict[bytes, int] = OrderedDict()  # our keys -> bytes, oldest first
        self.used_bytes = 0
        self.meta: dict[bytes, BlockMeta] = {}  # chain positions of blocks we wrote or read
        self.last_error: str | None = None

    def redis_key(self, key: bytes) -> bytes:
        return self.prefix + key.hex().encode()

    def _call(self, fn):
        now = self.clock()
        if not self.breaker.allow(now):
            raise RemoteUnavailable(f"circuit open after {self.breaker.failures} failures ({self.last_error})")
        try:
            result = fn()
        except Exception as exc:  # redis.ConnectionError, TimeoutError, ResponseError, ...
            self.breaker.failure(self.clock())
            self.last_error = type(exc).__name__
            raise RemoteUnavailable(f"{type(exc).__name__}: {exc}") from None
        self.breaker.success()
        self.last_error = None
        return result

    def health(self) -> str:
        state = self.breaker.state(self.clock())
        return "ok" if state == "closed" else ("down" if state == "open" else "probing")

    def write_group(self, items: Sequence[tuple[BlockMeta, bytes]]) -> int:
        """SET each payload (one pipeline round trip); evict our oldest entries beyond capacity."""
        if not items:
            return 0

        def go():
            pipe = self.client.pipeline(transaction=False)
            for meta, payload in items:
                pipe.set(self.redis_key(meta.key), payload)
            pipe.execute()

        self._call(go)
        with self.lock:
            for meta, payload in items:
                if meta.key in self.written:
                    self.used_bytes -= self.written.pop(meta.key)
                self.written[meta.key] = len(payload)
                self.used_bytes += len(payload)
                self.meta[meta.key] = meta
            victims = []
            while self.used_bytes > self.capacity_bytes and self.written:
                key, size = self.written.popitem(last=False)
                self.used_bytes -= size
                self.meta.pop(key, None)
                victims.append(key)
        if victims:
            try:
                self._call(lambda: self.client.delete(*[self.redis_key(k) for k in victims]))
            except RemoteUnavailable:
                pass  # they age out under the server's own policy
        return sum(len(p) for _, p in items)

    def read(self, key: bytes) -> bytes | None:
        return self._call(lambda: self.client.get(self.redis_key(key)))

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        """Which of `keys` the server holds (one round trip)."""
        def go():
            pipe = self.client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(self.redis_key(key))
            return pipe.execute()

        return [bool(x) for x in self._call(go)] if keys else []

    def drop(self, key: bytes) -> None:
        with self.lock:
            size = self.written.pop(key, None)
            if size is not None:
                self.used_bytes -= size
            self.meta.pop(key, None)
        try:
            self._call(lambda: self.client.delete(self.redis_key(key)))
        except RemoteUnavailable:
            pass

    @property
    def index(self) -> OrderedDict[bytes, int]:
        """Blocks this daemon wrote (other daemons' blocks are found with `exists`)."""
        return self.written
