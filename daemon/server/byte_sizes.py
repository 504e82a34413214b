"""Byte counts as operators read them, in binary units: 512 B, 1.4 MiB (kvd's log lines, kvctl's tables)."""


def format_bytes(value: float | None) -> str:
    """Bytes in binary units: 512 B, 1.4 MiB; '-' when unknown."""
    if value is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:,.0f} {unit}" if unit == "B" else f"{value:,.1f} {unit}"
        value /= 1024
    return str(value)
