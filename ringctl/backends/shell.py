"""Where a backend's commands run and its job files are: this machine, or a login node.

The slurm backend runs `sbatch`/`squeue`/`sacct` and reads job files through a `Shell`; the
ssh backend gives it one over paramiko (`ringctl.backends.ssh.SSHShell`). Commands are argv
lists, never shell text.
"""

from __future__ import annotations

import os
import stat
import subprocess
from collections.abc import Sequence
from typing import Protocol

from ..bounded_read import open_regular, read_range
from ..errors import NotSubmitted, UserError

READ_LIMIT = 16 << 20  # bytes a read of a job's file returns at most (logs are read in pieces)


class Shell(Protocol):
    where: str  # for messages: "this machine", "root@login:22"

    def run(self, argv: Sequence[str], *, timeout: float = 60.0) -> tuple[int, str, str]:
        """Run argv (no shell); return (exit status, stdout, stderr)."""

    def read_from(
        self, path: str, offset: int = 0, *, limit: int = READ_LIMIT, tail: bool = False
    ) -> bytes | None:
        """At most ``limit`` bytes of the regular file from ``offset`` on (``tail``: its last
        ``limit`` bytes past offset); None when the file does not exist. A link, a pipe or a
        device is a UserError naming it (a job directory is written by the job: a log
        linked to /dev/zero or made a FIFO read forever)."""

    def listdir(self, path: str) -> list[str]:
        """Names in a directory; [] when it does not exist."""

    def file_sizes(self, path: str) -> dict[str, int]:
        """{name: size} of a directory's regular files (not links), from one listing; {}
        when it does not exist: what a follower polls instead of reading every log."""


class LocalShell:
    where = "this machine"

    def run(self, argv: Sequence[str], *, timeout: float = 60.0) -> tuple[int, str, str]:
        try:
            proc = subprocess.run(
                list(argv), capture_output=True, text=True, timeout=timeout, check=False
            )
        except FileNotFoundError:  # nothing started: a submission through it was not made
            raise NotSubmitted(
                f"`{argv[0]}` not found on this machine: the slurm backend runs on a Slurm login "
                "node (use the ssh backend to submit through one, or backend=local to run the "
                "ranks here: `ringctl example` shows each job's settings)"
            ) from None
        except subprocess.TimeoutExpired:
            raise UserError(f"`{argv[0]}` did not answer within {timeout:.0f}s") from None
        return proc.returncode, proc.stdout, proc.stderr

    def read_from(
        self, path: str, offset: int = 0, *, limit: int = READ_LIMIT, tail: bool = False
    ) -> bytes | None:
        try:
            f = open_regular(path)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except ValueError as err:
            raise UserError(f"{err}: not read") from None
        with f:
            return read_range(f, os.fstat(f.fileno()).st_size, offset, limit, tail)

    def listdir(self, path: str) -> list[str]:
        try:
            return os.listdir(path)
        except (FileNotFoundError, NotADirectoryError):
            return []

    def file_sizes(self, path: str) -> dict[str, int]:
        try:
            with os.scandir(path) as entries:
                found = {e.name: e.stat(follow_symlinks=False) for e in entries}
        except (FileNotFoundError, NotADirectoryError):
            return {}
        return {name: st.st_size for name, st in found.items() if stat.S_ISREG(st.st_mode)}
