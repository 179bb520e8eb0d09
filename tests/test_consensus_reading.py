"""Rank 0 reads the model's files (hashes its weights) while the other ranks wait: the wait
outlasts the job's collective timeout by as long as the read takes (training review: a job
whose model took longer to hash than `timeout` failed at start, and at each resume, with
"Timed out waiting ... for recv"). Real processes on gloo, the group's timeout 2 s."""

from __future__ import annotations

import time

import pytest
import torch.distributed as dist

from tests.distributed import run_distributed

SLOW_S = 4.0  # rank 0's read: twice the group's timeout


def _slow_read(rank: int, world: int, patient: bool):
    from ringctl.longdoc.consensus import from_lead_reading

    def read():
        time.sleep(SLOW_S)
        return {"model": "abc"}

    if patient:
        return from_lead_reading(read, nbytes=0)
    box = [read() if rank == 0 else None]  # what agreed_identity did: the group's own wait
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _refused(rank: int, world: int):
    from ringctl.longdoc.consensus import from_lead_reading

    def read():
        raise ValueError("the model's files cannot be read: gone")

    try:
        from_lead_reading(read, nbytes=1 << 30)
    except ValueError as err:
        return str(err)
    return None


def test_the_others_wait_as_long_as_rank_0_reads(monkeypatch):
    monkeypatch.setenv("RINGCTL_TEST_GROUP_TIMEOUT", "2")
    assert run_distributed(_slow_read, 2, True) == [{"model": "abc"}] * 2
    with pytest.raises(RuntimeError, match=r"rank \d of 2 failed"):  # the wait it replaces
        run_distributed(_slow_read, 2, False)


def test_a_read_rank_0_refuses_is_refused_on_every_rank_alike(monkeypatch):
    monkeypatch.setenv("RINGCTL_TEST_GROUP_TIMEOUT", "2")
    said = run_distributed(_refused, 2)
    assert said == ["the model's files cannot be read: gone"] * 2


def _undecodable(rank: int, world: int):
    import json

    from ringctl.longdoc.consensus import from_lead_reading

    def read():
        return json.loads("{not json")  # a JSONDecodeError: not built from a message alone

    try:
        from_lead_reading(read, nbytes=0)
    except ValueError as err:
        return type(err).__name__
    return None


def test_an_error_that_cannot_be_rebuilt_reaches_every_rank_as_its_kind(monkeypatch):
    """(re-reading) Rank 0's error was raised on every rank as type(err)(message): a
    JSONDecodeError (or UnicodeDecodeError) cannot be built so, and every rank raised a
    TypeError. Rank 0 raises its own; the others the kind it is (ValueError here)."""
    monkeypatch.setenv("RINGCTL_TEST_GROUP_TIMEOUT", "20")
    assert run_distributed(_undecodable, 2) == ["JSONDecodeError", "ValueError"]


def _slow_share(rank: int, world: int, folder: str, broken: bool):
    """verify_together with rank 0's share read slowly (twice the group's timeout)."""
    from pathlib import Path
    from types import SimpleNamespace

    from ringctl.train import checkpoint

    real = checkpoint.verify

    def slow(found, r, w):
        if r == 0:
            time.sleep(SLOW_S)
            if broken:
                return f"{found.path}/__0_0.distcp: its sha256 is not the one recorded"
        return real(found, r, w)

    checkpoint.verify = slow
    try:
        checkpoint.verify_together(SimpleNamespace(path=Path(folder), state={"run": {}}))
    except ValueError as err:
        return str(err)
    return "verified"


def test_a_resume_s_checkpoint_check_waits_as_long_as_the_largest_share(monkeypatch, tmp_path):
    """(training review, left then fixed) Each rank hashes its share of a checkpoint before
    the agreement, under the collective timeout: a large optimizer state resumed on few
    ranks is minutes of hashing a rank. The agreement waits as long as the largest share
    takes; a changed file is still refused on every rank."""
    monkeypatch.setenv("RINGCTL_TEST_GROUP_TIMEOUT", "2")
    assert run_distributed(_slow_share, 2, str(tmp_path), False) == ["verified"] * 2
    said = run_distributed(_slow_share, 2, str(tmp_path), True)
    assert said[0] == said[1].removeprefix("rank 0: ") and "its sha256 is not" in said[0], said
