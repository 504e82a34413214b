"""Whole numbers callers write as text (daemon/server/whole_numbers.py), and the places that read them."""

from __future__ import annotations

import pytest

from kvctl.daemon.server.whole_numbers import whole_number


@pytest.mark.parametrize("text, number", [
    ("0", 0), ("42", 42), (" 7 ", 7), (b"4096", 4096), ("9" * 18, 10**18 - 1),
    # digits int() does not read, or would read slowly (refused past 4,300 of them), and the rest
    ("\u00b2", None), ("\u0663", None), ("9" * 19, None), ("9" * 5000, None), ("", None), ("-1", None),
    ("+1", None), ("1.0", None), ("1e3", None), ("0x10", None), (None, None), (b"\xb2", None)])
def test_a_whole_number_is_ascii_digits_and_no_more_of_them_than_a_count_needs(text, number):
    assert whole_number(text) == number


def test_a_file_s_expiry_in_digits_int_does_not_read_is_a_400_naming_the_field():
    from kvctl.daemon.server.batch_files import FileError, expiry_seconds

    for seconds in ("\u00b2", "3" * 5000):
        with pytest.raises(FileError) as refused:
            expiry_seconds({"anchor": "created_at", "seconds": seconds})
        assert str(refused.value).startswith("expires_after.seconds: must be a whole number from 3600 to 2,592,000")
    assert expiry_seconds({"anchor": "created_at", "seconds": " 7200"}) == 7200


def test_a_content_length_of_thousands_of_digits_is_refused_as_too_large():
    import asyncio

    from kvctl.daemon.server.body_limit import BodyLimit

    sent = []

    async def app(scope, receive, send):  # (never reached)
        raise AssertionError("the body limit let it through")

    async def send(message):
        sent.append(message)

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    limit = BodyLimit(app, limit=lambda: 4096)
    scope = {"type": "http", "method": "POST", "path": "/v1/completions",
             "headers": [(b"content-length", b"9" * 5000)]}
    asyncio.run(limit(scope, receive, send))
    assert sent[0]["status"] == 413
    body = b"".join(m.get("body", b"") for m in sent[1:])
    assert b"body: a 5,000-digit length is over max_request_bytes (4,096)" in body
