"""How a call from the router to a replica failed, in one line an operator can act on."""

from __future__ import annotations

import httpx

LIMIT = 300  # characters: a status table's cell, a log line


def described(exc: BaseException) -> str:
    """For an error answer (httpx's HTTPStatusError from `raise_for_status`): its status and the
    replica's own message (kvd answers `{"error": {"message"}}`), e.g. "503: ValueError: cache_dtype:
    fp8_e4m3 has no applied calibration ...", not httpx's sentence with the URL and a link to MDN.
    Otherwise the exception's type and text ("ConnectError: ...")."""
    if isinstance(exc, httpx.HTTPStatusError):
        return answer_described(exc.response)
    return f"{type(exc).__name__}: {exc}"[:LIMIT]


def answer_described(response: httpx.Response) -> str:
    """An error answer's status and the replica's own message: "503: the model is still loading"."""
    try:
        message = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError, httpx.ResponseNotRead):
        try:
            message = response.text.strip()
        except httpx.ResponseNotRead:  # a streamed answer: its body was not read
            message = ""
    return f"{response.status_code}: {message or response.reason_phrase}"[:LIMIT]
