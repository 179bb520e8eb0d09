"""Reading a job's logs, for every backend: listing them, following them as they grow, and
finding the line in which a failed rank says why.

Everything goes through a `Shell`'s `read_from`/`listdir`, so the same code reads a local job
directory and a job directory on a login node over SFTP: the same failure reads the same
everywhere.
"""

from __future__ import annotations

import json
import re
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from ..errors import WORKER_ERROR_PREFIX, UserError
from ..jobdir import FAILED_MARK, LOGS, RESULT, rank_log_file, rank_log_name, rank_stream_of
from ..topology.nodes import NODE_NAME
from .shell import READ_LIMIT, Shell

_ERROR_LINE = re.compile(r"^\s*([A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit)\b.*)$")
_TAIL_BYTES = 64 * 1024
_RESULT_BYTES = 1 << 20  # a rank's result.json: its error and a few counts


@dataclass(frozen=True)
class LogSource:
    """A job directory's logs as a shell sees them."""

    shell: Shell
    job_dir: str  # the directory's path for the shell
    batch_log: str | None = None  # relative to job_dir, e.g. logs/batch-42.out

    def files(self, rank: int | None) -> list[tuple[str, str]]:
        """(path, line prefix) of the logs to show: the batch log first, then each rank's
        .out before its .err, ranks in order; without a prefix when one rank is asked for."""
        found = []
        for name in self.shell.listdir(f"{self.job_dir}/{LOGS}"):
            stream = rank_stream_of(name)
            if stream and (rank is None or stream[0] == rank):
                found.append((stream[0], stream[1] != "out", name))
        files = []
        if rank is None and self.batch_log:
            files.append((f"{self.job_dir}/{self.batch_log}", "[batch] "))
        for r, _, name in sorted(found):
            prefix = "" if rank is not None else f"[rank {r}] "
            files.append((f"{self.job_dir}/{LOGS}/{name}", prefix))
        return files


def _decode(data: bytes) -> str:
    return data.decode("utf-8", errors="replace").rstrip("\r")


def _pieces(shell: Shell, path: str, offset: int = 0) -> Iterator[bytes]:
    """A log's bytes from ``offset`` to its end, in reads of at most READ_LIMIT."""
    while True:
        data = shell.read_from(path, offset) or b""
        if data:
            yield data
        if len(data) < READ_LIMIT:
            return
        offset += len(data)


def read_logs(source: LogSource, rank: int | None) -> Iterator[str]:
    """Every line of the logs to show. A log that cannot be read (a link, a FIFO: the job
    writes its directory) is one line saying so, and the logs after it are still shown."""
    for path, prefix in source.files(rank):
        rest = b""
        try:
            for data in _pieces(source.shell, path):
                whole, sep, rest = (rest + data).rpartition(b"\n")
                for line in (whole + sep).decode("utf-8", errors="replace").splitlines():
                    yield prefix + line
        except UserError as err:
            yield prefix + _not_shown(err)
            continue
        for line in rest.decode("utf-8", errors="replace").splitlines():
            yield prefix + line


def _not_shown(err: UserError) -> str:
    return f"(log not shown: {err})"


TRUNCATED = "(log truncated: from its start again)"


def follow_logs(
    source: LogSource, rank: int | None, is_finished: Callable[[], bool], *, poll_s: float = 0.5
) -> Iterator[str]:
    """Yield whole lines as they are written until the job is finished; a last unterminated
    line comes out at the end. The state is read before each pass, so nothing is missed. A log
    cut shorter than what was shown (truncated, or replaced by a new file) is read from its
    start again, after a line saying so, as `tail -F` does; one that cannot be read is a line
    saying so, once."""
    offsets: dict[str, int] = {}
    partial: dict[str, bytes] = {}
    unreadable: set[str] = set()

    def drain(final: bool) -> Iterator[str]:
        sizes = _listed_sizes(source)
        for path, prefix in source.files(rank):
            if path in unreadable:
                continue
            size = sizes.get(path)
            unchanged = size is not None and size == offsets.get(path, 0)
            if unchanged and not (final and partial.get(path)):
                continue  # listed as it was: nothing new to read (two reads a log a poll)
            try:
                data, rewound = _new_bytes(source.shell, path, offsets.get(path, 0), size)
            except UserError as err:
                unreadable.add(path)
                yield prefix + _not_shown(err)
                continue
            if rewound:
                offsets[path], partial[path] = 0, b""
                yield prefix + TRUNCATED
            if not data and not (final and partial.get(path)):
                continue
            offsets[path] = offsets.get(path, 0) + len(data)
            *lines, rest = (partial.get(path, b"") + data).split(b"\n")
            if final and rest:
                lines.append(rest)
                rest = b""
            partial[path] = rest
            for line in lines:
                yield prefix + _decode(line)

    while True:
        done = is_finished()
        yield from drain(final=done)
        if done:
            return
        time.sleep(poll_s)


