"""Where a gather writes: one owner of its output directory, for every task's gather step.

A gather's OUT is written whole or not at all: it is filled in a temporary directory beside
it (``new_output_dir``) and renamed into place (``put_in_place``: an earlier output is moved
aside first and removed only once the new one is in), under a lock on OUT's folder
(``beside``), so that a temporary left beside OUT is a killed gather's, which the next gather
removes or puts back (``recover_killed``). OUT holds a marker file (``MARKER``): ``--force``
replaces only an earlier gather output (``check_target``), and a ``--partial`` output is
replaced by a later gather of the same job (its resolved path: an earlier release's marker of
a path as typed matches where that was the resolved one) without it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from .atomic import current_umask
from .bounded_read import read_regular
from .errors import UserError
from .jobdir import job_entry_under

MARKER = ".ringctl-gather"
MARKER_FORMAT = "ringctl.gather/1"


def confined(path: Path, base: Path) -> bool:
    """Whether path, symlinks resolved, is base or below it (resolved too)."""
    try:
        path.resolve().relative_to(base.resolve())
    except (ValueError, OSError, RuntimeError):  # outside; or a symlink loop
        return False
    return True


def write_marker(out: Path, job: Path, task: str, partial: bool) -> None:
    """The marker of a gather output (``marker_of`` reads it back); the job's directory
    resolved, so that "the same job" does not depend on how it was typed."""
    marker = {
        "format": MARKER_FORMAT,
        "job_dir": str(Path(job).resolve()),
        "task": task,
        "partial": partial,
    }
    (out / MARKER).write_text(json.dumps(marker) + "\n")


MAX_MARKER_BYTES = 1 << 16  # four short fields


def marker_of(path: Path) -> dict | None:
    """The marker of an earlier gather output in path (None: not one)."""
    marker = path / MARKER
    if marker.is_symlink() or not marker.is_file():
        return None
    try:
        data = json.loads(read_regular(marker, MAX_MARKER_BYTES))
    except (OSError, ValueError, RecursionError):  # not one written here: not a gather output
        return None
    return data if isinstance(data, dict) and data.get("format") == MARKER_FORMAT else None


def is_gather_output(path: Path) -> bool:
    return marker_of(path) is not None


def is_partial_output(path: Path, job: Path | None = None) -> bool:
    """Whether path is an earlier --partial output (a real directory whose marker says
    partial) of ``job`` (given): ours to replace by a later gather of the same job, without
    --force (another job's partial output under the same -o is not)."""
    if path.is_symlink() or not path.is_dir():
        return False
    marker = marker_of(path)
    if marker is None or marker.get("partial") is not True:
        return False
    return job is None or marker.get("job_dir") == str(Path(job).resolve())


def check_target(target: Path, job: Path, *, force: bool) -> None:
    """Refuse, in one line, an `out` gather may not write or replace."""
    if confined(job, target):
        raise UserError(f"{target}: holds the job directory {job}; choose another -o")
    entry = job_entry_under(target, job)
    if entry is not None:
        raise UserError(f"{target}: inside the job's own {entry}; choose another -o")
    if not os.path.lexists(target):
        return
    if not force and is_partial_output(target, job):
        return  # an earlier partial gather of this job: a later one replaces it
    if not force:
        raise UserError(f"{target} exists already; remove it or pass --force to replace it")
    if target.is_symlink() or not target.is_dir():
        kind = "a symlink" if target.is_symlink() else "not a directory"
        raise UserError(f"{target} is {kind}; --force replaces only an earlier gather output")
    if any(target.iterdir()) and not is_gather_output(target):
        raise UserError(
            f"{target} is not an earlier gather output (no {MARKER} in it); --force replaces "
            "only those: remove it yourself or choose another -o"
        )


@contextlib.contextmanager
def beside(target: Path) -> Iterator[bool]:
    """Hold the lock of target's folder (an flock: the kernel drops it when the holder dies)
    while a gather makes, fills and swaps in its temporary directory there, so that any
    temporary left beside target while the lock is held is a killed gather's. Yields whether
    it is held (False where the file system has no flock: then nothing is cleaned up)."""
    try:
        fd = os.open(target.parent, os.O_RDONLY | os.O_DIRECTORY)
    except FileNotFoundError:
        yield False  # no folder: no leftovers either
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # another gather into this folder: wait for it
        except OSError:
            yield False
            return
        yield True
    finally:
        os.close(fd)


def leftovers(target: Path) -> list[Path]:
    """A killed gather's directories beside target: ``.OUT.tmp-*`` (its unfinished output)
    and ``.OUT.replaced-*`` (an earlier output it moved aside), as ``tempfile`` names them;
    real directories only."""
    pattern = re.compile(rf"\.{re.escape(target.name)}\.(tmp|replaced)-[a-z0-9_]{{8}}")
    found = [p for p in target.parent.iterdir() if pattern.fullmatch(p.name)]
    return sorted(
        (p for p in found if p.is_dir() and not p.is_symlink()), key=lambda p: p.stat().st_mtime
    )


def recover_killed(target: Path) -> list[str]:
    """Undo what a gather killed while writing target left (notes saying what was done): an
    earlier output it had moved aside is put back when target is missing (the newest such),
    else removed, as is its unfinished output. A directory of that name that is neither an
    earlier gather output nor empty is not ours: left as it is."""
    notes: list[str] = []
    with beside(target) as held:
        if not held:
            return notes
        for path in leftovers(target)[::-1]:  # newest first
            ours = is_gather_output(path) or not any(path.iterdir())
            if ".replaced-" in path.name and ours and not os.path.lexists(target):
                os.rename(path, target)
                notes.append(f"{target}: put back (a gather was killed while replacing it)")
            elif ".tmp-" in path.name or ours:
                shutil.rmtree(path, ignore_errors=True)
                notes.append(f"{path}: removed (left by a gather that was killed)")
    return notes


def new_output_dir(target: Path) -> Path:
    """A temporary directory beside target, with the permissions the umask gives."""
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.tmp-"))
    tmp.chmod(0o777 & ~current_umask())
    return tmp


def put_in_place(tmp: Path, target: Path) -> None:
    """Rename tmp to target; an earlier output (checked by check_target) is moved aside first
    and deleted only once the new one is in place."""
    if not target.exists():
        os.rename(tmp, target)
        return
    old = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.replaced-"))
    os.rename(target, old)  # replaces the empty directory just made
    try:
        os.rename(tmp, target)
    except BaseException:
        os.rename(old, target)
        raise
    shutil.rmtree(old, ignore_errors=True)
