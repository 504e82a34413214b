"""Whether kvd's engine thread still comes round its loop: what /healthz answers.

The engine thread comes round its loop every half second when idle and once a step when busy. One
that stops coming round (a kernel that never returns, a deadlock, a step stuck on a lock) serves
nothing while kvd's event loop answers on, and /healthz said ok. systemd's watchdog, pinged from
that loop (WatchdogSec=60 in examples/kvd.service), restarts such a kvd; a Kubernetes liveness
probe reads /healthz. So once the loop has not come round in `after` seconds (60, as the watchdog),
/healthz and /readyz answer 503 saying so, and the log says it once (and again once it comes round).
No step of a serving engine should take that long: a prompt is computed in chunks of
max_batch_tokens.

Only a new process recovers from a step that never ends. Where nothing restarts kvd on /healthz (a
container without a liveness probe, kvd run by hand), it ended only when someone noticed; so once
the engine has been stalled engine_stall_exit_seconds (300 s by default: well after systemd's
watchdog and a liveness probe would have acted; 0: never), kvd records why in its audit log and
exits with STALLED_EXIT at once (its requests in flight are lost with it: a stop would wait for
the lock the stalled step holds), for its service manager or restart policy to start it again. A
stop asked of it meanwhile (SIGTERM) ends it the same way at once, where it waited for that lock.
vLLM's engine gives up on a step after VLLM_ENGINE_ITERATION_TIMEOUT_S the same way.

Where it is stuck is the first thing to know of a step that never ends: once the stall is seen, the
log says what the step computes (its requests, their tenants and tokens: Engine.stepping) and where
the engine thread stands (its stack: file, line and function; `stack_of`), and the exit's audit
record keeps both, as vLLM logs the batch of a step that failed.

`/metrics` reads the engine's figures under the engine's lock, which a step holds: a scrape waits
for it up to SCRAPE_LOCK_WAIT_S (within Prometheus' default scrape_timeout of 10 s), not at all
once the engine is stalled, and answers without those figures when it is not had, with
`kvd_engine_stalled` saying why (the KvdEngineStalled alert), where the scrape failed before and
only KvdDown fired. The operator's views (`kvctl status`, `requests`, `tenants`, `prefixes`) wait
for the lock as long as it takes, but no longer once the engine is stalled: then they answer 503
saying so (`held_unless_stalled`), where they waited out kvctl's 120 s timeout. So do the operator's
changes (pin, unpin, evict, cancel, a drain, a reload, a LoRA adapter's load, new weights,
sleep, wake, a rollout's completion, a calibration): refused before they change anything, where
each held an admin slot until kvctl gave up, and each refusal written to the audit log (result
refused: what operators tried during the incident; service.change_lock).

A completion sent while the engine is stalled is refused at once (503, code engine_stalled, with
Retry-After: a router sends it to another replica), and one handed in just before the stall is
refused once the stall is seen (housekeeping looks every 5 s), where each waited until its client
gave up or kvd exited. What the stalled step runs is left to it: it may yet end.
"""

from __future__ import annotations

import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from dataclasses import dataclass
from typing import Callable

from .calls import ServiceError

STALLED_AFTER_S = 60.0
STALLED_EXIT = 75  # as a lost device's (device_loss.DEVICE_LOST_EXIT): EX_TEMPFAIL, started again it may well serve
SCRAPE_LOCK_WAIT_S = 5.0
STALL_LOOK_S = 1.0  # a wait for the engine's lock looks this often whether the engine has stalled
STALLED_RETRY_AFTER_S = 5  # the Retry-After of what is refused for a stall (as a draining kvd's)

# what a refusal for a stall says of what was asked (stalled_refusal)
ASK_AGAIN = "ask again once /healthz says ok"
QUESTION_WAITS = "this question waits for it: " + ASK_AGAIN
NOTHING_CHANGED = "nothing was changed: " + ASK_AGAIN
NOT_STARTED = "this completion was not started: send it again (to another replica, or here once /healthz says ok)"


@dataclass
class EngineLoop:
    after: float = STALLED_AFTER_S
    turned_at: float | None = None  # time.monotonic() of its latest round; None: not going round (loading, stopped)
    said: bool = False  # the log has said it stalled, and not yet that it came round again

    def turned(self, now: float | None = None) -> None:
        self.turned_at = time.monotonic() if now is None else now

    def stopped(self) -> None:
        """The loop has ended (kvd stops, or its device was lost): not going round is no stall."""
        self.turned_at = None

    def idle_seconds(self, now: float | None = None) -> float | None:
        """Seconds since the loop last came round; None while it is not going round."""
        if self.turned_at is None:
            return None
        return (time.monotonic() if now is None else now) - self.turned_at

    def stalled(self, now: float | None = None) -> str | None:
        """Why kvd is not alive now (None: it is): its engine has not come round in `after` s."""
        idle = self.idle_seconds(now)
        if idle is None or idle < self.after:
            return None
        return (f"the engine has not come round its loop in {idle:.0f} s (a step that does not end: a kernel that "
                "never returns, a deadlock): kvd serves nothing meanwhile")

    def to_log(self, now: float | None = None) -> tuple[str, str] | None:
        """(level, message) for the log when the stall begins or ends, once each; None otherwise."""
        why = self.stalled(now)
        if why is not None and not self.said:
            self.said = True
            return "error", why
        if why is None and self.said:
            self.said = False
            return "info", "the engine comes round its loop again"
        return None


