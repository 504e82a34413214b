"""torch.profiler over kvd's engine thread, for an operator asking where a step's time goes
(`kvctl profile`; vLLM's and SGLang's /start_profile and /stop_profile, which benchmark harnesses
such as AIPerf call around a run).

The profiler starts and stops on the engine thread, between steps: the engine loop calls `turn()`
at the top of each round and runs each step inside `step_context()`, so a profile records the
engine's own ops, each step under `kvd.step`. A profile stops when an operator stops it, when kvd
stops, or by itself after its `max_seconds` or `max_steps`, whichever comes first (one an operator
forgot must not grow without end, and under load the trace grows with the steps: a profile of a
busy CPU engine's 7 seconds, thousands of steps, took minutes to summarise and gigabytes of memory).
A stop after the profile stopped by itself answers with that profile, once.
It is written as a gzipped Chrome trace (`.json.gz`: Perfetto and chrome://tracing open it; a
second of a busy CPU engine is about 15 MiB of JSON before gzip) under the state directory's
`profiles/`, whole (beside its name, then renamed), and the newest PROFILES_KEPT are kept. The
answer lists the ops that took the most time: counts and times, never a prompt.
"""

from __future__ import annotations

import contextlib
import gzip
import logging
import os
import shutil
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

from .calls import Principal, ServiceError

log = logging.getLogger("kvd")

PROFILES_KEPT = 10  # the newest profile files kept in the state directory's profiles/
MAX_SECONDS_LIMIT = 600.0  # the longest profile one may ask for
MAX_STEPS_LIMIT = 10_000  # the most steps one may ask for
TOP_OPS = 25  # ops listed in a profile's answer, most self time first
TURN_WAIT_S = 60.0  # how long a start or a stop waits for the engine thread to come round (a long step)
WRITE_WAIT_S = 300.0  # how long a stop waits for its profile to be written
STEP_NAME = "kvd.step"
# torch's profiler is one per process: two engines in one process (tests; never `kvd serve`) take turns
_PROCESS_PROFILE = threading.Lock()