def _new_bytes(shell: Shell, path: str, offset: int, size: int | None = None) -> tuple[bytes, bool]:
    """(the log's bytes past ``offset``, whether it was cut shorter than ``offset`` and these
    are its bytes from the start). ``size``: its size as listed this pass (a shorter one was
    cut). Without it, only a pass that finds nothing new asks whether the byte before
    ``offset`` still exists: one small read, where a file that is growing costs none."""
    if size is not None and size < offset:
        return b"".join(_pieces(shell, path, 0)), True
    data = b"".join(_pieces(shell, path, offset))
    if data or offset == 0 or shell.read_from(path, offset - 1, limit=1):
        return data, False
    return b"".join(_pieces(shell, path, 0)), True


def _listed_sizes(source: LogSource) -> dict[str, int]:
    """{path: size} of the regular files in the logs folder (the batch log's too), from one
    listing a poll: a follower of 512 ranks read each of 1,024 logs twice a poll (over SFTP
    about five round trips each)."""
    folder = f"{source.job_dir}/{LOGS}"
    try:
        return {f"{folder}/{name}": size for name, size in source.shell.file_sizes(folder).items()}
    except UserError:
        return {}  # the listing is refused: each log is read (and says why)


# A progress bar's frame (tqdm's "Loading weights: 100%|####| 2/2 [00:00<00:00, 3.1it/s]",
# redrawn after a carriage return, which splitlines() splits on): how far something got.
_PROGRESS_BAR = re.compile(r"\d%\||\d+/\d+ \[\d+:\d\d|\d(it/s|s/it)\]")


def is_progress_bar(line: str) -> bool:
    """Is this line a progress bar's frame? It never says why a rank failed."""
    return _PROGRESS_BAR.search(line) is not None


def killed_by(signum: int) -> str:
    """`killed by signal 9 (SIGKILL)`: how a process that a signal ended ended."""
    try:
        name = f" ({signal.Signals(signum).name})"
    except ValueError:
        name = ""
    return f"killed by signal {signum}{name}"


def signal_named(words: str) -> int | None:
    """The signal whose description (strsignal: "Killed", "Segmentation fault") `words` is, as
    srun reports a task a signal ended; None for other words ("Exited with exit code 1")."""
    for sig in signal.Signals:
        if signal.strsignal(sig) == words.strip():
            return int(sig)
    return None


def error_summary(stderr_text: str, limit: int = 300) -> str:
    """The line that names the error in a rank's stderr: the last `SomethingError: ...` line,
    else the last non-empty line that is not a progress bar."""
    lines = [
        ln.rstrip() for ln in stderr_text.splitlines() if ln.strip() and not is_progress_bar(ln)
    ]
    for ln in reversed(lines):
        m = _ERROR_LINE.match(ln)
        if m:
            return m.group(1)[:limit]
    return lines[-1].strip()[:limit] if lines else ""


# What a rank says when a peer went away: the effect of another rank's failure, never its cause.
PEER_LOSS = (
    "connection reset by peer",
    "connection closed by peer",
    "broken pipe",
    "connection refused",
    "socket closed",
    "remote process exited",
    "communicator was aborted",
)


def is_peer_loss(error: str) -> bool:
    """Does this error only say that another rank left (gloo's resets, NCCL's aborts)?"""
    text = error.lower()
    return any(marker in text for marker in PEER_LOSS)


