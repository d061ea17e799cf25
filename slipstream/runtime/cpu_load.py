"""The CPU team's size under a busy neighbour.

The native step's threads wait on each other's tasks, so a team that has more threads than the cores
it actually gets loses time whenever the scheduler takes one of them away mid-step. Measured on the
2-core Xeon with a 2-thread matrix multiply beside it (benchmarks/cpu_decode.py --neighbour): a
2-thread team kept 0.49-0.57x of its quiet speed, a 1-thread team 0.62x. So every `window_s` the
decoder reads how many cores the rest of the machine kept busy (the machine's busy time from
/proc/stat less this process's own CPU time) and runs round(cores - that) threads, never more than it
was configured with and never fewer than one. Results do not depend on the team's size: any number
of threads completes the same task table in the same tiles.
"""
from __future__ import annotations

import os
import resource
import time
from typing import Callable


def _machine_busy_s() -> float | None:
    """Seconds of CPU time the cores this process may run on spent busy since boot (/proc/stat's per-core
    lines: in a container pinned to some of a big host's cores, the rest of the host is not a neighbour),
    None off Linux."""
    try:
        allowed = os.sched_getaffinity(0)
        busy = 0
        with open("/proc/stat") as f:
            for line in f:
                if not line.startswith("cpu"):
                    break
                name, *values = line.split()
                if name == "cpu" or int(name[3:]) not in allowed:
                    continue
                fields = [int(v) for v in values[:8]]
                busy += sum(fields) - fields[3] - (fields[4] if len(fields) > 4 else 0)   # less idle, iowait
    except (OSError, ValueError, AttributeError):
        return None
    return busy / os.sysconf("SC_CLK_TCK")


def _own_cpu_s() -> float:
    me = resource.getrusage(resource.RUSAGE_SELF)
    return me.ru_utime + me.ru_stime


class NeighbourLoad:
    """Cores kept busy by other processes, averaged over windows of at least `window_s` seconds."""

    def __init__(self, window_s: float = 0.5, machine_busy: Callable[[], float | None] = _machine_busy_s,
                 own_cpu: Callable[[], float] = _own_cpu_s, clock: Callable[[], float] = time.perf_counter):
        self.window_s = window_s
        self._machine_busy, self._own_cpu, self._clock = machine_busy, own_cpu, clock
        self._start()

    def _start(self) -> None:
        self._t0, self._busy0, self._own0 = self._clock(), self._machine_busy(), self._own_cpu()

    def sample(self) -> float | None:
        """The other processes' cores over the window just ended (a new one starts), or None while the
        window is still open or where /proc/stat cannot be read."""
        now = self._clock()
        if now - self._t0 < self.window_s:
            return None
        busy, own = self._machine_busy(), self._own_cpu()
        other = None
        if busy is not None and self._busy0 is not None:
            other = max(0.0, (busy - self._busy0 - (own - self._own0)) / (now - self._t0))
        self._t0, self._busy0, self._own0 = now, busy, own
        return other


def team_size(configured: int, cores: int, other: float) -> int:
    """Threads to run beside `other` busy cores out of `cores`: what is left, rounded, within [1, configured]."""
    return max(1, min(configured, round(cores - other)))
