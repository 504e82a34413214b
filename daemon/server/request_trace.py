"""The requests kvd served lately, as a Mooncake trace (`kvctl trace save`).

`kvctl bench replay` picks a block size, an eviction policy and tier sizes from a trace; this
gives it the operator's own traffic instead of a synthetic one. kvd keeps the last
`trace_requests` (default 10,000) finished requests (served, cancelled or turned away), each
as its arrival, prompt and output lengths, tenant, and one id per 512-token prompt block,
chained as the format asks (equal ids: the same tokens after the same context).

Never the tokens: a block's id is an HMAC-SHA256 chain under a key drawn when kvd starts and
never shown, cut to 64 bits; a saved trace numbers them again 0, 1, 2, ... in order of first
appearance. So a trace cannot be tested against a guessed prompt, and two kvd processes'
traces do not share ids. Tenants start their chains apart, as their cache blocks are.
"""

from __future__ import annotations

import hmac
import os
import threading
from array import array
from collections import deque
from typing import Sequence

from kvctl.daemon.replay.trace import TRACE_BLOCK_TOKENS, TraceRequest


def chained_block_ids(key: bytes, tenant: str, prompt: Sequence[int]) -> tuple[int, ...]:
    """One 64-bit id per 512-token block of `prompt` (the last covers the remainder), each an
    HMAC of the previous block's digest and this block's token ids."""
    digest = hmac.digest(key, b"kvd-trace/v1\0" + tenant.encode("utf-8"), "sha256")
    tokens = memoryview(array("q", prompt).tobytes())
    step = TRACE_BLOCK_TOKENS * 8
    ids = []
    for start in range(0, len(tokens), step):
        digest = hmac.digest(key, digest + tokens[start:start + step], "sha256")
        ids.append(int.from_bytes(digest[:8], "big"))
    return tuple(ids)


class RequestTrace:
    """A bounded record of the last `capacity` finished requests (kvd's `trace_requests`; at 64 bits
    a block, a 40k-token prompt holds 640 bytes); `observe` is an EngineService.on_finished observer."""

    def __init__(self, capacity: int, key: bytes | None = None) -> None:
        self.capacity = capacity
        self._key = key if key is not None else os.urandom(32)
        self._held: deque[tuple[float, int, int, tuple[int, ...], str]] = deque(maxlen=capacity)
        self._lock = threading.Lock()  # observed on the engine's side, read by the API's
        self.observed = 0

    def resize(self, capacity: int) -> None:
        """Keep `capacity` requests from now on, the newest of those held (a reload)."""
        with self._lock:
            self.capacity, self._held = capacity, deque(self._held, maxlen=capacity)

    def observe(self, request) -> None:
        if self.capacity == 0:  # `trace_requests: 0`: nothing kept, nothing hashed
            return
        outputs = [len(s.output_ids) for s in request.sequences]
        record = (request.metrics.arrival, len(request.prompt_ids), max(outputs, default=0),
                  chained_block_ids(self._key, request.tenant, request.prompt_ids), request.tenant)
        with self._lock:
            self._held.append(record)
            self.observed += 1

    def requests(self, last: int | None = None, default_tenant: str | None = None) -> list[TraceRequest]:
        """The held requests (the `last` to arrive, if given) in arrival order, timestamps in ms
        from the first, block ids numbered from 0 in order of first appearance. A request of
        `default_tenant` carries no tenant field, as a single-tenant trace has none."""
        with self._lock:
            held = sorted(self._held, key=lambda r: r[0])
        if last is not None:
            held = held[len(held) - last:] if last < len(held) else held
        numbers: dict[int, int] = {}
        out = []
        for arrival, prompt, output, ids, tenant in held:
            renumbered = tuple(numbers.setdefault(i, len(numbers)) for i in ids)
            out.append(TraceRequest(round((arrival - held[0][0]) * 1000.0, 3), prompt, output, renumbered,
                                    None if tenant == default_tenant else tenant))
        return out

    def report(self, last: int | None = None, default_tenant: str | None = None) -> dict:
        """`GET /admin/trace`: the trace's lines as objects, and what kvd keeps."""
        lines = self.requests(last, default_tenant)
        return {"capacity": self.capacity, "observed": self.observed, "block_tokens": TRACE_BLOCK_TOKENS,
                "requests": [r.to_object() for r in lines]}
