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
