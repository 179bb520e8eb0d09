"""Files that exist whole or not at all: a killed job never leaves a half file that looks whole.

Write to a temporary file in the same directory, fsync, then rename over the target (rename
is atomic within a filesystem). A killed process never leaves a half file; a machine that
crashes may come back with a rename undone unless the directory is synced too (``fsync_dir``,
which a checkpoint's publication calls: a sync per progress record would cost a metadata
server's round trip on a cluster's shared filesystem). The temporary file is
made by mkstemp, which creates it 0600; before the rename it gets the mode a plain `open`
would give (0666 less the umask), so shards, manifests and control files are as readable as
the user's other files (group-shared project directories), and private under umask 077.

A write that fails (disk full, quota, read-only file system) raises OSError with the target's
path as its filename: the command line reports it in one line naming the file.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from .errors import with_filename

__all__ = [
    "atomic_write",
    "atomic_write_json",
    "current_umask",
    "default_dir_mode",
    "default_file_mode",
    "fsync_dir",
]


def current_umask() -> int:
    """The process's umask, read without changing it where Linux says it (/proc, since 4.7);
    elsewhere set and restored at once (the only portable way)."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def default_file_mode() -> int:
    """The mode `open(path, "w")` gives a new file: 0666 less the umask."""
    return 0o666 & ~current_umask()


def default_dir_mode() -> int:
    """The mode `mkdir` gives a new directory (0777 less the umask); also that of an executable
    such as job.sh, which holds env.vars (tokens): private under umask 077."""
    return 0o777 & ~current_umask()


def fsync_dir(path: str | Path) -> None:
    """Make the entries of directory ``path`` (a rename into it) durable. Best effort: some
    filesystems refuse fsync on a directory (EINVAL), where there is nothing more to do."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path: str | Path, data: bytes | str) -> Path:
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as err:
        raise with_filename(err, path.parent) from None
    try:
        with os.fdopen(fd, "wb") as fh:
            os.fchmod(fh.fileno(), default_file_mode())
            fh.write(data.encode() if isinstance(data, str) else data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException as err:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(err, OSError):
            raise with_filename(err, path) from None
        raise
    return path


def atomic_write_json(path: str | Path, obj: Any, *, indent: int = 2) -> Path:
    return atomic_write(path, json.dumps(obj, indent=indent, sort_keys=True) + "\n")
