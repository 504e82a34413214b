"""Relaying a replica's server-sent events through kvd router, whole events at a time.

A replica can fail in the middle of a streamed answer: it is killed, restarts without a drain, or
its host goes away. The caller already has a 200 and some events, so the router cannot answer
with a 502 any more; cutting the connection leaves an OpenAI client with a half-written event and
an "incomplete chunked read" it cannot tell from a network fault. Instead the router:

- passes on only whole events (up to a blank line), so a caller never reads half of one;
- ends a broken stream as kvd and vLLM end a failed one: an event carrying an OpenAI error
  object (code `replica_failed`, naming the replica and what broke), then `data: [DONE]`;
- says nothing more when the stream broke after its `[DONE]` (the answer was whole).
"""

from __future__ import annotations

import json
from typing import AsyncIterator, Callable

import httpx

DONE = b"data: [DONE]\n\n"
EVENT_END = b"\n\n"


def error_event(message: str, code: str = "replica_failed") -> bytes:
    """One server-sent event carrying an OpenAI error object."""
    body = {"error": {"message": message, "type": "router_error", "param": None, "code": code}}
    return b"data: " + json.dumps(body).encode() + EVENT_END


async def relay_events(chunks: AsyncIterator[bytes], on_failure: Callable[[Exception, int], str]
                       ) -> AsyncIterator[bytes]:
    """Yield the events read from `chunks` (raw bytes as they arrive), each whole.

    When reading fails with an httpx error before `[DONE]`, the partial event is dropped and
    `on_failure(error, events_sent)` names the failure for the caller: its message goes out as
    an error event, then `[DONE]`. A failure after `[DONE]` is not one: the answer was whole."""
    pending = b""  # the start of an event whose blank line has not arrived yet
    events = 0
    done = False
    try:
        async for chunk in chunks:
            pending += chunk
            end = pending.rfind(EVENT_END)
            if end < 0:
                continue
            whole, pending = pending[:end + len(EVENT_END)], pending[end + len(EVENT_END):]
            events += whole.count(EVENT_END)
            done = done or whole.endswith(DONE)
            yield whole
        if pending:  # a stream that did not end in a blank line: as it came
            yield pending
    except httpx.HTTPError as exc:
        if not done:
            yield error_event(on_failure(exc, events))
            yield DONE
