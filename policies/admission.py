"""Admission arithmetic: how many new blocks a request needs and whether it fits.

    blocks needed = ceil((prompt tokens + output reservation) / block size)
                    - blocks already cached for the prompt's prefix

`decide` turns the numbers into admit / queue / reject with a reason that names
the limit and the figures. It reads no state: callers pass what they measured.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Verdict(str, Enum):
    ADMIT = "admit"
    QUEUE = "queue"
    REJECT = "reject"


@dataclass(frozen=True, slots=True)
class AdmissionDecision:
    verdict: Verdict
    needed_blocks: int  # new physical blocks the request would take now
    available_blocks: int  # free + evictable blocks, excluding the request's own hits
    reason: str  # empty when admitted


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def sliding_window_blocks(window: int, step_tokens: int, block_size: int) -> int:
    """The most blocks a sequence of a model whose every layer slides a `window` holds at once:
    its window's keys and a step's new tokens (`step_tokens`, kvd's max_batch_tokens), a partial
    block at either end, and the tail block it keeps once the window has passed it."""
    return blocks_for_tokens(window - 1 + max(step_tokens, 1), block_size) + 2


def peak_blocks(tokens: int, block_size: int, window: int | None = None, step_tokens: int = 1) -> int:
    """The most blocks a sequence of `tokens` tokens holds at once: all of them, or under a
    sliding `window` every layer slides no more than `sliding_window_blocks`."""
    blocks = blocks_for_tokens(tokens, block_size)
    return blocks if window is None else min(blocks, sliding_window_blocks(window, step_tokens, block_size))


def blocks_needed(prompt_tokens: int, hit_blocks: int, reserve_tokens: int, block_size: int) -> int:
    return blocks_for_tokens(prompt_tokens + reserve_tokens, block_size) - hit_blocks


def tenant_limit_reason(request: str, tenant: str, in_flight: int, limit: int | None,
                        setting: str = "max_tenant_requests") -> str | None:
    """Why a tenant's new request is turned away: it already has `limit` requests in flight
    (waiting or running), so that one tenant cannot fill the queue every tenant shares. None: it
    may be queued (no limit, or under it). `setting` names where the limit comes from."""
    if limit is None or in_flight < limit:
        return None
    return (f"request {request}: tenant {tenant!r} has {in_flight} requests in flight "
            f"({setting} {limit})")


def pinned_out_reason(request: str, needed_blocks: int, pinned_blocks: int, total_blocks: int,
                      room_blocks: int, *, queued: bool = False) -> str | None:
    """Why a request is turned away for pins: at its longest it needs `needed_blocks`, more than
    the `room_blocks` the cache's `total_blocks` leave beside the `pinned_blocks` pins hold outside
    its own prefix (pinned blocks are never evicted, so it could never finish). `queued`: it waited
    already, and nothing that runs could give a block back. None: the pins leave it room."""
    if needed_blocks <= room_blocks:
        return None
    when = "and nothing runs that could give one back" if queued else "outside its prefix"
    return (f"request {request}: needs {needed_blocks} blocks but pins hold {pinned_blocks} of the cache's "
            f"{total_blocks} {when}, leaving {room_blocks}; it could never finish: unpin some "
            "(kvctl pins, kvctl unpin) or lower max_tokens")


def decide(*, request: str, needed_blocks: int, available_blocks: int, total_blocks: int,
           hit_blocks: int, queue_length: int = 0, queue_limit: int | None = None) -> AdmissionDecision:
    """Admit when it fits now; reject when it can never fit or the queue is full; else queue."""
    if needed_blocks + hit_blocks > total_blocks:
        return AdmissionDecision(
            Verdict.REJECT, needed_blocks, available_blocks,
            f"request {request}: needs {needed_blocks + hit_blocks} blocks in all but the pool has "
            f"{total_blocks}; it can never fit",
        )
    if needed_blocks <= available_blocks:
        return AdmissionDecision(Verdict.ADMIT, needed_blocks, available_blocks, "")
    if queue_limit is not None and queue_length >= queue_limit:
        return AdmissionDecision(
            Verdict.REJECT, needed_blocks, available_blocks,
            f"request {request}: admission queue full ({queue_length} of {queue_limit} waiting)",
        )
    return AdmissionDecision(
        Verdict.QUEUE, needed_blocks, available_blocks,
        f"request {request}: needs {needed_blocks} new blocks, {available_blocks} available",
    )
