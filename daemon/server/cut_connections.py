"""Connections the HTTP fronts cut, by why, counted per process for /metrics: a caller that never
finishes its request's headers (slowloris), a body that stops coming, a client that reads nothing
of its answer. A rise is a broken client or an attack; kvd logs each at debug only (else an attacker
would write kvd's log)."""

from __future__ import annotations

import collections

from prometheus_client.core import CounterMetricFamily

REASONS = ("header_timeout", "body_timeout", "stalled")
cut: collections.Counter[str] = collections.Counter()


class CutConnections:
    """A prometheus collector: `name`{reason} from `cut`."""

    def __init__(self, name: str) -> None:
        self.name = name

    def collect(self):
        family = CounterMetricFamily(self.name, "Connections the HTTP fronts cut: request headers not in within "
                                     "10 s (header_timeout), a body that stopped coming for 30 s (body_timeout), a "
                                     "client that read nothing of its answer for 60 s (stalled)", labels=["reason"])
        for reason in REASONS:
            family.add_metric([reason], cut[reason])
        yield family
