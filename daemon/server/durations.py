"""Durations as operators write them (90, 90s, 30m, 1h, 2d), and the engine clock's readings as
the Unix times the API hands out."""

import math
import time

UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str | float | int | None) -> float | None:
    """Seconds; None stays None; raises ValueError on anything else."""
    if text is None:
        return None
    if isinstance(text, bool):
        raise ValueError(f"duration must be a number of seconds, got {text!r}")
    if isinstance(text, (int, float)):
        seconds = float(text)
    else:
        value = str(text).strip().lower()
        seconds = float(value[:-1]) * UNITS[value[-1]] if value and value[-1] in UNITS else float(value)
    # 'inf' or '1e308d' is no span: a pin that lived that long could not be listed (its expiry does
    # not render as JSON)
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"duration must be a finite number of seconds > 0, got {text!r}")
    return seconds


def format_duration(seconds: float | None) -> str:
    """A span an operator reads at a glance: 45s, 12m, 3h 5m, 2d 4h; '-' when unknown."""
    if seconds is None:
        return "-"
    seconds = max(int(seconds), 0)
    minutes, hours, days = seconds // 60, seconds // 3600, seconds // 86400
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{minutes}m"
    if seconds < 86400:
        return f"{hours}h {minutes % 60}m" if minutes % 60 else f"{hours}h"
    return f"{days}d {hours % 24}h" if hours % 24 else f"{days}d"


def unix_time(reading: float | None, now: float, wall: float | None = None) -> float | None:
    """A reading of the engine's clock (monotonic, `now` being its current one) as Unix time:
    what the API hands out, so scripts and other hosts can read it. `wall`: the Unix time read
    with `now` (default: read here), for a caller that does other work between reading the
    engine's clock and handing out its times (a store write), which would shift them."""
    return None if reading is None else (time.time() if wall is None else wall) - (now - reading)


def clock_reading(stored, now: float, clock: float) -> float | None:
    """A stored Unix time as a reading of the engine's clock (`clock` read at Unix time `now`):
    `unix_time` the other way; None where it is no finite time."""
    if isinstance(stored, (int, float)) and not isinstance(stored, bool) and math.isfinite(stored):
        return clock - (now - stored)
    return None
