"""`truncation: "auto"`: a conversation over the context drops its earliest turns.

OpenAI's Responses API drops items from the start of a conversation that no longer fits the
model's context. kvd cuts only before a user message, so what is left opens as a conversation
does (never with a tool's output or an answer whose question went), and it drops the fewest
turns that make the prompt fit with room for the reply. The cut is kept with the response, so
the next turn starts where this one did: its prompt begins with this one's, and those blocks
come from the prefix cache until the conversation outgrows the context again.
"""

from __future__ import annotations

from typing import Callable

TRUNCATIONS = ("disabled", "auto")


def fitting_cut(conversation: list[dict], prompt_length: Callable[[list[dict]], int], room: int) -> int | None:
    """How many of `conversation`'s first messages to drop so that `prompt_length` of the rest is
    at most `room`: 0 where it fits whole, else the fewest up to a user message; None where even
    the last user message onward does not fit. `prompt_length` renders and counts (it is called
    about log2(turns) times: a binary search over the cuts)."""
    if prompt_length(conversation) <= room:
        return 0
    cuts = [i for i, message in enumerate(conversation) if i > 0 and message.get("role") == "user"]
    low, high, best = 0, len(cuts) - 1, None  # the prompt only shortens as the cut moves on
    while low <= high:
        middle = (low + high) // 2
        if prompt_length(conversation[cuts[middle]:]) <= room:
            best, high = cuts[middle], middle - 1
        else:
            low = middle + 1
    return best