def rank_error(shell: Shell, job_dir: str, rank: int, limit: int = 300) -> str:
    """Why rank (launch index) `rank` failed, in one line: its result file's error, else the
    worker's `ringctl.worker: ` line, else the last error-looking line of its stderr. Where
    the result says the rank took another place in the ring (placement reorders nodes), the
    line starts with it: status named launch index 5 while the rank's own lines said ring
    rank 2."""
    raw = shell.read_from(f"{job_dir}/{rank_log_name(rank, RESULT)}", 0, limit=_RESULT_BYTES)
    if raw:
        try:
            record = json.loads(raw.decode("utf-8", errors="replace"))
            error = record.get("error")
        except (json.JSONDecodeError, AttributeError, RecursionError):
            record, error = {}, None
        if error:
            return (_ring_place(record, rank) + " ".join(str(error).split()))[:limit]
    err = f"{job_dir}/{rank_log_name(rank, 'err')}"
    data = shell.read_from(err, 0, limit=_TAIL_BYTES, tail=True) or b""
    stderr = data.decode("utf-8", errors="replace")
    for line in reversed(stderr.splitlines()):
        if line.startswith(WORKER_ERROR_PREFIX):
            return line[len(WORKER_ERROR_PREFIX) :].strip()[:limit]
    return error_summary(stderr, limit)


def _ring_place(record: dict, rank: int) -> str:
    """ "ring rank R on NODE: " where a result records a ring rank other than its launch index."""
    ring_rank, node = record.get("rank"), record.get("node")
    if not isinstance(ring_rank, int) or isinstance(ring_rank, bool) or ring_rank == rank:
        return ""
    where = f" on {node}" if isinstance(node, str) and NODE_NAME.fullmatch(node) else ""
    return f"ring rank {ring_rank}{where}: "


@dataclass(frozen=True)
class ResultListing:
    """What one listing of logs/ says of the ranks' ends (launch indices, ascending)."""

    missing: list[int]  # no logs/rank-<R>.result.json
    failed: list[int]  # logs/rank-<R>.failed: the worker recorded a failure


def list_results(shell: Shell, job_dir: str, world_size: int) -> ResultListing:
    """Which of launch indices 0..world_size-1 left no result, and which recorded a failure.

    Every rank that runs the worker to its end writes a result (worker.py), also when it
    fails, and a failed rank writes its `.failed` mark first. A rank that exits 0 without a
    result never ran the job (`env.python=/bin/true`, a wrapper that swallowed it); one that
    exits 0 with the mark failed under a wrapper that swallowed its exit: neither makes a
    COMPLETED job. One listing, not one read per rank: over SSH each read is a round trip."""
    names = set(shell.listdir(f"{job_dir}/{LOGS}"))
    ranks = range(world_size)
    return ResultListing(
        missing=[r for r in ranks if rank_log_file(r, RESULT) not in names],
        failed=[r for r in ranks if rank_log_file(r, FAILED_MARK) in names],
    )


# What a rank says when a collective it waited in timed out (gloo's, NCCL's watchdog): that
# it waited, not for whom. The rank it waited for hung, or died without a word.
WAIT_TIMEOUT = ("timed out waiting", "collective operation timeout")


def waited_for(
    error: str, blamed: int, world: int, listing: Callable[[], ResultListing], shown: int = 8
) -> str:
    """For rank ``blamed``'s failure that says a collective timed out: the other ranks that
    left neither a result nor a failure mark (hung, then killed; or dead without a word),
    which the reason named none of (a hang on rank 2 read "rank 3 ... Timed out waiting",
    rank 3 its peer waiting on it): "; rank 2 recorded no failure: ...". "" for any other
    error, where no other rank is quiet, or where every other one is (NCCL's watchdog kills
    each rank that timed out before it writes a word: that names no one)."""
    if world < 2 or not any(marker in error.lower() for marker in WAIT_TIMEOUT):
        return ""
    found = listing()
    quiet = [r for r in found.missing if r not in found.failed and r != blamed]
    if not quiet or len(quiet) >= world - 1:
        return ""
    names = ", ".join(str(r) for r in quiet[:shown])
    more = f" and {len(quiet) - shown} more" if len(quiet) > shown else ""
    which = f"rank {names}" if len(quiet) == 1 else f"ranks {names}{more}"
    return (
        f"; {which} recorded no failure (hung, or killed without a word): likely what it waited for"
    )


def no_result_reason(missing: list[int], world_size: int, shown: int = 8) -> str:
    """The one-line reason of a job whose ranks `missing` ended without a result."""
    names = ", ".join(str(r) for r in missing[:shown])
    more = f" and {len(missing) - shown} more" if len(missing) > shown else ""
    which = f"rank {names}" if len(missing) == 1 else f"ranks {names}{more}"
    return (
        f"{which} (of {world_size}) ended without a result (logs/rank-<R>.result.json): the "
        "worker did not run to its end; check env.python and the rank logs"
    )
