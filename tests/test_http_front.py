"""kvd's HTTP fronts close a connection whose request headers do not arrive in time (slowloris),
and never one whose request is being answered."""

from __future__ import annotations

import asyncio
import contextlib
import resource
import socket
import time

import pytest

uvicorn = pytest.importorskip("uvicorn")

from kvctl.daemon.server import http_front  # noqa: E402

DEADLINE = 0.4


async def app(scope, receive, send):
    """/slow streams three chunks over 1.2 s (three deadlines); anything else answers at once."""
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    if scope["path"] == "/slow":
        for _ in range(3):
            await send({"type": "http.response.body", "body": b"tick\n", "more_body": True})
            await asyncio.sleep(DEADLINE)
    await send({"type": "http.response.body", "body": b"done\n"})


def bases() -> list:
    from uvicorn.protocols.http.h11_impl import H11Protocol

    found = [H11Protocol]
    with contextlib.suppress(ImportError):
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
        found.append(HttpToolsProtocol)
    return found


async def read_all(reader, limit: float = 5.0) -> tuple[bytes, float]:
    """Everything the server sends until it closes, and how long that took."""
    start = time.monotonic()
    data = await asyncio.wait_for(reader.read(), limit)
    return data, time.monotonic() - start


@pytest.mark.parametrize("base", bases(), ids=lambda b: b.__name__)
def test_a_connection_without_request_headers_in_time_gets_408_and_is_closed(tmp_path, base):
    path = str(tmp_path / "front.sock")

    async def scenario():
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(path)
        config = uvicorn.Config(app, http=http_front.with_header_deadline(base, DEADLINE), log_level="warning",
                                lifespan="off")
        server = uvicorn.Server(config)
        serving = asyncio.create_task(server.serve(sockets=[listener]))
        while not server.started:
            await asyncio.sleep(0.01)
        outcomes = {}
        silent = await asyncio.open_unix_connection(path)  # connects, sends nothing
        partial = await asyncio.open_unix_connection(path)  # a header at a time, never the end
        partial[1].write(b"GET /fast HTTP/1.1\r\nhost: kvd\r\n")
        slow = await asyncio.open_unix_connection(path)  # a response longer than the deadline
        slow[1].write(b"GET /slow HTTP/1.1\r\nhost: kvd\r\nconnection: close\r\n\r\n")
        outcomes["silent"], outcomes["partial"], outcomes["slow"] = await asyncio.gather(
            read_all(silent[0]), read_all(partial[0]), read_all(slow[0]))
        # keep-alive: a second request begun after the first's answer, and never finished
        reader, writer = await asyncio.open_unix_connection(path)
        writer.write(b"GET /fast HTTP/1.1\r\nhost: kvd\r\n\r\n")
        first = await reader.readuntil(b"done\n\r\n0\r\n\r\n")  # the whole chunked answer
        writer.write(b"GET /fast HTTP/1.1\r\n")
        outcomes["second"] = await read_all(reader)
        server.should_exit = True
        await serving
        return outcomes, first

    outcomes, first = asyncio.run(scenario())
    for name in ("silent", "partial", "second"):
        data, took = outcomes[name]
        assert data.startswith(b"HTTP/1.1 408 Request Timeout\r\n"), name
        assert data.endswith(b"\r\n\r\nrequest headers did not arrive within 0.4 s\n"), name
        assert DEADLINE * 0.9 <= took < DEADLINE * 4, (name, took)
    assert first.startswith(b"HTTP/1.1 200 OK\r\n")
    streamed, took = outcomes["slow"]
    assert streamed.startswith(b"HTTP/1.1 200 OK\r\n") and streamed.endswith(b"\r\n\r\n" + b"5\r\ntick\n\r\n" * 3
                                                                            + b"5\r\ndone\n\r\n0\r\n\r\n")
    assert took >= 3 * DEADLINE  # answered in full past three deadlines


def test_the_open_file_limit_is_raised_to_the_hard_limit():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(256, hard), hard))
        now = http_front.raise_open_file_limit()
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == now
        assert now == (hard if hard != resource.RLIM_INFINITY else 1 << 20)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
