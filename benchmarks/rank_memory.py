"""One rank of a local job with its memory recorded: the interpreter a benchmark gives the local
backend (``env.python``), so that every rank's peak RSS is measured exactly, from outside.

The local supervisor starts ``ENV_PYTHON -m ringctl.worker JOB_DIR`` for each rank, in the job
directory; with ENV_PYTHON a shim (``write_shim``) that calls ``main`` here, that command runs
as this process's only child (same interpreter, same environment). When rank 0's log says that
scoring began (``MARK``: the job's "longdoc: mode=..." line, after the model is loaded and the
probe has passed), the child's resident set is read and its peak reset (/proc/PID/clear_refs
"5"); at its exit, wait4 gives its peak since then (ru_maxrss, which the reset lowers too).
Written to logs/rank-<RANK>.memory.json:

    peak_kib          the rank's peak over its whole life (model, probe, scoring)
    at_mark_kib       its RSS when scoring began (None: the mark never came)
    scoring_peak_kib  its peak from then on (None: the mark never came, or the reset failed)
    cpu_s             its user + system CPU seconds over its whole life
    cpu_at_mark_s     those spent before the mark (what follows is scoring and writing)

The mark is seen within ``POLL_S`` of rank 0 logging it. Signals the supervisor sends (SIGTERM,
SIGINT, SIGUSR1) are passed on; the child dies with this process (PR_SET_PDEATHSIG), as the
supervisor's own children do; the exit status is the child's.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

MARK = b"] longdoc: mode="
POLL_S = 0.05
PR_SET_PDEATHSIG = 1


def write_shim(path: Path) -> Path:
    """An executable that runs ``main`` with this interpreter (for ``env.python=PATH``)."""
    root = Path(__file__).resolve().parents[1]
    path.write_text(
        f"#!{sys.executable}\n"
        "import sys\n"
        f"sys.path.insert(0, {str(root)!r})\n"
        "from benchmarks.rank_memory import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    path.chmod(0o755)
    return path


def _die_with_parent() -> None:
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _status_kib(pid: int, field: str) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


class _Mark:
    """Watches rank 0's log for MARK, reading only what was appended since the last look."""

    def __init__(self, log: Path) -> None:
        self.log, self.offset, self.tail = log, 0, b""

    def seen(self) -> bool:
        try:
            with open(self.log, "rb") as f:
                f.seek(self.offset)
                new = f.read()
        except OSError:
            return False
        self.offset += len(new)
        text, self.tail = self.tail + new, (self.tail + new)[-len(MARK) :]
        return MARK in text


def _cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of a process so far (/proc/PID/stat fields 14 and 15)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _at_mark(pid: int, record: dict) -> None:
    """Read the child's RSS, its peak so far and its CPU time, then reset the peak."""
    record["peak_before_mark_kib"] = _status_kib(pid, "VmHWM")
    record["at_mark_kib"] = _status_kib(pid, "VmRSS")
    record["cpu_at_mark_s"] = _cpu_s(pid)
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
        record["reset"] = True
    except OSError as err:
        record["reset_error"] = str(err)


def _watch(child: subprocess.Popen, record: dict, mark: _Mark) -> tuple[int, object]:
    """Until the child exits: the mark, then (wait status, the child's rusage)."""
    while True:
        pid, status, usage = os.wait4(child.pid, os.WNOHANG)
        if pid:
            return status, usage
        if "at_mark_kib" not in record and mark.seen():
            _at_mark(child.pid, record)
        time.sleep(POLL_S)


def main(argv: list[str]) -> int:
    rank = os.environ.get("RANK", "unknown")
    child = subprocess.Popen([sys.executable, *argv], preexec_fn=_die_with_parent)
    reaped = [False]

    def forward(signum, frame):
        if not reaped[0]:
            os.kill(child.pid, signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
        signal.signal(sig, forward)
    record: dict = {"rank": rank, "pid": child.pid}
    status, usage = _watch(child, record, _Mark(Path("logs") / "rank-0.out"))
    reaped[0] = True
    maxrss = usage.ru_maxrss
    record["cpu_s"] = usage.ru_utime + usage.ru_stime
    marked = record.get("reset", False)
    record["peak_kib"] = max(maxrss, record.get("peak_before_mark_kib") or 0)
    record["scoring_peak_kib"] = max(maxrss, record.get("at_mark_kib") or 0) if marked else None
    record.setdefault("at_mark_kib", None)
    out = Path("logs") / f"rank-{rank}.memory.json"
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    tmp.replace(out)
    code = os.waitstatus_to_exitcode(status)
    if code < 0:  # killed by a signal: end the same way, so the supervisor sees it
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
