"""A forwarded request whose replica has gone silent is given up, not waited out.

kvd router forwards a request with a long read timeout (FORWARD_TIMEOUT_S: an answer not streamed
sends nothing until it is whole, and a long one takes minutes). A replica that hangs once it has a
request (its process stopped or deadlocked, its host gone without a reset) left that request's
caller waiting the whole timeout, with no answer at the end. Its other questions tell the router
sooner: while a request waits on a replica, the router asks it /healthz every PROBE_EVERY_S (where
no load poll asks it already: the events view polls every quarter of a second), and once its
questions have gone unanswered, none answered between, over GIVE_UP_SILENT_S, the latest asked
after the request was sent, the router gives the request up: the caller gets a 504
`replica_timeout` (a stream: an error event, then `[DONE]`), and the replica's connection is
closed, which cancels the request there should it wake. It is not sent elsewhere: it may have run.

`watched` is the stream's half: the replica's chunks are read by a task of their own, so that
waiting for the next one can stop without tearing a read in two.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Callable

import httpx

GIVE_UP_SILENT_S = 30.0  # its questions unanswered over this long, none answered between: its requests are given up
PROBE_EVERY_S = 5.0  # while a request waits on a replica no load poll asks, it is asked /healthz this often


class ReplicaSilent(httpx.ReadTimeout):
    """The router stopped waiting for the replica's answer: it has gone silent."""


async def watched(chunks: AsyncIterator[bytes], silent: Callable[[], str | None], every: float
                  ) -> AsyncIterator[bytes]:
    """`chunks` as they come. Every `every` seconds that no chunk comes, `silent()` is asked; where
    it says why, ReplicaSilent(why) is raised (an httpx error: event_relay ends the stream with an
    error event) and the reading stops, closing the replica's connection."""
    queue: asyncio.Queue = asyncio.Queue(maxsize=8)  # (a slow caller holds the reading back, as before)
    end = object()

    async def read() -> None:
        try:
            async for chunk in chunks:
                await queue.put(chunk)
        except Exception as exc:  # raised where the chunk would have been
            await queue.put(exc)
            return
        await queue.put(end)

    reader = asyncio.ensure_future(read())
    try:
        while True:
            try:
                async with asyncio.timeout(every):
                    item = await queue.get()
            except TimeoutError:
                why = silent()
                if why is not None:
                    raise ReplicaSilent(why) from None
                continue
            if item is end:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)
