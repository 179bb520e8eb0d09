"""A local rank's lifetime tied to whoever started it: Linux's PR_SET_PDEATHSIG, set by the
supervisor on the process it starts (``backends.launch``) and by the worker on itself when the
local supervisor started it (``RINGCTL_SUPERVISED``), so that a worker behind an env.python
wrapper that does not exec dies with the wrapper, which dies with the supervisor. A leaf: the
launcher and the worker both import it, and neither imports the other for it."""

from __future__ import annotations

import ctypes
import os
import signal

# Set by the local supervisor in each rank's environment (its pid).
SUPERVISED = "RINGCTL_SUPERVISED"


def prctl(option: int, arg) -> None:
    """Linux's prctl(option, arg); nothing where there is none."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(option, arg)
    except (OSError, AttributeError):
        pass


def die_with_parent() -> None:
    """SIGKILL when the parent dies (PR_SET_PDEATHSIG), even by SIGKILL. Not on Linux:
    nothing, and the process group still lets cancel reach every worker."""
    prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def die_with_launcher() -> bool:
    """In a worker the local supervisor started: die with the parent (the supervisor, or an
    env.python wrapper that runs this process without exec). The supervisor set it on the
    process it started only, and a wrapper's worker outlived cancel, a killed supervisor and a
    failed peer, and ran beside a resumed ring. False when the parent is already gone;
    True, doing nothing, under any other launcher (srun, a user's own)."""
    if not os.environ.get(SUPERVISED):
        return True
    parent = os.getppid()
    die_with_parent()
    return parent != 1 and os.getppid() == parent
