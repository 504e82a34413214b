"""A log line that recurs with every request while something is down, logged at most once every
few seconds, saying how many like it it stands for: a prefill replica gone for a minute would
otherwise write a WARNING for each request meanwhile."""

from __future__ import annotations

import logging
import time
from typing import Callable


class EveryFewSeconds:
    """Logs through `logger` at most once every `seconds` (on `clock`); each line logged after
    others were held back says how many."""

    def __init__(self, logger: logging.Logger, seconds: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.logger, self.seconds, self.clock = logger, seconds, clock
        self.logged_at: float | None = None
        self.held = 0  # lines held back since the last one logged

    def warning(self, message: str, *args) -> None:
        now = self.clock()
        if self.logged_at is not None and now - self.logged_at < self.seconds:
            self.held += 1
            return
        if self.held:
            message += f" (and {self.held:,} more like it in the last {now - self.logged_at:.0f} s)"
        self.logger.warning(message, *args)
        self.logged_at, self.held = now, 0
