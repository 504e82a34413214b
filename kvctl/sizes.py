"""Sizes an operator types to kvctl (200MiB, 2GiB, 4096), read as kvd reads its own settings."""

from __future__ import annotations

from .errors import UserError


def positive_size(field: str, text: str, examples: str) -> int:
    """Bytes from `text`; a UserError naming the field, the examples and the value unless > 0."""
    from kvctl.daemon.server.byte_sizes import size_in_bytes

    try:
        value = size_in_bytes(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise UserError(f"{field}: must be a size > 0 ({examples}), got {text!r}")
    return value
