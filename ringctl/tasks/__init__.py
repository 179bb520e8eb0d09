"""The tasks a job can run: `task.name` in a job config -> a module here.

A task module defines:

    @dataclass
    class Params(TaskParams):      # the `task:` section of a job file (name + parameters)
        ...
    SECTIONS = {"model": ModelConfig}   # optional: extra top-level sections of its jobs
    def check(cfg, bad) -> None:   # optional: raise bad("task.x", "why") for impossible values
    def prepare(cfg) -> dict:      # optional: the config as submitted (e.g. absolute paths)
    def workload(cfg) -> Workload: # optional: what `ringctl plan` sizes before submission
    def document_lengths(cfg) -> list[tuple[str, int]]:  # optional: (id, tokens) per document
    def run(cfg, ctx) -> None:     # what every rank does (ctx: `TaskContext` in ringctl.worker)

The module is imported whenever a config is loaded (for its schema), so it must import torch,
transformers and the like inside `run`, not at the top.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..atomic import atomic_write, atomic_write_json
from .base import TaskParams

__all__ = [
    "TASKS",
    "TaskParams",
    "TaskSpec",
    "atomic_write",
    "atomic_write_json",
    "get_spec",
    "load_tensors",
    "save_tensors",
]

TASKS: dict[str, str] = {
    "attention": "ringctl.tasks.attention",
    "longdoc": "ringctl.tasks.longdoc",  # long documents: score / embed / grad with an LM
}

HF_INSTALL = "pip install 'ringctl[hf]'"
# Optional packages a task needs on the ranks: (module, how to install it). Checked at submit,
# so a missing one is a one-line refusal instead of a traceback from every started rank.
TASK_PACKAGES: dict[str, tuple[tuple[str, str], ...]] = {
    "longdoc": (("transformers", HF_INSTALL), ("tokenizers", HF_INSTALL)),
}
# Tasks whose outputs `ringctl gather` can verify and reassemble: task -> module with
# `gather(job_dir, out, *, force)`; optional `recognises(path)` (bare output directories) and
# `show(result, console)` (see ringctl.longdoc.gather).
TASK_GATHERERS: dict[str, str] = {"longdoc": "ringctl.longdoc.gather"}
KERNEL_PACKAGES = {"flash": ("flash_attn", "pip install 'ringctl[flash]' (CUDA only)")}


def importable(module: str) -> bool:
    """Whether `import module` would find it, without importing it."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # ValueError: a module blocked in sys.modules
        return False


@dataclass(frozen=True)
class TaskSpec:
    name: str
    module: Any
    params: type
    sections: dict[str, type] = field(default_factory=dict)

    def check(self, cfg, bad: Callable[[str, str], Exception]) -> None:
        checker = getattr(self.module, "check", None)
        if checker is not None:
            checker(cfg, bad)

    def prepare(self, cfg):
        preparer = getattr(self.module, "prepare", None)
        return cfg if preparer is None else preparer(cfg)

    def workload(self, cfg):
        """What the planner sizes for this job (ringctl.sizing), or None: not known up front."""
        make = getattr(self.module, "workload", None)
        return None if make is None else make(cfg)

    def document_lengths(self, cfg, **kwargs) -> list[tuple[str, int]]:
        """(id, tokens) of each document of a job whose sequences vary ([]: none)."""
        lengths = getattr(self.module, "document_lengths", None)
        return [] if lengths is None else lengths(cfg, **kwargs)

    def run(self, cfg, ctx) -> Any:
        return self.module.run(cfg, ctx)

    def gatherer(self):
        """The module that gathers this task's outputs, or None when it has none."""
        name = TASK_GATHERERS.get(self.name)
        return importlib.import_module(name) if name else None

    def missing_packages(self, cfg) -> list[tuple[str, str]]:
        """(module, install line) of each optional package the job needs and cannot import:
        the task's own, and flash-attn when the job forces RINGATTN_KERNEL=flash."""
        needs = list(TASK_PACKAGES.get(self.name, ()))
        kernel = cfg.env.vars.get("RINGATTN_KERNEL") or os.environ.get("RINGATTN_KERNEL")
        if kernel in KERNEL_PACKAGES:
            needs.append(KERNEL_PACKAGES[kernel])
        return [(module, install) for module, install in needs if not importable(module)]


def get_spec(name: str) -> TaskSpec:
    if name not in TASKS:
        raise KeyError(f"unknown task {name!r}; known: {', '.join(sorted(TASKS))}")
    module = importlib.import_module(TASKS[name])
    return TaskSpec(name, module, module.Params, dict(getattr(module, "SECTIONS", {})))


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
