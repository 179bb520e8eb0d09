"""How much CPU other jobs used while a benchmark round ran (Linux /proc).

A side-by-side benchmark on a shared machine is only fair while nothing else runs: a job that
starts during the SDPA round and stops before the ring's once made the ring look 1.4x faster.
``OutsideLoad`` reads the machine's busy CPU time (/proc/stat) and the CPU time of this
benchmark's own process tree (this process and all its descendants, /proc/<pid>/stat) at the
start and end of a round; what the machine spent beyond our tree, divided by the round's wall
time, is the outside load in cores. Without /proc (not Linux) it reports None.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _machine_busy_s() -> float | None:
    """Seconds of CPU the whole machine spent busy (not idle, not iowait) since boot."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    # cpu user nice system idle iowait irq softirq steal guest guest_nice
    values = [int(x) for x in fields[1:9]]
    busy = values[0] + values[1] + values[2] + values[5] + values[6] + values[7]
    return busy / _TICK


def _stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, CPU seconds user+system) of a live process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    rest = text[text.rindex(")") + 2 :].split()  # the command name may hold spaces
    return int(rest[1]), (int(rest[11]) + int(rest[12])) / _TICK


def tree_cpu_s(root: int) -> float:
    """CPU seconds of ``root`` and every live descendant (children that exited and were
    reaped are counted by their parent's cutime/cstime, read for the root too)."""
    parents, cpu = {}, {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = _stat(int(name))
            if st is not None:
                parents[int(name)], cpu[int(name)] = st
    total, frontier = 0.0, [root]
    seen = set()
    children: dict[int, list[int]] = {}
    for pid, ppid in parents.items():
        children.setdefault(ppid, []).append(pid)
    while frontier:
        pid = frontier.pop()
        if pid in seen:
            continue
        seen.add(pid)
        total += cpu.get(pid, 0.0)
        frontier.extend(children.get(pid, []))
    reaped = os.times()
    return total + reaped.children_user + reaped.children_system


@dataclass
class LoadReading:
    outside_cores: float | None  # other jobs' average CPU use during the round, in cores
    wall_s: float

    def disturbed(self, threshold_cores: float) -> bool:
        return self.outside_cores is not None and self.outside_cores > threshold_cores


class OutsideLoad:
    """``with OutsideLoad() as load: ...`` then ``load.reading``."""

    def __init__(self, root: int | None = None) -> None:
        self.root = os.getpid() if root is None else root
        self.reading = LoadReading(None, 0.0)

    def __enter__(self) -> OutsideLoad:
        self._t0 = time.perf_counter()
        self._busy0 = _machine_busy_s()
        self._own0 = tree_cpu_s(self.root) if self._busy0 is not None else 0.0
        return self

    def __exit__(self, *exc) -> None:
        wall = time.perf_counter() - self._t0
        busy1 = _machine_busy_s()
        if self._busy0 is None or busy1 is None or wall <= 0:
            self.reading = LoadReading(None, wall)
            return
        own = tree_cpu_s(self.root) - self._own0
        outside = max(0.0, (busy1 - self._busy0) - own) / wall
        self.reading = LoadReading(outside, wall)
