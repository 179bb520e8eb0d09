"""What every task shares: the `Task` class, its gather step, and the job's size.

A leaf module (standard library only), which `ringctl.config` imports for `world_size`. The
base of a task's parameters (`TaskParams`) lives in `ringctl.task_params`, so that the
long-document package derives its parameters from it without importing the tasks.

A task is a `Task` subclass, as a backend is a `Backend` subclass: what it is (its parameter
class, extra config sections, optional packages, gather step) are class attributes, and what it
does (check, prepare, size, list documents, run, gather) are methods with a default that says
"nothing of the kind". Callers ask the task; no verb tests a task's name.
"""

from __future__ import annotations

import importlib.util
import os
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from ringattn import switches

from ..errors import UserError

# Forcing RINGATTN_KERNEL=flash (env.vars or the submitting shell) needs flash-attn on the ranks.
KERNEL_PACKAGES = {"flash": ("flash_attn", "pip install 'ringctl[flash]' (CUDA only)")}


def engine_switches(cfg) -> dict[str, str]:
    """The engine's switches as the ranks of a job from this shell read them: env.vars' value
    (checked with the config), else this shell's (a local or Slurm job's ranks inherit it),
    refused by name where the engine would refuse it on every rank, after the queue wait."""
    taken = {}
    for name in switches.CHOICES:
        given = cfg.env.vars.get(name)
        try:
            taken[name] = switches.choice(name, os.environ.get(name) if given is None else given)
        except ValueError as err:
            raise UserError(f"this shell's environment: {err}") from None
    wrong = switches.kernel_device_problem(taken[switches.KERNEL], ranks_device(cfg) or "")
    if wrong and cfg.env.vars.get(switches.KERNEL) is None:  # env.vars': config's check
        raise UserError(f"this shell's environment: {wrong}")
    return taken


def ranks_device(cfg) -> str | None:
    """The device a job's ranks compute on where its config decides it: "cpu" under
    ring.dist_backend=gloo, or on a cluster asked for no GPU (gpus_per_node=0); "cuda" on a
    cluster asked for GPUs (backend nccl or auto); None for ranks on this machine (the local
    backend), which take a CUDA device where torch sees one (the worker's
    ``init_distributed``)."""
    from ..backends import ranks_here

    if str(getattr(cfg.ring.dist_backend, "value", cfg.ring.dist_backend)) == "gloo":
        return "cpu"
    if ranks_here(cfg):  # this machine's devices decide
        return None
    return "cuda" if int(cfg.gpus_per_node) > 0 else "cpu"


def world_size(cfg) -> int:
    """Ranks in the job: nodes x tasks_per_node."""
    return int(cfg.nodes) * int(cfg.tasks_per_node)


def importable(module: str) -> bool:
    """Whether `import module` would find it, without importing it."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # ValueError: a module blocked in sys.modules
        return False


@dataclass(frozen=True)
class NamedFile:
    """A file or folder a job's config names, which its ranks read: ``key`` says where
    (``task.inputs``); ``required``: the job cannot run without it (else a missing one is the
    task's to report, as ``task.on_missing`` says)."""

    key: str
    path: str
    required: bool = True


class Gatherer:
    """A task's gather step (`ringctl gather`): verify a job's outputs and reassemble them."""

    def gather(self, job_dir: Path, out, **options) -> Any:
        raise NotImplementedError

    def recognises(self, path: Path) -> bool:
        """Whether a bare directory (no job around it) holds this task's output."""
        return False

    def replaces_partial(self, job_dir: Path, out) -> bool:
        """Whether gathering into `out` replaces an earlier partial output (then under lock)."""
        return False

    def show(self, result, console) -> None:
        """What the verb prints once the output is written."""
        from rich.text import Text

        console.print(Text(f"wrote {result.out}"))


class Task(ABC):
    """One kind of work a job runs (`task.name` in its config selects the subclass).

    The task's module is imported whenever a config is loaded (for its schema), so a task
    imports torch, transformers and the like inside `run`, not at the top of its module.
    """

    name: ClassVar[str]
    params: ClassVar[type]  # a task_params.TaskParams dataclass: the `task:` section of a job file
    sections: ClassVar[dict[str, type]] = {}  # extra top-level sections of its jobs
    # Optional packages the ranks need: (module, how to install it). Checked at submit, so a
    # missing one is a one-line refusal instead of a traceback from every started rank.
    packages: ClassVar[tuple[tuple[str, str], ...]] = ()
    # What its ranks import first, which the local supervisor imports once before forking them
    # (ringctl.backends.launch): the slow imports, so each rank does not repeat them.
    start_imports: ClassVar[tuple[str, ...]] = ("torch", "torch.distributed", "ringctl.worker")
    # What its ranks set in their environment before those imports (the supervisor too).
    start_env: ClassVar[dict[str, str]] = {}
    # Whether it runs hybrid Ulysses x ring grids (ring.ulysses): the planner offers a
    # hybrid layout only to a task that can take it.
    hybrid_grids: ClassVar[bool] = False
    # Keys a resume of its jobs may change beyond submission.RESUME_KEYS (how it runs, its
    # results the same).
    resume_keys: ClassVar[tuple[str, ...]] = ()

    def check(self, cfg, bad: Callable[[str, str], Exception]) -> None:
        """Raise bad("task.x", "why") for an impossible value (at load, before submission)."""
        return None

    def prepare(self, cfg):
        """The config as submitted (e.g. absolute paths); by default as given."""
        return cfg

    def workload(self, cfg):
        """What the planner sizes for this job (ringctl.sizing), or None: not known up front."""
        return None

    def document_lengths(self, cfg, *, fits=None) -> list[tuple[str, int]]:
        """(id, tokens) of each document of a job whose sequences vary ([]: none); ``fits``:
        whether a ring of the job holds that many tokens (an estimate it refuses is counted
        for real, where the task can)."""
        return []

    def resume_problem(self, cfg, job_dir: Path) -> str | None:
        """Why the job's ranks would refuse a resume of ``job_dir`` at once, found here first
        (a resume queued on Slurm only to fail); None: nothing known against it."""
        return None

    def named_files(self, cfg) -> list[NamedFile]:
        """The files the job's config names for its ranks to read (its inputs, its model), for
        a backend whose nodes do not see this machine's files to look for where they run
        (``Backend.check_named_files``); none by default."""
        return []

    @abstractmethod
    def run(self, cfg, ctx) -> Any:
        """What every rank does (ctx: `TaskContext` in ringctl.worker)."""

    def gatherer(self) -> Gatherer | None:
        """This task's gather step, or None when it has none."""
        return None

    def missing_packages(self, cfg) -> list[tuple[str, str]]:
        """(module, install line) of each optional package the job needs and cannot import:
        the task's own, and flash-attn when the job forces RINGATTN_KERNEL=flash."""
        needs = list(self.packages)
        kernel = engine_switches(cfg)[switches.KERNEL]
        if kernel in KERNEL_PACKAGES:
            needs.append(KERNEL_PACKAGES[kernel])
        return [(module, install) for module, install in needs if not importable(module)]
