"""A cap on request body size, checked before the app reads the body whole, and a deadline for
each piece of it.

kvd parses a completion's body on its event loop: a 40 MB list of token ids takes about a
second there, during which no stream moves. `BodyLimit` answers 413 in OpenAI's error shape
as soon as a request says (Content-Length) or shows (the chunks so far) that its body is over
`max_request_bytes` (an upload to /v1/files: over `max_file_bytes`), without reading the rest.
A body that stops coming (a client that sends headers promising a body, then a byte now and
then) is answered 408 once no piece of it has come for `BODY_PIECE_TIMEOUT_S`, as http_front
does for headers.
"""

from __future__ import annotations

import asyncio
import json
from typing import Callable

from kvctl.daemon.config import MAX_FILE_BYTES

from . import cut_connections
from .whole_numbers import whole_number

BODY_PIECE_TIMEOUT_S = 30.0  # nginx's client_body_timeout is 60 s
UPLOAD_PATH = "/v1/files"  # a POST here is a file, capped by max_file_bytes


class BodyLimit:
    """ASGI middleware: 413 for a body over `limit()` bytes (an upload, POST /v1/files: over
    `file_limit()`), read per request (so a reload applies at once); 408 for one whose next piece
    does not come within `piece_timeout` s."""

    def __init__(self, app, limit: Callable[[], int], piece_timeout: float = BODY_PIECE_TIMEOUT_S,
                 file_limit: Callable[[], int] = lambda: MAX_FILE_BYTES) -> None:
        self.app, self.limit, self.piece_timeout, self.file_limit = app, limit, piece_timeout, file_limit

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        upload = scope.get("method") == "POST" and scope.get("path") == UPLOAD_PATH
        limit, setting = (self.file_limit(), "max_file_bytes") if upload else (self.limit(), "max_request_bytes")
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        size = whole_number(declared)
        if declared is not None and declared.strip().isdigit() and (size is None or size > limit):
            await self._refuse(send, f"{size:,} bytes" if size is not None else f"a {len(declared):,}-digit length",
                               limit, setting)
            return
        received, started, refused, whole = 0, False, False, False

        async def counted_receive():
            nonlocal received, refused, whole
            if refused:
                return {"type": "http.disconnect"}
            if whole:  # past the body, receive waits for the client to leave: for as long as it stays
                return await receive()
            try:
                async with asyncio.timeout(self.piece_timeout):  # not wait_for: test_import_rules says why
                    message = await receive()
            except TimeoutError:
                refused = True
                cut_connections.cut["body_timeout"] += 1
                if not started:
                    await self._answer(send, 408, f"body: no more of it came within {self.piece_timeout:g} s "
                                                  f"({received:,} bytes came)", "request_timeout")
                return {"type": "http.disconnect"}
            if message["type"] == "http.request":
                whole = not message.get("more_body", False)
                received += len(message.get("body", b""))
                if received > limit and not started:
                    # answer now and tell the app the client left: it stops reading, and what it
                    # would answer is dropped
                    refused = True
                    await self._refuse(send, f"{received:,} bytes so far", limit, setting)
                    return {"type": "http.disconnect"}
            return message

        async def tracked_send(message):
            nonlocal started
            if refused:
                return
            started = started or message["type"] == "http.response.start"
            await send(message)

        await self.app(scope, counted_receive, tracked_send)

    @classmethod
    async def _refuse(cls, send, size: str, limit: int, setting: str) -> None:
        advice = "upload a smaller file (a batch's input in parts)" if setting == "max_file_bytes" else \
            "send less per request"
        await cls._answer(send, 413, f"body: {size} is over {setting} ({limit:,}); {advice}", "request_too_large")

    @staticmethod
    async def _answer(send, status: int, message: str, code: str) -> None:
        body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                     "code": code}}).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})
