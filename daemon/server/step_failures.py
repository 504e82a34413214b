"""The engine steps that failed: how many, in a row, and the latest's error and when.

A step that raises (a GPU out of memory on a large batch, a bug a request's shape meets) stops
every request in flight (Engine.fail: each client gets a 500 `engine_error`, never an answer cut
short as if it were whole) and kvd serves on. These figures are what the operator sees of it:
`kvctl status`, `kvd_engine_step_failures_total` and the `KvdEngineStepFailing` alert; kvd's log
has each error's traceback. Clients are told only that kvd failed: the error's text is the
operator's. An engine whose last NOT_READY_AFTER steps all failed is not ready (/readyz 503) until
READY_AGAIN_S pass without another failure: a load balancer sends its requests elsewhere meanwhile,
and then tries it again (a step that does not fail ends the run).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

NOT_READY_AFTER = 3  # steps failed in a row, none between that did not
READY_AGAIN_S = 10.0  # seconds after the latest failure that /readyz says ready again
ENGINE_ERROR = "engine_error"  # the code a request a failed step stopped is answered with (its rejected_kind)
# what its client is told (a 500)
STEP_FAILED = ("kvd failed while computing this request (and the others in flight with it): it was stopped; "
               "try again")


@dataclass
class StepFailures:
    total: int = 0
    in_a_row: int = 0  # failed steps since the last step that did not fail
    last_error: str | None = None  # "RuntimeError: CUDA out of memory ..." (cut at 300 characters)
    last_at: float | None = None  # time.time() of the latest
    last_stopped: int = 0  # requests the latest stopped

    def failed(self, exc: BaseException, stopped: int, now: float | None = None) -> None:
        self.total += 1
        self.in_a_row += 1
        self.last_error = f"{type(exc).__name__}: {exc}"[:300]
        self.last_at = time.time() if now is None else now
        self.last_stopped = stopped

    def stepped(self) -> None:
        """A step that did not fail: the run of failures is over."""
        self.in_a_row = 0

    def not_ready(self, now: float) -> str | None:
        """Why /readyz says not ready now (None: it may say ready): the last NOT_READY_AFTER or more
        steps failed, the latest under READY_AGAIN_S ago."""
        if self.in_a_row < NOT_READY_AFTER or self.last_at is None or now - self.last_at >= READY_AGAIN_S:
            return None
        return (f"the engine's last {self.in_a_row:,} steps failed ({self.last_error}); ready again "
                f"{READY_AGAIN_S:.0f} s after the latest, to try")

    def report(self) -> dict:
        return {"total": self.total, "in_a_row": self.in_a_row, "last_error": self.last_error,
                "last_at": self.last_at, "last_stopped": self.last_stopped}
