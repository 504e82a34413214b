"""A forwarded request whose replica has gone silent is given up, not waited out.

kvd router forwards a request with a long read timeout (FORWARD_TIMEOUT_S: an answer not streamed
sends nothing until it is whole, and a long one takes minutes). A replica that hangs once it has a
request (its process stopped or deadlocked, its host gone without a reset) left that request's
caller waiting the whole timeout, with no answer at the end. Its other questions tell the router
sooner: while a request waits on a replica, the router asks it what a load poll asks (route facts
for no prompt) every PROBE_EVERY_S, where no load poll asks it already (the events view polls every
quarter of a second). kvd answers that under its engine's lock, so a process that answers but whose
engine is stuck in a step is silent to it, as a stopped one is (its /healthz would answer at once).
Once its
questions have gone unanswered, none answered between, over GIVE_UP_SILENT_S, the latest asked
after the request was sent, the router gives the request up: the caller gets a 504
`replica_timeout` (a stream: an error event, then `[DONE]`), and the replica's connection is
closed, which cancels the request there should it wake. It is not sent elsewhere: it may have run.

`watched` is the stream's half: a watcher asks while the stream waits for the replica's next chunk,
and cancels that wait where the replica has gone silent.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Callable

import httpx

# the defaults of kvd router's silent_give_up_seconds (0: never give up) and silent_probe_seconds
GIVE_UP_SILENT_S = 30.0  # its questions unanswered over this long, none answered between: its requests are given up
PROBE_EVERY_S = 5.0  # while a request waits on a replica no load poll asks, it is asked this often


class ReplicaSilent(httpx.ReadTimeout):
    """The router stopped waiting for the replica's answer: it has gone silent."""


async def watched(chunks: AsyncIterator[bytes], silent: Callable[[], str | None], every: float
                  ) -> AsyncIterator[bytes]:
    """`chunks` as they come. Every `every` seconds, while the caller waits for the next chunk,
    `silent()` is asked; where it says why, that wait is cancelled and ReplicaSilent(why) raised (an
    httpx error: event_relay ends the stream with an error event; the replica's connection, its read
    cut short, is closed). A watcher task of its own asks, so a chunk costs no timer: with one per
    chunk, and a reader task, the relay took 6-7 us more a chunk; this way, about 1 us."""
    waiting: list = [None]  # the task waiting for the next chunk, while it waits (none while it is elsewhere)
    why: list[str] = []

    async def watch() -> None:
        while True:
            await asyncio.sleep(every)
            if waiting[0] is not None and (said := silent()) is not None:
                why.append(said)
                waiting[0].cancel()  # (it waits in the read below: nowhere else is cancelled)
                return

    watcher = asyncio.ensure_future(watch())
    chunks = chunks.__aiter__()
    try:
        while True:
            task = waiting[0] = asyncio.current_task()
            try:
                chunk = await chunks.__anext__()
            except StopAsyncIteration:
                return
            except asyncio.CancelledError:
                if why and task.uncancel() == 0:  # cancelled by the watcher alone
                    raise ReplicaSilent(why[0]) from None
                raise
            finally:
                waiting[0] = None
            yield chunk
    finally:
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
