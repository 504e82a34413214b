"""A whole number a caller wrote as text (a header, a query string, a form field).

`str.isdigit` is true of digits int() does not read ("²", "①"), and int() refuses a number of
more than 4,300 digits (Python's guard against slow conversions): either raised a ValueError, a
500, where the text should have been refused as any other bad value is. `whole_number` reads ASCII
digits only, and no more of them than a count of bytes or seconds could need.
"""

from __future__ import annotations

MOST_DIGITS = 18  # up to 10**18 - 1: beyond any count of bytes, tokens or seconds kvd takes


def whole_number(text: str | bytes | None) -> int | None:
    """The whole number `text` writes in ASCII digits (surrounding spaces allowed), else None."""
    if text is None:
        return None
    digits = text.strip()
    if not digits or len(digits) > MOST_DIGITS or not digits.isascii() or not digits.isdigit():
        return None
    return int(digits)
