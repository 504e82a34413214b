"""OpenAI's `service_tier` as kvd serves it: "flex" defers a request; every other tier is "default".

OpenAI sells "flex" as slower, cheaper processing (batch jobs, evaluations, agents that can wait)
and "priority" as faster. kvd never lets a caller jump ahead of its tenant's place in the queue (the
operator sets places: `tenant_priorities`), so "priority" and "scale" are served as "default". A
"flex" request defers itself by FLEX_DEFERRAL under a priority queue (`queue_order: priority` or
`priority+lpm`), as a request asking vLLM's `priority: 1000` would: it runs after the requests of
its tenant's place (and of places up to 1,000 behind) that do not defer themselves. A FIFO or lpm
queue has no place to defer it to, so there it is served as "default". The answer says which tier
served the request (`service_tier`), as OpenAI's answers do.
"""

from __future__ import annotations

from typing import Any

from kvctl.policies.queue_order import by_priority

TIERS = ("auto", "default", "flex", "priority", "scale")  # what a request may ask for
FLEX_DEFERRAL = 1000  # added to a flex request's own priority (lower runs first, as vLLM orders it)


def checked_tier(asked: Any) -> str | None:
    """The tier a request asks for (None: it names none); ValueError names the field and the value."""
    if asked is not None and asked not in TIERS:
        raise ValueError(f"service_tier: must be one of {', '.join(TIERS)}, got {asked!r}")
    return asked


def served_tier(asked: str | None, queue_order: str) -> str:
    """The tier that serves a request asking `asked` under `queue_order`: flex where the queue is
    ordered by priority, else default."""
    return "flex" if asked == "flex" and by_priority(queue_order) else "default"


def deferral(served: str) -> int:
    """What the served tier adds to the request's own priority."""
    return FLEX_DEFERRAL if served == "flex" else 0
