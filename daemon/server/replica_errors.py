"""How a call from the router to a replica failed, in one line an operator can act on."""

from __future__ import annotations

from typing import Any

import httpx

LIMIT = 300  # characters: a status table's cell, a log line


class NotKvd(ValueError):
    """A replica's answer that is not kvd's JSON: another server listens at its address."""


def kvd_json(response: httpx.Response) -> Any:
    """The answer's JSON; NotKvd, saying what came instead, when it is none."""
    try:
        return response.json()
    except ValueError:
        raise NotKvd(f"{response.status_code}: {_not_json(response)}") from None


def _not_json(response: httpx.Response) -> str:
    first, kind = first_line(response), content_kind(response)
    return f"{first!r} ({kind}), not kvd's JSON: is kvd what listens there?" if first else \
        f"an empty {kind} answer, not kvd's JSON: is kvd what listens there?"


def first_line(response: httpx.Response) -> str:
    """The answer's first line that holds anything, cut at LIMIT: an error page's title line."""
    return next((line.strip() for line in response.text.splitlines() if line.strip()), "")[:LIMIT]


def content_kind(response: httpx.Response) -> str:
    """The answer's media type ("text/html"), without its parameters."""
    return response.headers.get("content-type", "no content type").split(";")[0].strip()


def described(exc: BaseException) -> str:
    """For an error answer (httpx's HTTPStatusError from `raise_for_status`): its status and the
    replica's own message (kvd answers `{"error": {"message"}}`), e.g. "503: ValueError: cache_dtype:
    fp8_e4m3 has no applied calibration ...", not httpx's sentence with the URL and a link to MDN.
    Otherwise the exception's type and text ("ConnectError: ...")."""
    if isinstance(exc, httpx.HTTPStatusError):
        return answer_described(exc.response)
    if isinstance(exc, NotKvd):
        return str(exc)[:LIMIT]
    return f"{type(exc).__name__}: {exc}"[:LIMIT]


def answer_described(response: httpx.Response) -> str:
    """An error answer's status and the replica's own message: "503: the model is still loading"."""
    try:
        message = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError, httpx.ResponseNotRead):
        try:
            message = first_line(response)
        except httpx.ResponseNotRead:  # a streamed answer: its body was not read
            message = ""
        kind = content_kind(response)
        if message and kind not in ("text/plain", "application/json"):  # a page: another server answered
            message = f"{message} ({kind}, not kvd's JSON)"
    return f"{response.status_code}: {message or response.reason_phrase}"[:LIMIT]
