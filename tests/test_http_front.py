"""kvd's HTTP fronts close a connection whose request headers do not arrive in time (slowloris),
and never one whose request is being answered."""

from __future__ import annotations

import asyncio
import contextlib
import json
import resource
import socket
import time

import pytest

uvicorn = pytest.importorskip("uvicorn")

from kvctl.daemon.server import cut_connections, http_front  # noqa: E402

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


def answer_in_pieces(pieces: int, chunk: bytes, finished: list | None = None):
    """An ASGI app that answers every request with `pieces` times `chunk` (noting in `finished`
    when it sent the last)."""
    async def answer(scope, receive, send):
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", str(pieces * len(chunk)).encode())]})
        for _ in range(pieces):
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b""})
        if finished is not None:
            finished.append(time.monotonic())
    return answer


async def read_answer(path: str, each: int, pause: float, *, wait_first: float = 0.0,
                      stop_after: int | None = None, began: list | None = None) -> int:
    """Bytes of an answer to GET / that a client on the Unix socket `path` gets, reading `each`
    bytes every `pause` s after `wait_first` s (noted in `began`); with `stop_after`, it reads no
    more once it has that many, and what else came is counted 1.5 s later. A bare socket: nothing
    reads it behind the test's back."""
    loop = asyncio.get_running_loop()
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    client.setblocking(False)
    await loop.sock_connect(client, path)
    await loop.sock_sendall(client, b"GET / HTTP/1.1\r\nhost: kvd\r\nconnection: close\r\n\r\n")
    await asyncio.sleep(wait_first)
    if began is not None:
        began.append(time.monotonic())
    got = 0
    while stop_after is None or got < stop_after:
        try:
            data = await loop.sock_recv(client, each)
        except ConnectionResetError:
            break
        if not data:
            break
        got += len(data)
        await asyncio.sleep(pause)
    if stop_after is not None:  # then it reads nothing more: the front cuts it
        await asyncio.sleep(1.5)
        with contextlib.suppress(ConnectionResetError, BlockingIOError):
            while data := client.recv(1 << 20):
                got += len(data)
    client.close()
    return got


def bases() -> list:
    from uvicorn.protocols.http.h11_impl import H11Protocol

    found = [H11Protocol]
    with contextlib.suppress(ImportError):
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
        found.append(HttpToolsProtocol)
    return found


async def read_all(reader, limit: float = 5.0, since: float | None = None) -> tuple[bytes, float]:
    """Everything the server sends until it closes, and how long that took: from `since` (a
    time.monotonic() reading) where given, else from now."""
    start = time.monotonic() if since is None else since
    data = await asyncio.wait_for(reader.read(), limit)
    return data, time.monotonic() - start


@pytest.mark.parametrize("base", bases(), ids=lambda b: b.__name__)
def test_a_connection_without_request_headers_in_time_gets_408_and_is_closed(tmp_path, base):
    path = str(tmp_path / "front.sock")

    async def scenario():
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(path)
        config = uvicorn.Config(app, http=http_front.with_deadlines(base, DEADLINE), log_level="warning",
                                lifespan="off")
        server = uvicorn.Server(config)
        serving = asyncio.create_task(server.serve(sockets=[listener]))
        while not server.started:
            await asyncio.sleep(0.01)
        outcomes = {}
        # each timed from before its connection opens: the server's deadline starts once it is open,
        # and on a busy host the next connections may take a while to open before the reads begin
        opened = {"silent": time.monotonic()}
        silent = await asyncio.open_unix_connection(path)  # connects, sends nothing
        opened["partial"] = time.monotonic()
        partial = await asyncio.open_unix_connection(path)  # a header at a time, never the end
        partial[1].write(b"GET /fast HTTP/1.1\r\nhost: kvd\r\n")
        slow = await asyncio.open_unix_connection(path)  # a response longer than the deadline
        slow[1].write(b"GET /slow HTTP/1.1\r\nhost: kvd\r\nconnection: close\r\n\r\n")
        outcomes["silent"], outcomes["partial"], outcomes["slow"] = await asyncio.gather(
            read_all(silent[0], since=opened["silent"]), read_all(partial[0], since=opened["partial"]),
            read_all(slow[0]))
        # keep-alive: a second request begun after the first's answer, and never finished
        opened["second"] = time.monotonic()  # (its deadline starts later still: once the first is answered)
        reader, writer = await asyncio.open_unix_connection(path)
        writer.write(b"GET /fast HTTP/1.1\r\nhost: kvd\r\n\r\n")
        first = await reader.readuntil(b"done\n\r\n0\r\n\r\n")  # the whole chunked answer
        writer.write(b"GET /fast HTTP/1.1\r\n")
        outcomes["second"] = await read_all(reader, since=opened["second"])
        server.should_exit = True
        await serving
        return outcomes, first

    before = dict(cut_connections.cut)
    outcomes, first = asyncio.run(scenario())
    assert cut_connections.cut["header_timeout"] - before.get("header_timeout", 0) == 3  # for /metrics
    for name in ("silent", "partial", "second"):
        data, took = outcomes[name]
        assert data.startswith(b"HTTP/1.1 408 Request Timeout\r\n"), name
        assert data.endswith(b"\r\n\r\nrequest headers did not arrive within 0.4 s\n"), name
        assert took >= DEADLINE * 0.9, (name, took)  # not before the deadline; read_all's 5 s bound: closed
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


