"""Progress records of a running job: ``logs/progress.json`` (rank 0's counts) and
``logs/rings/<label>.json`` (each ring's, written by its lead). One owner: the worker builds
the job's record with ``progress_record`` (``TaskContext.progress``), a ring's lead its ring's
with ``ring_record``, both write them with ``write_record``, and ``ringctl status`` reads them
with ``read_record``.

An ssh job's copies are fetched from the login node, so each field is checked before `status`
passes it on, and what is wrong becomes null with a note, never a crash.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .atomic import atomic_write_json
from .bounded_read import read_regular
from .jsonsafe import finite_json, whole_number
from .text import cut

if TYPE_CHECKING:
    from .backends.shell import Shell

COUNT_FIELDS = ("done", "total", "before", "checkpoint")  # checkpoint: a training job's step
NUMBER_FIELDS = ("elapsed_s", "rate", "eta_s", "updated_at", "tokens_per_s", "loss")
TEXT_FIELDS = ("unit", "current")  # current: where a long document's forward is (longdoc)


def progress_record(
    done: int,
    total: int,
    unit: str,
    before: int,
    elapsed: float,
    rate: float,
    eta: float | None,
    **extra: Any,
) -> dict:
    """What a progress file holds (``read_record`` reads it back)."""
    return {
        "done": done,
        "total": total,
        "unit": unit,
        "before": before,
        "elapsed_s": elapsed,
        "rate": rate,
        "eta_s": eta,
        "updated_at": time.time(),
        **extra,
    }


def ring_record(done: int, total: int, members: list[int], **extra: Any) -> dict:
    """What a ring's progress file holds: its documents done and in all, its job ranks (and
    ``before``: the job's documents done by earlier attempts, in no ring's count)."""
    return {"done": done, "total": total, "members": members, "updated_at": time.time(), **extra}


def write_record(path: Path, record: dict) -> None:
    """A progress file, replaced whole (a reader never sees half a record)."""
    atomic_write_json(path, record)


def _is_count(value) -> bool:
    return whole_number(value)


def _is_number(value) -> bool:
    """A non-negative number: every NUMBER_FIELDS value is a duration, a rate, a time or a
    loss (an ETA of -3 h or -5e18 tokens/s was shown as it came)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0


def _field_problem(key: str, value) -> str:
    """Why a known field's value cannot be shown ("" when it can)."""
    if value is None:
        return ""
    if key in COUNT_FIELDS and not _is_count(value):
        return "not a count"
    if key in NUMBER_FIELDS and not _is_number(value):
        return "not a number >= 0"
    if key in TEXT_FIELDS and not isinstance(value, str):
        return "not a string"
    if key == "members" and not (isinstance(value, list) and all(map(_is_count, value))):
        return "not a list of ranks"
    return ""


def checked_progress(record, where: str, notes: list[str]) -> dict | None:
    """A progress record whose known fields have their types (a wrong or non-finite value
    becomes None, and notes says so); None, with a note, without counts to show."""
    if not isinstance(record, dict):
        notes.append(f"{where}: not a JSON object; ignored")
        return None
    clean, replaced = finite_json(record)
    notes += [f"{where}: {key}: not a finite number; shown as null" for key in replaced]
    for key, value in clean.items():
        problem = _field_problem(key, value)
        if problem:
            notes.append(f"{where}: {key}={cut(repr(value), 40)}: {problem}; shown as null")
            clean[key] = None
    if clean.get("done") is None or clean.get("total") is None:
        notes.append(f"{where}: no done/total counts; progress not shown")
        return None
    if clean["done"] > clean["total"]:
        notes.append(f"{where}: done {clean['done']} > total {clean['total']}; not shown")
        return None
    return clean


MAX_PROGRESS_BYTES = 1 << 20  # a progress record: a few hundred bytes


def read_record(path: Path, notes: list[str]) -> dict | None:
    """A progress file, checked (None when absent: a job that has not reported yet). A file
    nested too deeply for the parser, or for the checks, is ignored with a note: the job, or
    anyone who can write an ssh job's remote directory, writes these files."""
    if not os.path.lexists(path):
        return None
    try:  # a regular file within a limit: a FIFO there hung `status` (and --root's listing)
        raw = read_regular(path, MAX_PROGRESS_BYTES)
    except (OSError, ValueError) as err:
        notes.append(f"{path}: not readable ({cut(err)}); ignored")
        return None
    return parse_record(raw, str(path), notes)


def read_shell_record(shell: Shell, path: str, notes: list[str]) -> dict | None:
    """A progress file read through a backend's shell (``read_record``'s checks): on this
    machine, or an ssh job's own copy on the login node, which the job is writing (the local
    copy is as old as the last fetch: a finished job read "290/300 steps"). A UserError (a
    lost connection, a file that is not a regular one) is the caller's."""
    raw = shell.read_from(path, limit=MAX_PROGRESS_BYTES + 1)
    if raw is None:
        return None
    if len(raw) > MAX_PROGRESS_BYTES:
        notes.append(f"{path}: longer than {MAX_PROGRESS_BYTES} bytes; ignored")
        return None
    return parse_record(raw, path, notes)


def parse_record(raw: bytes, where: str, notes: list[str]) -> dict | None:
    """The bytes of a progress file, checked (``checked_progress``); None with a note when
    they are not JSON, or nested too deeply for the parser or the checks."""
    try:
        return checked_progress(json.loads(raw), where, notes)
    except ValueError as err:
        notes.append(f"{where}: not readable JSON ({cut(err)}); ignored")
    except RecursionError:
        notes.append(f"{where}: nested too deeply to read; ignored")
    return None
