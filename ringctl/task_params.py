"""The base of every task's parameters, and the task of a job file that names none.

A root leaf (standard library only). The config reader types a job's ``task:`` section with
these, and the long-document package derives its parameters from ``TaskParams``
(``ringctl.longdoc.params``); both sit below the task registry (``ringctl.tasks``), which
imports them, so neither may import the registry back for its base class.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_TASK = "attention"  # the task of a job file that names none


@dataclass
class TaskParams:
    """Base of every task's parameters: ``task.name`` selects the task."""

    name: str = DEFAULT_TASK


# Bounds of a task's integer parameters, one rule for every task (checked at load, so that a
# value no rank can run is refused before the queue, naming its key):
# - a size (a tensor dimension: tokens, heads, a batch, a chunk) below 2**31: every shape of
#   the job stays far inside torch's 64-bit sizes (a product of four such is checked by the
#   task where it builds one), and 32-bit kernel indexing holds each dimension;
# - a seed from 0 to 2**63-1: torch.Generator.manual_seed takes -2**63..2**64-1 but reads a
#   negative seed as 2**64 plus it (two spellings of one seed), and 2**64 killed every rank;
# - a count (steps, checkpoints): a 64-bit number, as every integer field (config._check_int64).
MAX_SIZE = (1 << 31) - 1
MAX_SEED = (1 << 63) - 1
MAX_COUNT = (1 << 63) - 1


def int_problem(value, least: int, most: int) -> str | None:
    """Why ``value`` is not an integer from ``least`` to ``most``, or None."""
    if isinstance(value, bool) or not isinstance(value, int):
        return f"must be an integer from {least} to {most:,}, not {value!r}"
    if not least <= value <= most:
        return f"must be from {least} to {most:,}, got {value}"
    return None