def run_body_limit(pieces: list[tuple[float, bytes, bool]], wait_after: float = 0.0) -> list[dict]:
    """Drive BodyLimit (piece timeout 0.2 s) around an app that reads the whole body, then waits on
    receive `wait_after` s (as a handler watching for the client to leave does), then answers 200.
    `pieces`: (delay before it, bytes, more to come); past them the client sends nothing more."""
    from kvctl.daemon.server.body_limit import BodyLimit

    sent: list[dict] = []

    async def reader_app(scope, receive, send):
        body = b""
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(receive(), wait_after)  # nothing comes: the client stays
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"%d bytes" % len(body)})

    async def scenario():
        queue = list(pieces)

        async def receive():
            if not queue:
                await asyncio.Event().wait()  # a client that sends no more, and stays
            delay, body, more = queue.pop(0)
            await asyncio.sleep(delay)
            return {"type": "http.request", "body": body, "more_body": more}

        async def send(message):
            sent.append(message)

        limited = BodyLimit(reader_app, limit=lambda: 1 << 20, piece_timeout=0.2)
        await limited({"type": "http", "headers": []}, receive, send)

    asyncio.run(asyncio.wait_for(scenario(), 10))
    return sent


def test_a_body_that_stops_coming_is_answered_408_and_one_that_keeps_coming_is_read_whole():
    before = cut_connections.cut["body_timeout"]
    stalled = run_body_limit([(0.0, b"x" * 100, True)])
    assert cut_connections.cut["body_timeout"] - before == 1
    assert stalled[0]["status"] == 408 and (b"connection", b"close") in stalled[0]["headers"]
    assert json.loads(stalled[1]["body"])["error"] == {
        "message": "body: no more of it came within 0.2 s (100 bytes came)", "type": "invalid_request_error",
        "param": None, "code": "request_timeout"}
    steady = run_body_limit([(0.1, b"x" * 10, True)] * 5 + [(0.1, b"y", False)], wait_after=0.5)
    assert [m.get("status") for m in steady] == [200, None] and steady[1]["body"] == b"51 bytes"


def test_a_request_cancelled_as_its_body_arrives_ends_cancelled_and_is_not_served():
    """A request's task cancelled in the same turn as a piece of its body arrives must end there:
    CPython 3.11's asyncio.wait_for, which the body's piece timeout used, returns the piece and
    swallows the cancellation (gh-86296), and the app served the request on."""
    from kvctl.daemon.server.body_limit import BodyLimit

    served, sent = [], []

    async def app(scope, receive, send):
        served.append(await receive())

    async def scenario():
        piece = asyncio.Event()

        async def receive():
            await piece.wait()
            return {"type": "http.request", "body": b"x", "more_body": False}

        async def send(message):
            sent.append(message)

        limited = BodyLimit(app, limit=lambda: 1 << 20, piece_timeout=30)
        task = asyncio.create_task(limited({"type": "http", "headers": []}, receive, send))
        await asyncio.sleep(0.05)
        piece.set()
        task.cancel()
        await asyncio.wait([task], timeout=5)
        return task

    task = asyncio.run(scenario())
    assert task.cancelled() and served == [] and sent == []


