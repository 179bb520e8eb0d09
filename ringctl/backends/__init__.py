"""Where jobs run: `local` (processes on this machine), `slurm` (sbatch here), `ssh` (sbatch on a
remote login node). Each backend is one module behind the small interface in `base`.

This registry is what the rest of ringctl knows of them, as `ringctl.tasks` is for tasks:
`BACKENDS` names each backend's class as "module:Class", imported when asked for (the ssh
backend brings paramiko), so a caller asks the class what it needs to know (`files_here`,
`ranks_here`) instead of testing a backend's name; `SECTIONS` names the config sections the
backends declare (a dataclass of keys and defaults, with its `check(cfg, bad)` and the keys
that hold `seconds`), from modules light enough to load with every config. Adding a backend
is adding its module and its lines here.
"""

from __future__ import annotations

import importlib

BACKENDS: dict[str, str] = {
    "local": "ringctl.backends.local:LocalBackend",  # processes on this machine
    "slurm": "ringctl.backends.slurm:SlurmBackend",  # sbatch here
    "ssh": "ringctl.backends.ssh:SSHBackend",  # sbatch on a login node, over SSH
}
SECTIONS: dict[str, str] = {
    "ssh": "ringctl.backends.ssh_config:SshConfig",  # the ssh backend's login node
}


def _load(spec: str):
    module_name, _, name = spec.partition(":")
    return getattr(importlib.import_module(module_name), name)


def backend_class(name: str) -> type:
    """The backend registered as `name`, a `base.Backend` subclass (not imported here: its
    modules import this package); KeyError naming the known ones otherwise."""
    if name not in BACKENDS:
        raise KeyError(f"unknown backend {name!r}; known: {', '.join(sorted(BACKENDS))}")
    return _load(BACKENDS[name])


def config_sections() -> dict[str, type]:
    """Each section the backends declare -> its dataclass."""
    return {section: _load(spec) for section, spec in SECTIONS.items()}


def backend_of(cfg) -> type:
    """The class of a job config's backend (its ``backend`` key, an enum or its name): where
    its traits are read (``ranks_here``, ``files_here``, ``sets_up_env``)."""
    backend = cfg.backend
    return backend_class(str(getattr(backend, "value", backend)))


def ranks_here(cfg) -> bool:
    """Whether a job's ranks run on this machine (its backend's ``Backend.ranks_here``: the
    local one), whose devices then decide theirs."""
    return backend_of(cfg).ranks_here


def files_here(cfg) -> bool:
    """Whether a job's paths (task.inputs, task.model_path) name this machine's files: its
    backend's ``Backend.files_here`` (local, slurm); over ssh they are the login node's."""
    return backend_of(cfg).files_here