class EngineProfiler:
    """One profile at a time over the engine thread. `start` and `stop` are called from request
    threads and wait for the engine thread's `turn`, which starts and stops the profiler; a
    stopped profile is written on a thread of its own (a big trace takes seconds to write, and
    the engine goes on meanwhile), but at kvd's stop, where the engine thread writes it."""

    def __init__(self, folder: Path, clock=time.monotonic) -> None:
        self.folder = folder
        self.clock = clock
        self._lock = threading.Lock()
        self._turned = threading.Condition(self._lock)
        self._asked: str | None = None  # "start" or "stop", until the engine thread takes it
        self._asked_by = ""
        self._asked_seconds = 0.0
        self._asked_steps = 0
        self._profile = None  # the running torch.profiler.profile
        self.running: dict | None = None  # {"since", "by", "max_seconds", "steps", ...} while one runs
        self.latest: dict | None = None  # the answer of the latest profile written
        self._serial = 0  # of the latest profile stopped (being written, or written)
        self._failed: dict[int, str] = {}  # serial -> why writing it failed
        self._start_error: str | None = None  # why the latest start failed on the engine thread
        self._begun: dict = {}  # the latest start, for its caller (the profile may be over by the time it looks)
        self._writing = False  # a stopped profile is being written (it holds the process's profiler until then)
        self._unclaimed: int | None = None  # serial of a profile that stopped by itself, until a stop answers with it

    # ---- request threads --------------------------------------------------------------------
    def start(self, by: str, max_seconds: float, max_steps: int, wake) -> dict:
        """Ask the engine thread to start a profile and wait until it has; 409 while one runs."""
        with self._lock:
            self._refuse_a_second()
            writing = self._writing
        # held until this profile is written: a start waits for this engine's latest to be written
        if not _PROCESS_PROFILE.acquire(timeout=WRITE_WAIT_S if writing else 0):
            raise ServiceError(409, "profile: another engine in this process is being profiled (torch's profiler "
                                    "is one per process)", "profile")
        with self._lock:
            try:
                self._refuse_a_second()
            except ServiceError:
                _PROCESS_PROFILE.release()
                raise
            self._asked, self._asked_by, self._asked_seconds, self._start_error = "start", by, max_seconds, None
            self._asked_steps = max_steps
        wake()
        try:
            self._wait_for_turn("start")
        except ServiceError:
            _PROCESS_PROFILE.release()
            raise
        with self._lock:
            if self._start_error is not None:
                _PROCESS_PROFILE.release()
                raise ServiceError(500, f"profile: could not start it: {self._start_error}", "profile")
            return dict(self._begun)

    def _refuse_a_second(self) -> None:
        if self.running is not None or self._asked is not None:
            held = self.running or {"by": self._asked_by}
            raise ServiceError(409, f"profile: one is running (started by {held['by']}); `kvctl profile stop` "
                                    "ends it", "profile")

    def stop(self, by: str, wake) -> dict:
        """Ask the engine thread to stop the running profile, and wait until it is written: its
        answer; or, where it stopped by itself since, that one's. 409 when there is neither."""
        with self._lock:
            if self.running is None:
                if self._unclaimed is not None:  # it stopped by itself (max_seconds, max_steps): its answer
                    serial, self._unclaimed = self._unclaimed, None
                    return self._wait_for_written(serial)
                latest = self.latest
                raise ServiceError(409, "profile: none is running; `kvctl profile start` starts one" + (
                    f" (the latest, {latest['seconds']:.1f} s stopped by {latest['stopped_by']}, is {latest['path']})"
                    if latest else ""), "profile")
            self._asked, self._asked_by = "stop", by
        wake()
        self._wait_for_turn("stop")
        with self._lock:  # the profile stopped (by this stop, or by itself meanwhile): its file
            self._unclaimed = None
            return self._wait_for_written(self._serial)

    def _wait_for_written(self, serial: int) -> dict:
        """The answer of profile `serial` once written (lock held)."""
        deadline = self.clock() + WRITE_WAIT_S
        while (self.latest or {}).get("serial") != serial and serial not in self._failed and self.clock() < deadline:
            self._turned.wait(timeout=0.05)
        if serial in self._failed:
            raise ServiceError(500, f"profile: stopped, but could not write it: {self._failed[serial]}", "profile")
        if (self.latest or {}).get("serial") != serial:
            raise ServiceError(503, f"profile: stopped, still being written after {WRITE_WAIT_S:.0f} s; "
                                    "`kvctl profile show` lists it once written", "profile")
        return dict(self.latest)

    def status(self) -> dict:
        with self._lock:
            return {"running": dict(self.running) if self.running else None, "latest": self.latest,
                    "folder": str(self.folder)}

    def _wait_for_turn(self, asked: str) -> None:
        deadline = self.clock() + TURN_WAIT_S
        with self._turned:
            while self._asked == asked and self.clock() < deadline:
                self._turned.wait(timeout=0.05)
            if self._asked == asked:  # the engine thread did not come round: take the question back
                self._asked = None
                raise ServiceError(503, f"profile: the engine thread did not come round in {TURN_WAIT_S:.0f} s "
                                        f"to {asked} it (a step that long, or kvd stopping)", "profile")

    # ---- the engine thread ------------------------------------------------------------------
    def turn(self, device: str = "cpu", stopping: bool = False) -> None:
        """Engine thread, between steps: start or stop what was asked, and stop a profile past its
        max_seconds or max_steps (or any, when kvd is `stopping`). Cheap when there is nothing to do."""
        if self._asked is None and self.running is None:
            return
        written = None
        with self._turned:
            if self._asked == "start" and stopping:
                self._start_error = "kvd is stopping"
            elif self._asked == "start":
                try:
                    self._begin(device)
                except Exception as exc:  # a profile that fails must not stop the engine
                    self._start_error = f"{type(exc).__name__}: {exc}"
                    log.error("profile: could not start it: %s", self._start_error)
            elif self.running is not None:
                running = self.running
                over = ("max_seconds" if self.clock() - running["started"] >= running["max_seconds"] else
                        "max_steps" if running["steps"] >= running["max_steps"] else None)
                if self._asked == "stop" or stopping or over:
                    written = self._end(self._asked_by if self._asked == "stop" else
                                        "kvd stopping" if stopping else over)
                    self._writing = written is not None
                    if written is not None and self._asked != "stop" and not stopping:
                        self._unclaimed = self._serial  # the next stop answers with it
            self._asked = None
            self._turned.notify_all()
        if written is not None:
            if stopping:
                self._write(*written)
            else:
                threading.Thread(target=self._write, args=written, name="kvd-profile-write", daemon=True).start()

    def step_context(self):
        """What the engine runs a step in: a `kvd.step` range while a profile runs."""
        if self.running is None:
            return contextlib.nullcontext()
        self.running["steps"] += 1
        import torch.profiler

        return torch.profiler.record_function(STEP_NAME)

    def _begin(self, device: str) -> None:
        import torch.profiler

        activities = [torch.profiler.ProfilerActivity.CPU]
        if device == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        profile = torch.profiler.profile(activities=activities)
        profile.start()
        self._profile = profile
        self.running = {"since": time.time(), "started": self.clock(), "by": self._asked_by,
                        "max_seconds": self._asked_seconds, "max_steps": self._asked_steps, "steps": 0,
                        "device": device}
        self._begun = dict(self.running)
        log.info("profile started by %s (at most %.0f s or %d steps)", self._asked_by, self._asked_seconds,
                 self._asked_steps)

    def _end(self, stopped_by: str) -> tuple | None:
        """Stop the profiler (lock held): what `_write` needs (None: it would not stop)."""
        profile, running = self._profile, self.running
        self._profile, self.running = None, None
        self._serial += 1
        seconds = round(self.clock() - running["started"], 3)
        try:
            profile.stop()
        except Exception as exc:
            self._failed[self._serial] = f"{type(exc).__name__}: {exc}"
            log.error("profile: could not stop it: %s", self._failed[self._serial])
            _PROCESS_PROFILE.release()
            return None
        return profile, running, stopped_by, self._serial, seconds

    def _write(self, profile, running: dict, stopped_by: str, serial: int, seconds: float) -> None:
        """Write a stopped profile whole and make it the latest (any thread)."""
        stamp = datetime.fromtimestamp(running["since"], timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        name = f"kvd-profile-{stamp}-{os.getpid()}-{serial}"
        path, partial = self.folder / f"{name}.json.gz", self.folder / f"{name}.partial.json.gz"
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            summary = top_ops(profile)  # (before the export: kineto saves its results but once)
            raw = self.folder / f"{name}.partial.json"
            try:
                profile.export_chrome_trace(str(raw))  # (torch's own .gz writes line by line at level 9: 11 s)
                with open(raw, "rb") as source, gzip.open(partial, "wb", compresslevel=6) as packed:
                    shutil.copyfileobj(source, packed, 1 << 20)  # zlib lets the engine run meanwhile
                os.replace(partial, path)  # whole or not at all
            finally:
                raw.unlink(missing_ok=True)
                partial.unlink(missing_ok=True)
            answer = {"serial": serial, "path": str(path), "bytes": path.stat().st_size, "since": running["since"],
                      "seconds": seconds, "steps": running["steps"], "started_by": running["by"],
                      "stopped_by": stopped_by, "device": running["device"], **summary}
            self._prune()
            with self._turned:
                self.latest = answer
                self._turned.notify_all()
        except Exception as exc:
            with self._turned:
                self._failed[serial] = f"{type(exc).__name__}: {exc}"
                self._turned.notify_all()
            log.error("profile: could not write it: %s", self._failed[serial])
            return
        finally:
            self._writing = False
            _PROCESS_PROFILE.release()  # the next profile may start: this one is written (or given up)
        log.info("profile of %.1f s (%d steps) written to %s (stopped by %s)", seconds, running["steps"], path,
                 stopped_by)

    def _prune(self) -> None:
        written = sorted((p for p in self.folder.glob("kvd-profile-*.json.gz") if ".partial." not in p.name),
                         key=lambda p: p.stat().st_mtime_ns)
        for old in written[:-PROFILES_KEPT]:
            old.unlink(missing_ok=True)


def top_ops(profile, count: int = TOP_OPS) -> dict:
    """What a stopped profile's events say (`summarise`), read from kineto's own event list: the
    profiler's `key_averages` made a Python object per event and took 21 s for 360,000 of them (200
    steps of a CPU engine), holding the interpreter meanwhile; this takes about one."""
    from torch.autograd import DeviceType

    cpu = DeviceType.CPU
    return summarise(((e.start_thread_id(), e.start_ns(), e.end_ns(), e.name(), e.device_type() != cpu)
                      for e in profile.profiler.kineto_results.events()), count)


def summarise(events, count: int = TOP_OPS) -> dict:
    """`events`: (thread, start ns, end ns, name, on the device) of a profile. `top`: the CPU ops
    (and kvd.step ranges) that took the most self time, each `calls`, `self_cpu_ms` (its own time,
    less that of the ops inside it on its thread) and `cpu_ms` (all of it); `self_ms_total`: every
    op's self time, which the rows are shares of. Where the device ran kernels, `top_device` and
    `device_ms_total` the same for them by device time (kernels do not nest)."""
    threads: dict[int, list[tuple[int, int, str]]] = {}
    device: dict[str, list[int]] = {}  # kernel name -> [calls, ns]
    for thread, start, end, name, on_device in events:
        if on_device:
            row = device.setdefault(name, [0, 0])
            row[0] += 1
            row[1] += end - start
        else:
            threads.setdefault(thread, []).append((start, end, name))
    ops: dict[str, list[int]] = {}  # name -> [calls, self ns, total ns]
    for spans in threads.values():
        spans.sort(key=lambda span: (span[0], -span[1]))  # an op before the ops it encloses
        roots: list[list] = []
        open_: list[list] = []  # the ops enclosing this point: [name, start, end, children]
        for start, end, name in spans:
            while open_ and open_[-1][2] <= start:
                open_.pop()
            node = [name, start, end, []]
            (open_[-1][3] if open_ else roots).append(node)
            open_.append(node)
        pending = roots
        while pending:
            name, start, end, children = pending.pop()
            # as torch counts them: an op whose one child has its name (the dispatcher's second frame of
            # aten::sum, say) is one op, with that child's children
            while len(children) == 1 and children[0][0] == name:
                children = children[0][3]
            row = ops.setdefault(name, [0, 0, 0])
            row[0] += 1
            row[1] += end - start - sum(child[2] - child[1] for child in children)
            row[2] += end - start
            pending.extend(children)
    rows = sorted(({"name": name, "calls": calls, "self_cpu_ms": round(own / 1e6, 3), "cpu_ms": round(total / 1e6, 3)}
                   for name, (calls, own, total) in ops.items()), key=lambda row: (-row["self_cpu_ms"], row["name"]))
    out = {"top": rows[:count], "self_ms_total": round(sum(own for _, own, _ in ops.values()) / 1e6, 3)}
    if device:
        kernels = sorted(({"name": name, "calls": calls, "device_ms": round(ns / 1e6, 3)}
                          for name, (calls, ns) in device.items()), key=lambda row: (-row["device_ms"], row["name"]))
        out.update(top_device=kernels[:count], device_ms_total=round(sum(ns for _, ns in device.values()) / 1e6, 3))
    return out


def start_profile(service, principal: Principal, max_seconds: float, max_steps: int) -> dict:
    """Start profiling the engine thread for at most `max_seconds` and `max_steps`; audited."""
    service.require_ready()
    if not 0 < max_seconds <= MAX_SECONDS_LIMIT:
        raise ServiceError(400, f"max_seconds: must be more than 0 and at most {MAX_SECONDS_LIMIT:g}, got "
                                f"{max_seconds!r}", "max_seconds")
    if not 0 < max_steps <= MAX_STEPS_LIMIT:
        raise ServiceError(400, f"max_steps: must be from 1 to {MAX_STEPS_LIMIT:,}, got {max_steps!r}", "max_steps")
    started = service.profiler.start(principal.actor, max_seconds, max_steps, service._wake_engine)
    service.store.audit(actor=principal.actor, tenant=principal.tenant, action="profile_start", target="engine",
                        result="ok", detail={"max_seconds": max_seconds, "max_steps": max_steps})
    return {"profiling": True, "max_seconds": max_seconds, "max_steps": max_steps, "since": started["since"],
            "by": started["by"]}


def stop_profile(service, principal: Principal) -> dict:
    """Stop the running profile and write it; its answer (where it is, the ops that took longest); audited."""
    service.require_ready()
    written = service.profiler.stop(principal.actor, service._wake_engine)
    service.store.audit(actor=principal.actor, tenant=principal.tenant, action="profile_stop", target="engine",
                        result="ok", detail={k: written[k] for k in ("path", "seconds", "steps")})
    return written