@pytest.mark.parametrize("base", bases(), ids=lambda b: b.__name__)
def test_a_client_that_reads_nothing_of_its_answer_is_dropped_and_a_slow_reader_is_not(tmp_path, base):
    path = str(tmp_path / "front.sock")
    chunk = b"x" * 65536
    finished, reading = [], []  # when each handler finished, and when each client began to read

    big = answer_in_pieces(40, chunk, finished)  # 2.5 MiB: far past the socket's buffers

    async def fetch(pause: float, each: int) -> int:
        """Bytes of the answer a client gets, reading `each` bytes every `pause` s (pause 0: a client
        that reads nothing for 1 s, then all it can)."""
        return await read_answer(path, each, pause, wait_first=1.0 if pause == 0 else 0.0, began=reading)

    async def scenario():
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(path)
        config = uvicorn.Config(big, http=http_front.with_deadlines(base, 5.0, stall_seconds=0.3),
                                log_level="critical", lifespan="off")
        server = uvicorn.Server(config)
        serving = asyncio.create_task(server.serve(sockets=[listener]))
        while not server.started:
            await asyncio.sleep(0.01)
        stalled = await fetch(0, 1 << 22)  # reads nothing for 1 s, then all it can
        steady = await fetch(0.05, 1 << 18)  # 256 KiB every 50 ms, for about half a second
        server.should_exit = True
        await serving
        return stalled, steady

    before = cut_connections.cut["stalled"]
    stalled_bytes, steady_bytes = asyncio.run(scenario())
    assert cut_connections.cut["stalled"] - before == 1
    assert stalled_bytes < 40 * len(chunk)  # cut: only what the buffers held
    assert steady_bytes > 40 * len(chunk)  # headers and every byte of the body
    assert len(finished) == 2 and finished[0] < reading[0]  # dropped before its client read: the handler ran on


@pytest.mark.parametrize("base", bases(), ids=lambda b: b.__name__)
def test_a_client_that_reads_slowly_is_not_cut_and_one_that_stops_reading_is(tmp_path, base):
    """The stall deadline is about a client that reads nothing. A slow one (a bad link) drains
    the full send buffer below its low-water mark only after several deadlines; it used to be
    cut as stalled (below about 800 B/s at kvd's 60 s). Reading at least STALL_MIN_BYTES of it
    within a deadline keeps the connection; one that stops reading is cut a deadline later."""
    path = str(tmp_path / "front.sock")
    chunk = b"x" * 65536

    quarter = answer_in_pieces(4, chunk)  # 256 KiB

    async def scenario():
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(path)

        class SmallKernelBuffer(http_front.with_deadlines(base, 5.0, stall_seconds=0.1)):
            def connection_made(self, transport) -> None:  # the answer waits in the front's buffer, not the kernel's
                transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
                super().connection_made(transport)

        config = uvicorn.Config(quarter, http=SmallKernelBuffer,
                                log_level="critical", lifespan="off")
        server = uvicorn.Server(config)
        serving = asyncio.create_task(server.serve(sockets=[listener]))
        while not server.started:
            await asyncio.sleep(0.01)
        slow = await read_answer(path, 4096, 0.02)  # about 200 KiB/s: two 0.1 s deadlines to drain 48 KiB
        stopped = await read_answer(path, 4096, 0.02, stop_after=64 * 1024)
        server.should_exit = True
        await serving
        return slow, stopped

    before = cut_connections.cut["stalled"]
    slow, stopped = asyncio.run(scenario())
    assert slow > 4 * len(chunk)  # headers and every byte of the body
    assert stopped < 4 * len(chunk)  # cut
    assert cut_connections.cut["stalled"] - before == 1
