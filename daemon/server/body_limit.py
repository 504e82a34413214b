"""A cap on request body size, checked before the app reads the body whole.

kvd parses a completion's body on its event loop: a 40 MB list of token ids takes about a
second there, during which no stream moves. `BodyLimit` answers 413 in OpenAI's error shape
as soon as a request says (Content-Length) or shows (the chunks so far) that its body is over
`max_request_bytes`, without reading the rest.
"""

from __future__ import annotations

import json
from typing import Callable


class BodyLimit:
    """ASGI middleware: 413 for a body over `limit()` bytes, read per request (so a reload
    applies at once)."""

    def __init__(self, app, limit: Callable[[], int]) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.limit()
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await self._refuse(send, f"{int(declared):,} bytes", limit)
            return
        received, started, refused = 0, False, False

        async def counted_receive():
            nonlocal received, refused
            if refused:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit and not started:
                    # answer now and tell the app the client left: it stops reading, and what it
                    # would answer is dropped
                    refused = True
                    await self._refuse(send, f"{received:,} bytes so far", limit)
                    return {"type": "http.disconnect"}
            return message

        async def tracked_send(message):
            nonlocal started
            if refused:
                return
            started = started or message["type"] == "http.response.start"
            await send(message)

        await self.app(scope, counted_receive, tracked_send)

    @staticmethod
    async def _refuse(send, size: str, limit: int) -> None:
        message = f"body: {size} is over max_request_bytes ({limit:,}); send less per request"
        body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                     "code": "request_too_large"}}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})
