"""Other `kvd serve` processes on this host that share this one's CPUs, and which of them are busy.

Read from /proc (Linux): a process is a kvd engine when its command line runs `kvd serve`; it
shares CPUs when its affinity (`Cpus_allowed_list`) meets this process's; it is busy when its CPU
time grew by `policies.cpu_threads.BUSY_CPU_SHARE` of the wall time since the last look. A
process first seen, or gone, counts as idle. `kvd router` is not an engine and never counts.

A look reads the command line and affinity of processes it has not seen before, and the CPU time
of the kvd engines it knows: on a host of a thousand processes, a look a second costs a listing
of /proc and a few reads, not three thousand.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable

from kvctl.policies.cpu_threads import is_busy


JUDGE_AGAIN_EVERY = 30  # looks


def parse_cpu_list(text: str) -> set[int]:
    """'0-3,8,10-11' -> {0, 1, 2, 3, 8, 10, 11}."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def is_kvd_engine(argv: list[str]) -> bool:
    """Whether a command line runs `kvd serve` (an entry point named kvd, then `serve`)."""
    return any(os.path.basename(arg) == "kvd" and argv[i + 1:i + 2] == ["serve"] for i, arg in enumerate(argv))


class KvdNeighbours:
    """`look()` -> how many other kvd engines sharing this process's CPUs were busy since the last
    look, and this process's CPUs. `proc`, `me` and `clock` are for tests."""

    def __init__(self, proc: str | Path = "/proc", me: int | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.proc, self.me, self.clock = Path(proc), me or os.getpid(), clock
        self.ticks = os.sysconf("SC_CLK_TCK")
        self._seen: dict[int, tuple[float, float]] = {}  # pid -> (CPU seconds, when read)
        self._known: dict[int, bool] = {}  # pid -> whether it is a kvd engine sharing these CPUs
        self._mine: set[int] | None = None  # this process's CPUs when `_known` was judged
        self._looks = 0

    def cpus(self, pid: int | str = "self") -> set[int]:
        for line in self._read(pid, "status").splitlines():
            if line.startswith("Cpus_allowed_list:"):
                return parse_cpu_list(line.split(":", 1)[1])
        return set()

    def look(self) -> tuple[int, set[int]]:
        mine = self.cpus(self.me)
        self._looks += 1
        # judged again: after a change of this process's affinity, and every JUDGE_AGAIN_EVERY looks (a
        # process caught between fork and exec, or moved to other CPUs since, is not misjudged for good)
        if mine != self._mine or self._looks % JUDGE_AGAIN_EVERY == 0:
            self._known, self._mine = {}, mine
        pids = {int(e.name) for e in self.proc.iterdir() if e.name.isdigit()} - {self.me}
        self._known = {pid: self._known[pid] if pid in self._known else self._shares_with_me(pid, mine)
                       for pid in pids}
        busy, seen = 0, {}
        for pid in (p for p, engine in self._known.items() if engine):
            cpu = self._cpu_seconds(pid)
            if cpu is None:
                continue
            now = self.clock()
            seen[pid] = (cpu, now)
            if pid in self._seen:
                before, then = self._seen[pid]
                busy += is_busy(cpu - before, now - then)
        self._seen = seen
        return busy, mine

    def _shares_with_me(self, pid: int, mine: set[int]) -> bool:
        return is_kvd_engine(self._read(pid, "cmdline").split("\0")) and bool(self.cpus(pid) & mine)

    def _cpu_seconds(self, pid: int) -> float | None:
        stat = self._read(pid, "stat")
        fields = stat[stat.rfind(")") + 2:].split()  # after the command name, which may hold spaces
        if len(fields) < 13:
            return None
        return (int(fields[11]) + int(fields[12])) / self.ticks  # utime + stime

    def _read(self, pid: int | str, name: str) -> str:
        try:
            return (self.proc / str(pid) / name).read_text(errors="replace")
        except OSError:  # gone, or not ours to read
            return ""
