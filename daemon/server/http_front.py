"""How kvd's and kvd router's HTTP fronts run under uvicorn: one Config shape for every front,
with deadlines for a request's headers and for a client that reads nothing of its answer, and the
open-file limit raised to what the system allows.

uvicorn times out a keep-alive connection between requests, but not one that has not finished
sending a request's headers: a client that opens connections and sends nothing, or a byte at a
time, holds each for as long as it likes. Before a token is ever checked, a few hundred such
connections on the TCP front took every file descriptor under systemd's default limit of 1,024,
and with them the SQLite store's, the disk tier's and every new client's.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import resource
import socket
import ssl
from typing import Any

import uvicorn

from . import cut_connections

log = logging.getLogger("kvd")

HEADER_TIMEOUT_S = 10.0  # from a connection's start, or its previous response, to a request's full headers
STALL_TIMEOUT_S = 60.0  # how long an answer may wait on a client that reads none of it
STALL_MIN_BYTES = 1024  # what a client must read of a full send buffer within STALL_TIMEOUT_S to be kept


def _timed_out(seconds: float) -> bytes:
    body = f"request headers did not arrive within {seconds:g} s\n".encode()
    return (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\nconnection: close\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(body), body))


def _base_protocol() -> type:
    """uvicorn's own choice for http="auto": httptools when installed, else h11."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
        return HttpToolsProtocol
    except ImportError:
        from uvicorn.protocols.http.h11_impl import H11Protocol
        return H11Protocol


def with_deadlines(base: type, seconds: float = HEADER_TIMEOUT_S, stall_seconds: float = STALL_TIMEOUT_S) -> type:
    """`base` (one of uvicorn's HTTP protocols), closing a connection whose request headers are not
    all in `seconds` after it opened or after its previous response (a 408, then the close), and
    dropping one whose client has read less than STALL_MIN_BYTES of its answer in `stall_seconds`
    (the answer waiting in a full send buffer: the handler sees the client leave, and its request
    stops). A request being answered to a client that reads (a stream of any length, over a slow
    link) is never cut."""

    timed_out = _timed_out(seconds)

    class Deadlines(base):
        _header_timer: asyncio.TimerHandle | None = None
        _stall_timer: asyncio.TimerHandle | None = None
        _buffered = 0  # bytes in the send buffer when the stall deadline was last set

        def pause_writing(self) -> None:  # the send buffer is full: the client is not reading, or slowly
            super().pause_writing()
            if self._stall_timer is None:
                self._arm_stall_deadline()

        def _arm_stall_deadline(self) -> None:
            self._buffered = self.transport.get_write_buffer_size()
            self._stall_timer = self.loop.call_later(stall_seconds, self._stalled)

        def resume_writing(self) -> None:
            super().resume_writing()
            if self._stall_timer is not None:
                self._stall_timer.cancel()
                self._stall_timer = None

        def _stalled(self) -> None:
            self._stall_timer = None
            # NOTE: a slow reader drains a full buffer below its low-water mark only after several
            # deadlines (48 KiB at 800 B/s is 60 s); what it read meanwhile keeps it
            if self._buffered - self.transport.get_write_buffer_size() >= STALL_MIN_BYTES:
                self._arm_stall_deadline()
                return
            log.debug("dropped a connection from %s: it read less than %d bytes of its answer in %.0f s",
                      self.client, STALL_MIN_BYTES, stall_seconds)
            cut_connections.cut["stalled"] += 1
            self.transport.abort()  # close() would wait to send what the client does not read

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm_header_deadline()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm_header_deadline()

        def connection_lost(self, exc) -> None:
            for timer in (self._header_timer, self._stall_timer):
                if timer is not None:
                    timer.cancel()
            self._header_timer = self._stall_timer = None
            super().connection_lost(exc)

        def _arm_header_deadline(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
            self._header_timer = self.loop.call_later(seconds, self._header_deadline_passed)

        def _header_deadline_passed(self) -> None:
            self._header_timer = None
            answering = self.cycle is not None and not self.cycle.response_complete
            if answering or self.transport.is_closing():
                return  # the next response arms it again
            log.debug("closed a connection from %s: no request headers in %.0f s", self.client, seconds)
            cut_connections.cut["header_timeout"] += 1
            self.transport.write(timed_out)
            self.transport.close()

    Deadlines.__name__ = Deadlines.__qualname__ = f"Deadlines{base.__name__}"
    return Deadlines


def front_config(app: Any, ssl_context: ssl.SSLContext | None = None, **options: Any) -> uvicorn.Config:
    """The uvicorn Config of one front (a Unix socket, or host and port in `options`), serving TLS
    with `ssl_context` where given: kvd's own (tls.py), whose certificate a reload rotates, where
    uvicorn would build one of its own from file names once."""
    config = uvicorn.Config(app, http=with_deadlines(_base_protocol()), log_level="warning", lifespan="off",
                            **options)
    if ssl_context is not None:
        config.load()
        config.ssl = ssl_context
    return config


def bind_tcp(listen: str) -> socket.socket:
    """The listening socket for `listen` (HOST:PORT, or [IPv6]:PORT), bound here rather than by
    uvicorn: uvicorn answers a port in use with sys.exit inside the event loop, after kvd had said it
    was listening and while its engine thread ran (the process aborted). Raises RuntimeError naming
    `listen`, before anything has started."""
    host, _, port = listen.rpartition(":")
    host = host.strip("[]")
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, int(port)))
        sock.listen(2048)
    except OSError as exc:  # a host name that does not resolve (gaierror) among them
        sock.close()
        why = {errno.EADDRINUSE: "another process listens there",
               errno.EADDRNOTAVAIL: "no interface of this machine has that address",
               errno.EACCES: "a port under 1024 needs privilege (CAP_NET_BIND_SERVICE)"}.get(exc.errno)
        raise RuntimeError(f"listen: {listen!r} cannot be bound: {exc.strerror or exc}"
                           + (f" ({why})" if why else "")) from None
    sock.set_inheritable(True)
    return sock


def raise_open_file_limit() -> int:
    """Raise this process's soft limit on open files to its hard limit (systemd gives 1,024 and
    524,288): every client connection, Redis connection, disk-tier segment and the store take one.
    Returns the limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
            soft = wanted
        except (ValueError, OSError) as exc:  # a container that forbids it: keep what there is
            log.warning("open-file limit stays at %d (%s)", soft, exc)
    return soft


class _FrontServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):  # kvd and kvd router handle signals themselves
        yield


class Fronts:
    """The uvicorn servers of one process (kvd's or kvd router's): started, told to stop and awaited
    together, with any that joins while they run (a Unix socket bound again: unix_front.keep)."""

    def __init__(self) -> None:
        self.servers: list[uvicorn.Server] = []
        self.tasks: list[asyncio.Task] = []
        self.stopping = False

    def serve(self, app: Any, sockets: list | None = None, ssl_context: ssl.SSLContext | None = None,
              **options: Any) -> None:
        """Serve `app` on `sockets`, or on host and port in `options` (with TLS: `ssl_context`); none
        joins once stopping."""
        if self.stopping:
            return
        server = _FrontServer(front_config(app, ssl_context, **options))
        self.servers.append(server)
        self.tasks.append(asyncio.create_task(server.serve(sockets=sockets)))

    def stop(self) -> None:
        self.stopping = True
        for server in self.servers:
            server.should_exit = True

    async def wait(self) -> list:
        """How each server ended (None, or what it raised), once every one has."""
        results: list = []
        while len(results) < len(self.tasks):
            results += await asyncio.gather(*self.tasks[len(results):], return_exceptions=True)
        return results
