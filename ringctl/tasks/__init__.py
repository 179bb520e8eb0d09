"""The tasks a job can run: one registry, `task.name` in a job config -> a `Task` subclass.

A task is a subclass of `ringctl.tasks.base.Task` (its parameters, extra config sections,
optional packages, gather step; check, prepare, workload, document_lengths, run): see that
module. `TASKS` names each task's class as "module:Class", imported when the task is asked
for, so loading a config imports only the task it names.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from ..atomic import atomic_write, atomic_write_json
from ..task_params import TaskParams
from .base import Gatherer, Task

__all__ = [
    "TASKS",
    "Gatherer",
    "Task",
    "TaskParams",
    "atomic_write",
    "atomic_write_json",
    "get_task",
    "load_tensors",
    "save_tensors",
]

TASKS: dict[str, str] = {
    "attention": "ringctl.tasks.attention:AttentionTask",
    "longdoc": "ringctl.tasks.longdoc:LongDocTask",  # long documents: score / embed / grad
    "train": "ringctl.tasks.train:TrainTask",  # training on packed sequences
}


def get_task(name: str) -> Task:
    """The task registered as `name` (KeyError naming the known ones otherwise)."""
    if name not in TASKS:
        raise KeyError(f"unknown task {name!r}; known: {', '.join(sorted(TASKS))}")
    module_name, _, class_name = TASKS[name].partition(":")
    return getattr(importlib.import_module(module_name), class_name)()


# --- writing outputs: atomically (temp file in the same directory, then rename) ----------------


def save_tensors(path: str | Path, tensors: dict, metadata: dict[str, str] | None = None) -> Path:
    """Save tensors as safetensors, atomically (contiguous CPU copies)."""
    from safetensors.torch import save

    plain = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    return atomic_write(path, save(plain, metadata=metadata))


def load_tensors(path: str | Path) -> tuple[dict, dict[str, str]]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as fh:
        return {k: fh.get_tensor(k) for k in fh.keys()}, dict(fh.metadata() or {})
