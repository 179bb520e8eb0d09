"""Reading a file that may be hostile: a regular file, not through a link, and no more of it
than a limit. A checkpoint's pointer or state, or a job's metrics, may have been written by
anyone who could write the job's directory (on a cluster, any of its nodes): a symlink to
/dev/zero or a FIFO would hang a plain read, one to another file would read outside.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path


def regular_file(path: Path) -> os.stat_result:
    """``path``'s own status (not a link's target); ValueError unless it is a regular file."""
    try:
        info = path.lstat()
    except OSError as err:
        raise ValueError(f"{path}: cannot be read ({err.strerror})") from None
    if not stat.S_ISREG(info.st_mode):
        raise ValueError(f"{path}: not a regular file (a link, a device, a pipe or a folder)")
    return info


def open_regular(path: str | Path):
    """``path`` opened for reading as a regular file: not through a link, without blocking on
    a pipe (ValueError naming it otherwise; FileNotFoundError when it does not exist)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        raise
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise ValueError(f"{path}: a link, not followed (not a regular file)") from None
        raise ValueError(f"{path}: cannot be read ({err.strerror})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):  # before fdopen, which refuses a folder itself
        os.close(fd)
        raise ValueError(f"{path}: not a regular file (a device, a pipe or a folder)")
    return os.fdopen(fd, "rb")


def open_input(path: str | Path):
    """A file a job's input names (a link given is followed: resolved first), opened as
    ``open_regular`` opens it, and a ValueError naming it otherwise. A pipe swapped in for a
    listed record file after the listing blocked the reading rank forever."""
    return open_regular(Path(path).resolve())


def read_regular(path: Path, limit: int) -> bytes:
    """The bytes of the regular file ``path`` (opened without following a link, and without
    blocking on a pipe), ValueError where it is not one or is longer than ``limit``."""
    try:
        f = open_regular(path)
    except FileNotFoundError as err:
        raise ValueError(f"{path}: cannot be read ({err.strerror})") from None
    with f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"{path}: longer than {limit} bytes")
    return data


def read_window(size: int, offset: int, limit: int, tail: bool) -> tuple[int, int]:
    """(start, count) of what to read of a file of ``size`` bytes: at most ``limit`` bytes
    from ``offset`` on, or (tail) its last ``limit`` bytes past ``offset``."""
    start = max(offset, size - limit) if tail else offset
    return start, max(0, min(limit, size - start))


def read_range(f, size: int, offset: int, limit: int, tail: bool) -> bytes:
    """The ``read_window`` of an open file of ``size`` bytes."""
    start, count = read_window(size, offset, limit, tail)
    f.seek(start)
    return f.read(count)
