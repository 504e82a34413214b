"""How many intra-op threads a CPU engine runs when other engines share its CPUs.

Pure: fed the CPUs this engine may use and how much CPU each neighbouring engine took since the
last look; it reads no clock and no /proc (`daemon/server/cpu_neighbours.py` does).

torch's OpenMP runtime (libgomp) spins only briefly before it sleeps once the threads it manages
outnumber the CPUs; then every parallel region pays a wake-up, and a team whose thread is off its
CPU waits for it. Two kvd processes on 2 CPUs, each running 2 threads, made 115 output tokens/s
each where one thread each made 2,300: a cliff, not a slope. So a busy neighbour is given an equal
share of the CPUs:

    threads = max(1, cpus // (busy_neighbours + 1)), never above the engine's own default

A neighbour is busy when it used at least `BUSY_CPU_SHARE` of one CPU over the last interval: an
idle replica's threads sleep and cost nothing, so it takes no share.
"""

from __future__ import annotations

BUSY_CPU_SHARE = 0.2  # of one CPU, over the interval between two looks
LOOK_EVERY_S = 0.25  # how often the daemon looks at its neighbours: a look costs ~0.15 ms here, the cliff 20x
RAISE_AFTER_S = 10.0  # fewer threads at once; more only once the neighbours have been idle this long


def is_busy(cpu_seconds: float, wall_seconds: float) -> bool:
    """Whether a process that used `cpu_seconds` over `wall_seconds` counts as a busy neighbour."""
    return wall_seconds > 0 and cpu_seconds >= BUSY_CPU_SHARE * wall_seconds


def intra_op_threads(cpus: int, busy_neighbours: int, default: int) -> int:
    """Threads for this engine: an equal share of `cpus` with the busy neighbours, at most `default`
    (the count it starts with: torch's, or the operator's OMP_NUM_THREADS), at least one."""
    return max(1, min(default, cpus // (busy_neighbours + 1)))
