"""gone_book.py: why a kept response or conversation went, told to its own tenant only, for the
last GONE_KEPT ids."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")

from kvctl.daemon.server.gone_book import GoneBook  # noqa: E402


def test_the_book_tells_its_tenant_why_and_when_and_forgets_the_oldest_first():
    now = [86400.0 * 365]
    book = GoneBook(kept=2, clock=lambda: now[0])
    book.note("acme", "conv_1", "kvd let it go for room")
    now[0] += 61
    book.note("acme", "conv_2", "an operator purged it")
    assert book.why("acme", "conv_1") == "kvd let it go for room, 1971-01-01 00:00:00 UTC"
    assert book.why("acme", "conv_2") == "an operator purged it, 1971-01-01 00:01:01 UTC"
    assert book.why("globex", "conv_1") is None  # another tenant learns nothing of it
    book.note("globex", "conv_3", "older than responses_max_age")
    assert book.why("acme", "conv_1") is None and book.why("globex", "conv_3") is not None  # (two kept at most)
