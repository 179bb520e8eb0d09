"""What every task shares with the job schema: the base of its parameters, and the job's size.

A leaf module: `ringctl.config` composes each task's parameters into the job schema, so the
tasks must not import `config` back (that was an import circle); both import from here.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TaskParams:
    """Base of every task's parameters: `task.name` selects the task."""

    name: str = "attention"


def world_size(cfg) -> int:
    """Ranks in the job: nodes x tasks_per_node."""
    return int(cfg.nodes) * int(cfg.tasks_per_node)
