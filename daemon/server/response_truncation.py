"""`truncation: "auto"`: a conversation over the context drops its earliest turns.

OpenAI's Responses API drops items from the start of a conversation that no longer fits the
model's context. kvd cuts only before a user message, so what is left opens as a conversation
does (never with a tool's output or an answer whose question went). The cut is kept with the
response (and with a conversation of /v1/conversations), so the next turn starts where this one
did: its prompt begins with this one's, and those blocks come from the prefix cache until the
conversation outgrows the context again.

Were the cut the fewest turns that fit, a conversation at the context's edge would outgrow it
again at its very next turn, and be cut again: every turn's prompt would start somewhere new,
and none would come from the cache. So a cut leaves `truncation_headroom` (a share of the room
for the prompt, default a quarter) free: the turns after it fit as they are, from the cache,
until they fill that headroom. Where even the last turn alone would not leave it free, the
fewest turns that fit go instead.
"""

from __future__ import annotations

from typing import Callable

TRUNCATIONS = ("disabled", "auto")


def fitting_cut(conversation: list[dict], prompt_length: Callable[[list[dict]], int], room: int,
                headroom: float = 0.0) -> int | None:
    """How many of `conversation`'s first messages to drop so that `prompt_length` of the rest is
    at most `room`: 0 where it fits whole; else the fewest up to a user message that leave
    `headroom` of the room free, or failing that the fewest that fit; None where even the last
    user message onward does not fit. `prompt_length` renders and counts (a binary search over
    the cuts calls it about log2(turns) times, and there are two searches at most)."""
    if prompt_length(conversation) <= room:
        return 0
    target = int(room * (1.0 - headroom))
    cut = _fewest_cut(conversation, prompt_length, target) if target < room else None
    return cut if cut is not None else _fewest_cut(conversation, prompt_length, room)


def kept_from(items: list[dict], dropped: list[dict]) -> str | None:
    """The id of the item a cut keeps first (a user message's): `items` the conversation's, in
    the order of its messages, `dropped` the messages the cut dropped. A conversation of
    /v1/conversations keeps it, so that its next turn starts there too. None where no item is
    that message (it has no id)."""
    users = sum(1 for message in dropped if message.get("role") == "user")
    asked = [item for item in items if item.get("type", "message") == "message" and item.get("role") == "user"]
    return asked[users].get("id") if users < len(asked) else None


def _fewest_cut(conversation: list[dict], prompt_length: Callable[[list[dict]], int], room: int) -> int | None:
    """The fewest of `conversation`'s first messages, up to a user message, whose dropping makes
    the rest fit `room` (it does not fit whole); None where none does."""
    cuts = [i for i, message in enumerate(conversation) if i > 0 and message.get("role") == "user"]
    low, high, best = 0, len(cuts) - 1, None  # the prompt only shortens as the cut moves on
    while low <= high:
        middle = (low + high) // 2
        if prompt_length(conversation[cuts[middle]:]) <= room:
            best, high = cuts[middle], middle - 1
        else:
            low = middle + 1
    return best
