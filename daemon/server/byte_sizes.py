"""Byte counts as operators read them, in binary units: 512 B, 1.4 MiB (kvd's log lines, kvctl's tables),
and as they write them in settings and flags: 4096, 512MiB, 2GiB."""

import math


def format_bytes(value: float | None) -> str:
    """Bytes in binary units: 512 B, 1.4 MiB; '-' when unknown."""
    if value is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:,.0f} {unit}" if unit == "B" else f"{value:,.1f} {unit}"
        value /= 1024
    return str(value)


SIZE_EXPECTED = "must be a size in bytes: a number with an optional unit (4096, 512MiB, 2GiB, 500MB)"


def size_in_bytes(text: str) -> int:
    """Bytes from '123', '64MiB', '2GiB', '500MB'."""
    units = {"k": 10**3, "m": 10**6, "g": 10**9, "kb": 10**3, "mb": 10**6, "gb": 10**9,
             "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "b": 1, "": 1}
    value = str(text).strip().lower().replace("_", "")
    number = value.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = value[len(number):].strip()
    try:
        amount = float(number) * units[unit]
    except (KeyError, ValueError):
        amount = math.nan
    if isinstance(text, bool) or not math.isfinite(amount):  # also '1e999', 'inf', 'nan': no size
        raise ValueError(SIZE_EXPECTED)
    return int(amount)
