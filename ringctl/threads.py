"""How many CPU threads each rank computes with: one rule for every backend.

The job's ``OMP_NUM_THREADS`` where it sets one (env.vars, or the environment ringctl runs
in); else the CPUs Slurm gives each task (``slurm.cpus_per_task``); else the node's CPUs over
its ranks. torch alone takes every core it sees in each rank: ranks-per-node times
oversubscribed where Slurm binds no CPUs, and the CPU kernels' rounding follows the thread
count, so the same job gave other numbers on Slurm than on the local backend (losses 1.8e-7
apart where one thread a rank gives them bitwise).
"""

from __future__ import annotations

import os

from .text import is_ascii_number

# What libgomp skips around a count (C's isspace): str.strip() also took Unicode blanks
# (a no-break space), which libgomp refuses, so the value read 4 here and "none" on the rank.
C_BLANKS = " \t\n\v\f\r"


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity: a Slurm task bound to its own, a
    taskset), or the machine's where the system cannot say."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def plain_count(text: str) -> bool:
    """A thread count as OMP_NUM_THREADS may hold one and int() reads: ASCII digits, >= 1."""
    return is_ascii_number(text, 9) and int(text) >= 1


def usable(given: str) -> str | None:
    """``given`` as OpenMP reads OMP_NUM_THREADS, blanks dropped (" 4" and "4, 2" are 4 and
    4,2 to libgomp): counts of at least 1, comma separated for nested levels; None for a
    value the OpenMP runtime refuses with a warning (0, -1, "abc"), where torch then took
    every core in each rank."""
    parts = [part.strip(C_BLANKS) for part in str(given).split(",")]
    return ",".join(parts) if all(plain_count(part) for part in parts) else None


def rank_threads(
    given: str | None, *, cpus_per_task: int | None, node_cpus: int, ranks_on_node: int
) -> str:
    """The rank's ``OMP_NUM_THREADS`` value (text: OpenMP also takes "4,2"); a value OpenMP
    would not take counts as none given."""
    read = usable(given) if given else None
    if read:
        return read
    if cpus_per_task:
        return str(int(cpus_per_task))
    return str(max(1, node_cpus // max(1, ranks_on_node)))