def stack_of(thread: threading.Thread | None) -> list[str]:
    """Where `thread` stands now, outermost frame first, a frame a line ("daemon/engine/engine.py:832
    in _step": a file's last three path parts, its line, its function), nothing of a frame's values
    (no prompt reaches the log). [] for a thread not running."""
    frame = sys._current_frames().get(thread.ident) if thread is not None and thread.ident is not None else None
    frames = []
    while frame is not None:
        code = frame.f_code
        frames.append(f"{'/'.join(Path(code.co_filename).parts[-3:])}:{frame.f_lineno} in {code.co_name}")
        frame = frame.f_back
    return frames[::-1]


def take_unless_stalled(lock: threading.Condition, loop: EngineLoop, wait: float | None = None,
                        look: float = STALL_LOOK_S) -> bool:
    """Take the engine's `lock`, waiting up to `wait` s (None: as long as it takes), but not once
    `loop` is stalled (looked at every `look` s: the step that holds it does not end); whether it
    was taken."""
    deadline = None if wait is None else time.monotonic() + wait
    while loop.stalled() is None:
        left = look if deadline is None else min(look, deadline - time.monotonic())
        if left <= 0:
            return lock.acquire(blocking=False)
        if lock.acquire(timeout=left):
            return True
    return lock.acquire(blocking=False)


_scrape = threading.local()  # the deadline of the scrape this thread runs (one_scrape)


@contextmanager
def one_scrape():
    """The collectors run inside (one scrape, on this thread) share one wait for the engine's lock,
    SCRAPE_LOCK_WAIT_S in all: each one's own would add up past Prometheus' scrape timeout."""
    _scrape.deadline = time.monotonic() + SCRAPE_LOCK_WAIT_S
    try:
        yield
    finally:
        _scrape.deadline = None


@contextmanager
def held_for(lock: threading.Condition, loop: EngineLoop, wait: float):
    """Hold the engine's `lock`: yields True once had, waiting up to `wait` s unless the engine is
    stalled (take_unless_stalled); False, holding nothing, when it is not had."""
    had = take_unless_stalled(lock, loop, wait)
    try:
        yield had
    finally:
        if had:
            lock.release()


def held_for_scrape(lock: threading.Condition, loop: EngineLoop):
    """Hold the engine's `lock` for a scrape (held_for), waiting until the scrape's deadline
    (one_scrape; outside one, SCRAPE_LOCK_WAIT_S)."""
    deadline = getattr(_scrape, "deadline", None)
    return held_for(lock, loop, SCRAPE_LOCK_WAIT_S if deadline is None else deadline - time.monotonic())


def stalled_refusal(why: str, outcome: str = QUESTION_WAITS) -> ServiceError:
    """The 503 for what is asked of a stalled engine: `why` (EngineLoop.stalled), then what became
    of the ask (`outcome`: QUESTION_WAITS, NOTHING_CHANGED, NOT_STARTED); code engine_stalled."""
    return ServiceError(503, f"{why}; {outcome}", code="engine_stalled", retry_after=STALLED_RETRY_AFTER_S)


def refuse_if_stalled(loop: EngineLoop, outcome: str = NOTHING_CHANGED,
                      refused: Callable[[ServiceError], None] | None = None) -> None:
    """stalled_refusal while `loop` is stalled, told first to `refused` where one is given;
    nothing otherwise. For a change whose first step is not under the engine's lock (a store
    write), asked before it."""
    why = loop.stalled()
    if why is not None:
        refusal = stalled_refusal(why, outcome)
        if refused is not None:
            refused(refusal)
        raise refusal


@contextmanager
def held_unless_stalled(lock: threading.Condition, loop: EngineLoop, outcome: str = QUESTION_WAITS,
                        refused: Callable[[ServiceError], None] | None = None):
    """Hold the engine's `lock` for an operator's question or change, as `with lock:` does, unless
    the engine is stalled or stalls meanwhile: then stalled_refusal (a 503 ending in `outcome`),
    holding nothing, told first to `refused` where one is given (a change audits it)."""
    if not take_unless_stalled(lock, loop):
        refusal = stalled_refusal(loop.stalled() or "the engine stalled", outcome)
        if refused is not None:
            refused(refusal)
        raise refusal
    try:
        yield
    finally:
        lock.release()
