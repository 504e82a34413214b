"""kvd router's relay of server-sent events: whole events only, and a stream its replica broke
off ends with an error event and [DONE] rather than half an event and a cut connection."""

from __future__ import annotations

import asyncio
import json

import httpx

from kvctl.daemon.server.event_relay import relay_events

EVENTS = [b'data: {"n": 1}\n\n', b'data: {"n": 2}\n\n', b'data: {"n": 3}\n\n', b"data: [DONE]\n\n"]


async def pieces(data: bytes, sizes, fail: Exception | None = None):
    at = 0
    for size in sizes:
        yield data[at:at + size]
        at += size
    if fail is not None:
        raise fail


def relayed(data: bytes, sizes, fail=None):
    failures = []

    def on_failure(exc, events):
        failures.append((type(exc).__name__, events))
        return f"replica r0 failed during the answer: {exc}"

    async def go():
        return [chunk async for chunk in relay_events(pieces(data, sizes, fail), on_failure)]
    return asyncio.run(go()), failures


def test_events_go_out_whole_however_the_bytes_arrive():
    data = b"".join(EVENTS)
    out, failures = relayed(data, [5, 20, 1, 30, len(data)])
    assert b"".join(out) == data and failures == []
    # bytes 0-25 hold event 1 and part of 2; 0-56, events 2 and 3 whole; the rest, [DONE]
    assert out == [EVENTS[0], EVENTS[1] + EVENTS[2], EVENTS[3]]


def test_a_stream_broken_mid_event_drops_the_half_event_and_ends_with_an_error_and_done():
    data = b"".join(EVENTS)
    cut = len(EVENTS[0]) + 7  # inside the second event
    out, failures = relayed(data, [cut], httpx.RemoteProtocolError("peer closed connection"))
    assert failures == [("RemoteProtocolError", 1)]
    error = json.loads(out[1][len(b"data: "):])
    assert out == [EVENTS[0], out[1], b"data: [DONE]\n\n"] and out[1].endswith(b"\n\n")
    assert error == {"error": {"message": "replica r0 failed during the answer: peer closed connection",
                               "type": "router_error", "param": None, "code": "replica_failed"}}


def test_a_break_after_done_is_no_failure():
    data = b"".join(EVENTS)
    out, failures = relayed(data, [len(data)], httpx.ReadError("reset"))
    assert b"".join(out) == data and failures == []


def test_other_errors_are_not_turned_into_events():
    """Only the replica's connection failing is the replica's failure: a bug here still raises."""
    data = b"".join(EVENTS)
    try:
        relayed(data, [3], ValueError("a bug"))
    except ValueError as exc:
        assert str(exc) == "a bug"
    else:
        raise AssertionError("ValueError swallowed")
