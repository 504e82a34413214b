"""What the `belady` eviction policy reads of a replay's future (policies/foresight.py): when each
block key of the trace is next asked for, in requests of arrival order.

A request asks for the keys of its prompt that a hit could serve (its whole blocks before its last
token). The horizon is the latest request the replay has started: a key's next use is the first
request after it that asks for the key. With a FIFO queue requests start in arrival order, so
that is the order the cache meets them in. A request preempted waits at the head of the queue and
asks again for what it had when it starts again: until then its keys are asked for next, before
any request after the horizon."""

from __future__ import annotations

import bisect
import math
from collections import Counter
from typing import Sequence

from kvctl.daemon.cache.keys import BlockKey

from .trace import TraceRequest


POLICY = "belady"  # the replay's policy name for it (a replay's alone: kvd has no such setting)


def reads_the_future(policy_label: str) -> bool:
    """Whether a replay's run (its policy as reports name it: `belady`, `belady+shares`) evicted knowing
    the trace's future: a mark beside kvd's policies, never one to pick."""
    return policy_label.split("+")[0] == POLICY


class TraceFuture:
    """Each key's requests, in arrival order, and how far the replay has come (`horizon`)."""

    def __init__(self, requests: Sequence[TraceRequest], keys: Sequence[Sequence[BlockKey]], block_size: int) -> None:
        uses: dict[BlockKey, list[int]] = {}
        for index, (request, request_keys) in enumerate(zip(requests, keys)):
            for key in request_keys[:max(request.input_length - 1, 0) // block_size]:
                uses.setdefault(key, []).append(index)
        self.uses = uses
        self.horizon = -1  # the latest request started (-1: none yet)
        self.again: Counter[BlockKey] = Counter()  # keys preempted requests ask for again as they restart

    def asked_again(self, keys: Sequence[BlockKey]) -> None:
        """A request preempted: it asks for `keys` again when it restarts, first in the queue."""
        self.again.update(keys)

    def restarted(self, keys: Sequence[BlockKey]) -> None:
        """The request preempted with `keys` started again: they are asked for as the trace says."""
        self.again.subtract(keys)
        for key in keys:
            if self.again[key] <= 0:
                del self.again[key]

    def next_use(self, key: BlockKey | None) -> float:
        """The first request after the horizon that asks for `key`, or sooner, just after the horizon,
        where a preempted request waits to ask for it again (math.inf: none does)."""
        if key in self.again:
            return self.horizon + 0.5
        asked = self.uses.get(key) if key is not None else None
        if not asked:
            return math.inf
        at = bisect.bisect_right(asked, self.horizon)
        return asked[at] if at < len(asked) else math.inf
