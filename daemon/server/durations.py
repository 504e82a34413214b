"""Durations as operators write them: 90, 90s, 30m, 1h, 2d."""

UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str | float | int | None) -> float | None:
    """Seconds; None stays None; raises ValueError on anything else."""
    if text is None:
        return None
    if isinstance(text, (int, float)):
        return float(text)
    value = str(text).strip().lower()
    seconds = float(value[:-1]) * UNITS[value[-1]] if value and value[-1] in UNITS else float(value)
    if seconds <= 0:
        raise ValueError(f"duration must be > 0, got {text!r}")
    return seconds
