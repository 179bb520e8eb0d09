"""Reading and following a job's logs (backends/joblogs.py) on real files through LocalShell.

The job writes its own logs/ folder: a log may be cut short while followed, or be a link or a
FIFO. Each case here was reproduced before its fix (a truncated log followed showed nothing
until it outgrew its old length; one unreadable log ended `logs` for every rank after it)."""

from __future__ import annotations

import os
from pathlib import Path

from ringctl.backends.joblogs import TRUNCATED, LogSource, follow_logs, read_logs
from ringctl.backends.shell import LocalShell


def _source(job: Path) -> LogSource:
    (job / "logs").mkdir(parents=True, exist_ok=True)
    return LogSource(LocalShell(), str(job))


def _passes(actions):
    """An is_finished for follow_logs: before each pass, the next action; done after them."""
    pending = list(actions)

    def is_finished() -> bool:
        if pending:
            pending.pop(0)()
            return False
        return True

    return is_finished


def test_a_truncated_log_is_followed_from_its_start_again(tmp_path):
    source = _source(tmp_path)
    log = tmp_path / "logs" / "rank-0.out"
    steps = [
        lambda: log.write_text("first line\nsecond line\n"),
        lambda: log.write_text("new\n"),  # truncated to fewer bytes than were shown
        lambda: log.write_text("new\nand more\n"),
    ]
    lines = list(follow_logs(source, 0, _passes(steps), poll_s=0))
    assert lines == ["first line", "second line", TRUNCATED, "new", "and more"]


def test_a_log_that_only_grows_is_never_rewound(tmp_path):
    source = _source(tmp_path)
    log = tmp_path / "logs" / "rank-0.out"
    steps = [lambda: log.write_text("a\n"), lambda: None, lambda: log.write_text("a\nb\n")]
    assert list(follow_logs(source, 0, _passes(steps), poll_s=0)) == ["a", "b"]


def test_an_unreadable_log_is_named_and_the_others_still_shown(tmp_path):
    source = _source(tmp_path)
    logs = tmp_path / "logs"
    os.mkfifo(logs / "rank-0.out")  # read as a file, it blocked `logs` for ever
    (logs / "rank-0.err").symlink_to("/etc/hostname")
    (logs / "rank-1.out").write_text("rank one speaks\n")
    lines = list(read_logs(source, None))
    assert lines[-1] == "[rank 1] rank one speaks"
    assert [ln.split(":")[0] for ln in lines[:2]] == ["[rank 0] (log not shown"] * 2
    assert str(logs / "rank-0.out") in lines[0] or str(logs / "rank-0.out") in lines[1]
    followed = list(follow_logs(source, None, _passes([lambda: None, lambda: None]), poll_s=0))
    assert followed == lines  # each unreadable log named once, not on every pass


def test_a_pass_reads_only_the_logs_that_grew(tmp_path, monkeypatch):
    """(scale review) Following 512 ranks read each of their 1,024 logs twice a poll (its
    new bytes, then whether it was cut): 2,050 reads a pass, over SFTP about five round trips
    each. A pass lists the folder once and reads the logs whose size moved; a cut one is
    still read from its start, said."""
    source = _source(tmp_path)
    logs = tmp_path / "logs"
    for r in range(20):
        (logs / f"rank-{r}.out").write_text(f"rank {r} starts\n")
    reads: list[str] = []
    real = LocalShell.read_from
    monkeypatch.setattr(
        LocalShell,
        "read_from",
        lambda self, path, *a, **k: reads.append(path) or real(self, path, *a, **k),
    )
    counts = []

    def note(action=lambda: None):
        def step():
            counts.append(len(reads))
            action()

        return step

    steps = [
        note(),
        note(),  # nothing written: nothing read
        note(lambda: (logs / "rank-7.out").write_text("rank 7 starts\nrank 7 goes on\n")),
        note(lambda: (logs / "rank-3.out").write_text("cut\n")),
        note(),
    ]
    lines = list(follow_logs(source, None, _passes(steps), poll_s=0))
    per_pass = [b - a for a, b in zip(counts, counts[1:], strict=False)]
    assert per_pass[0] == 20 and per_pass[1] == 0  # the first pass reads all, an idle none
    assert per_pass[2] == 1 and per_pass[3] == 1  # the grown log; the cut one, from its start
    assert "[rank 7] rank 7 goes on" in lines and "[rank 3] " + TRUNCATED in lines
    assert "[rank 3] cut" in lines


def test_a_failed_rank_placed_elsewhere_in_the_ring_says_its_ring_rank(tmp_path):
    """(64-node review, left then) status named a failed rank by its launch index (its log
    files' number, `logs --rank`), while the rank's own lines and errors say its ring rank:
    they differ once placement reorders nodes ("rank 5 exited 1: ... injected fault on rank
    2"). Where they differ, the error starts with the ring rank and its node."""
    import json

    from ringctl.backends.joblogs import rank_error
    from ringctl.backends.shell import LocalShell

    logs = tmp_path / "logs"
    logs.mkdir()

    def said(record: dict, index: int = 5) -> str:
        (logs / f"rank-{index}.result.json").write_text(json.dumps(record))
        return rank_error(LocalShell(), str(tmp_path), index)

    failed = {"state": "FAILED", "error": "RuntimeError: injected fault on rank 2"}
    assert said({**failed, "rank": 2, "node": "n3"}) == (
        "ring rank 2 on n3: RuntimeError: injected fault on rank 2"
    )
    assert said({**failed, "rank": 5, "node": "n3"}) == "RuntimeError: injected fault on rank 2"
    assert said({**failed, "rank": 2, "node": "\x1b[2Jn3"}).startswith("ring rank 2: Runtime")
    assert said({**failed, "rank": True, "node": "n3"}).startswith("RuntimeError")


def test_the_ranks_a_timed_out_peer_waited_for_are_named_only_where_that_says_something():
    """(re-reading) The blamed rank itself was listed among those that recorded no failure,
    and under NCCL's watchdog (every timed-out rank killed before it writes) every rank was:
    "ranks 0, 1, 2, 3 recorded no failure", which names no one."""
    from ringctl.backends.joblogs import ResultListing, waited_for

    timeout = "RuntimeError: [gloo] Timed out waiting 5000ms for recv operation to complete"
    hung = ResultListing(missing=[2, 3], failed=[0, 1])  # 3 blamed: its result unread
    assert waited_for(timeout, 3, 4, lambda: hung) == (
        "; rank 2 recorded no failure (hung, or killed without a word): likely what it waited for"
    )
    everyone = ResultListing(missing=[0, 1, 2, 3], failed=[])
    assert waited_for("Watchdog caught collective operation timeout", 3, 4, lambda: everyone) == ""
    assert waited_for("ValueError: bad input", 3, 4, lambda: hung) == ""  # not a wait
    assert waited_for("Timed out after 300 seconds waiting for clients", 3, 4, lambda: hung) == ""
