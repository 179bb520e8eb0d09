"""A rank killed mid-batch: the job is FAILED, finished documents stay intact and verified,
and `ringctl resume` computes only what is missing; the result equals an uninterrupted run.

Real processes on the local backend (the same worker and job directory as on Slurm); the
kill is a real SIGKILL of one rank's process while documents are being scored.
"""

from __future__ import annotations

import os
import random
import signal
from pathlib import Path

import pytest
import torch

from ringctl.cli import main
from ringctl.longdoc.output.gather import GatherError, gather, verify
from ringctl.tasks import load_tensors
from tests.local_jobs import local_state, wait_for

N_DOCS = 6


def _documents(root: Path) -> Path:
    rng = random.Random(5)
    words = "ring attention shards tokens travel between ranks under one leaf switch".split()
    docs = root / "docs"
    docs.mkdir()
    for i in range(N_DOCS):
        text = " ".join(rng.choice(words) for _ in range(2000))  # ~15k bytes: ~1 s per document
        (docs / f"doc{i}.txt").write_text(text)
    return docs


def _complete_on_both_ranks(job_dir: Path) -> int:
    """Documents whose manifest entries both ranks have written (each rank writes its own)."""
    shards = job_dir / "out" / "longdoc" / "shards"
    if not shards.is_dir():
        return 0
    return sum(
        (d / "rank-00000.json").exists() and (d / "rank-00001.json").exists()
        for d in shards.iterdir()
    )


def test_killed_rank_fails_the_job_and_resume_completes_only_what_is_missing(tmp_path, capsys):
    docs = _documents(tmp_path)
    job_dir = tmp_path / "job"
    common = [f"task.inputs=[{docs}]", "timeout=20", "task.chunk_size=1024", "task.model_path=null"]
    assert main(["submit", "jobs/longdoc.yaml", f"job_dir={job_dir}", *common]) == 0

    wait_for(lambda: _complete_on_both_ranks(job_dir) >= 2, 120, "two documents to finish")
    victim = local_state(job_dir)["ranks"]["1"]["pid"]
    os.kill(victim, signal.SIGKILL)
    final = wait_for(
        lambda: local_state(job_dir).get("ended_at") and local_state(job_dir), 60, "the job to end"
    )
    assert final["state"] == "FAILED"
    assert "rank 1" in final["reason"]

    # Finished documents are whole and verified; the rest are named as missing, nothing written.
    with pytest.raises(GatherError) as err:
        gather(job_dir, tmp_path / "partial")
    problems = "\n".join(err.value.problems)
    finished = [f"doc{i}.txt" for i in range(N_DOCS) if f"'doc{i}.txt'" not in problems]
    assert len(finished) >= 2, problems
    assert not (tmp_path / "partial").exists()
    assert "checksum" not in problems  # missing, not corrupt

    capsys.readouterr()
    assert main(["resume", str(job_dir), "--follow"]) == 0
    log = capsys.readouterr().out
    todo = N_DOCS - len(finished)
    assert f"complete already: {len(finished)}, to do: {todo}" in log
    assert (job_dir / "attempts" / "1" / "state.json").exists()  # the failed attempt, kept

    result = gather(job_dir, tmp_path / "resumed")
    assert len(result.rows) == N_DOCS

    # The same documents in one uninterrupted job give the same log-probabilities.
    clean = tmp_path / "clean"
    assert main(["run", "jobs/longdoc.yaml", f"job_dir={clean}", *common]) == 0
    gather(clean, tmp_path / "clean-out")
    resumed = sorted((tmp_path / "resumed" / "docs").glob("*.safetensors"))
    clean_files = sorted((tmp_path / "clean-out" / "docs").glob("*.safetensors"))
    assert [p.name for p in resumed] == [p.name for p in clean_files] and len(resumed) == N_DOCS
    for a_path, b_path in zip(resumed, clean_files, strict=True):
        a, _ = load_tensors(a_path)
        b, _ = load_tensors(b_path)
        assert torch.equal(a["token_logprob"], b["token_logprob"]), a_path.name
    run, verified, _ = verify(job_dir)
    assert len(verified) == N_DOCS
