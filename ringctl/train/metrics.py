"""``logs/metrics.jsonl`` of a training job: one owner that writes, reads and validates it.

Rank 0 appends one object per optimizer step (``FIELDS``), flushed at once, so ``ringctl
status`` and a user's ``tail -f`` see the run as it goes. Each checkpoint keeps a copy of the
file as it stood (``checkpoint.py``); a resume starts the file again from that copy
(``restore``), so steps redone after a kill are written once and the file is one run's history
(a resume also moves ``logs/`` to ``attempts/``). Read back as hostile input (the job
directory may be a remote copy): bounded lines, only the known fields, finite numbers; a bad
line is skipped and counted, never a traceback.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from ..atomic import atomic_write
from ..bounded_read import regular_file

MAX_LINE = 4096  # bytes: a record is about 200


@dataclass(frozen=True)
class StepMetrics:
    step: int  # 1-based: the step just taken
    loss: float  # mean over the step's predicted tokens
    tokens: int  # predicted tokens in the step
    lr: float  # the learning rate the step used
    grad_norm: float  # before clipping
    tokens_per_s: float  # predicted tokens / seconds
    seconds: float  # wall time of the step


FIELDS = tuple(StepMetrics.__dataclass_fields__)


def append(path: Path, record: StepMetrics) -> None:
    """One line per step (rank 0), written and flushed before the next step starts."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(asdict(record), allow_nan=False) + "\n")
        f.flush()


def read(path: Path) -> tuple[list[StepMetrics], int]:
    """(the valid records in file order, how many lines were not), [] for a missing file."""
    if not os.path.lexists(path):
        return [], 0
    regular_file(path)  # not a link, a device or a pipe: ValueError naming it
    good, bad = [], 0
    with open(path, "rb") as f:
        while raw := f.readline(MAX_LINE + 1):
            if len(raw) > MAX_LINE:  # read no more of an overlong line than the limit
                while raw and not raw.endswith(b"\n"):
                    raw = f.readline(MAX_LINE + 1)
                bad += 1
                continue
            record = _parse(raw)
            if record is None:
                bad += raw.strip() != b""
            else:
                good.append(record)
    return good, bad


def _parse(raw: bytes) -> StepMetrics | None:
    if len(raw) > MAX_LINE:
        return None
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    if not isinstance(data, dict) or set(data) != set(FIELDS):
        return None
    ints = ("step", "tokens")
    for key in FIELDS:
        value = data[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return None
        if key in ints and (not isinstance(value, int) or value < 0):
            return None
        if not math.isfinite(value):
            return None
    return StepMetrics(**data)


def one_run(records: list[StepMetrics], step: int) -> list[StepMetrics] | None:
    """The records of one run's steps 1, 2, ..., ``step`` in order, each once (None: there
    are none): from the last record of a step 1 on, so a history that a rerun started again
    from step 1 (a Slurm requeue before the first checkpoint, by an earlier release) gives
    its last run; a line appended twice, lines reordered or cut give none."""
    starts = [i for i, r in enumerate(records) if r.step == 1]
    tail = records[starts[-1] :] if starts else []
    return tail if [r.step for r in tail] == list(range(1, step + 1)) else None


def restore(path: Path, saved: Path | None) -> None:
    """``path`` becomes the history ``saved`` (a checkpoint's copy), steps after it dropped;
    an empty history for ``saved=None`` (a run starting at step 1)."""
    records, _ = read(saved) if saved is not None else ([], 0)
    atomic_write(path, "".join(json.dumps(asdict(r)) + "\n" for r in records))
