"""The ``ssh:`` section of a job config: the login node the ssh backend reaches, its keys,
defaults and checks, declared by the backend that reads it.

Light on purpose (no paramiko): the config reader loads it with every config, through the
backends' registry (``ringctl.backends.SECTIONS``), and knows nothing of its keys. The backend
itself (``ssh.py``) gets the section as this dataclass.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import ClassVar

from ..sbatch import path_problem

DEFAULT_KNOWN_HOSTS = "~/.ssh/known_hosts"


@dataclass
class SshConfig:
    host: str | None = None
    port: int = 22
    user: str | None = None
    key: str | None = None  # private key file; default: the SSH agent and ~/.ssh keys
    known_hosts: str | None = None  # default: ~/.ssh/known_hosts
    remote_dir: str = "ringctl-jobs"  # relative paths are under the remote home
    trust_unknown_host: bool = False
    connect_timeout: float = 15.0
    command_timeout: float = 120.0  # seconds one remote command (sbatch, squeue, ...) may take

    # Its keys that hold seconds: the config reader checks them by its one rule for timeouts.
    seconds: ClassVar[tuple[str, ...]] = ("connect_timeout", "command_timeout")

    @property
    def target(self) -> str:
        user = f"{self.user}@" if self.user else ""
        return f"{user}{self.host}:{self.port}"

    @property
    def known_hosts_path(self) -> str:
        return os.path.expanduser(self.known_hosts or DEFAULT_KNOWN_HOSTS)

    @staticmethod
    def check(cfg, bad) -> None:
        """Raise bad("ssh.x", why) for an impossible value (at load, before submission)."""
        ssh = cfg.ssh
        if not 1 <= ssh.port <= 65535:
            raise bad("ssh.port", f"must be a TCP port, 1 to 65535, got {ssh.port}")
        if cfg.backend.value == "ssh" and not ssh.host:
            raise bad("ssh.host", "is required with backend=ssh (e.g. ssh.host=login.example.org)")
        why = path_problem(str(ssh.remote_dir))
        if why:
            raise bad("ssh.remote_dir", why)
