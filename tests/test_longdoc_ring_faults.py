"""Faults in a job of many rings, on real local processes: a rank killed mid-job fails the
whole job promptly; a resume on another ring size (and the same results) computes only what is
missing; a preemption signal makes every ring finish its document, write it and stop."""

from __future__ import annotations

import json
import os
import random
import signal
import time
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import load_file

from ringctl.cli import main
from ringctl.config import load_resolved
from ringctl.longdoc.output.gather import gather
from tests.local_jobs import local_state, wait_for
from tests.longdoc_reference import rel_err

N_DOCS = 8
ROOT = Path(__file__).resolve().parents[1]


def _documents(root: Path) -> Path:
    rng = random.Random(7)
    words = "rings of ranks share one job and each document finds its own".split()
    docs = root / "docs"
    docs.mkdir()
    for i in range(N_DOCS):
        (docs / f"doc{i}.txt").write_text(" ".join(rng.choice(words) for _ in range(700)))
    return docs


def _complete(job_dir: Path) -> int:
    """Documents whose every entry its ring wrote is there."""
    shards = job_dir / "out" / "longdoc" / "shards"
    done = 0
    for d in shards.iterdir() if shards.is_dir() else []:
        first = d / "rank-00000.json"
        try:
            size = json.loads(first.read_text())["world_size"]
        except (OSError, ValueError, KeyError):
            continue
        done += all((d / f"rank-{r:05d}.json").exists() for r in range(size))
    return done


def _logprobs(out: Path) -> dict[str, object]:
    found = {}
    for path in (out / "docs").glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as fh:
            found[fh.metadata()["doc_id"]] = load_file(str(path))["token_logprob"]
    return found


def _common(docs: Path) -> list[str]:
    return [
        f"task.inputs=[{docs}]",
        "timeout=30",
        "nodes=1",
        "tasks_per_node=4",
        "task.chunk_size=1024",
        "task.model_path=bundled:demo-byte-llama",
    ]


def test_killed_rank_then_resume_on_another_ring_size(tmp_path, capsys):
    docs = _documents(tmp_path)
    job_dir = tmp_path / "job"
    argv = ["submit", "longdoc", f"job_dir={job_dir}", "ring.size=2", *_common(docs)]
    assert main(argv) == 0
    wait_for(lambda: _complete(job_dir) >= 2, 180, "two documents to finish")
    killed_at = time.monotonic()
    os.kill(local_state(job_dir)["ranks"]["3"]["pid"], signal.SIGKILL)
    final = wait_for(
        lambda: local_state(job_dir).get("ended_at") and local_state(job_dir), 60, "the end"
    )
    assert final["state"] == "FAILED" and "rank 3" in final["reason"]
    assert time.monotonic() - killed_at < 60  # every ring stopped, none waits on the dead one
    finished = _complete(job_dir)

    capsys.readouterr()  # resume on rings of one rank each: another ring size, same results
    assert main(["resume", str(job_dir), "ring.size=1", "--follow"]) == 0
    log = capsys.readouterr().out
    assert f"complete already: {finished}, to do: {N_DOCS - finished}" in log
    assert load_resolved(job_dir / "config.yaml").ring.size == 1  # the resume's override kept
    schedule = json.loads((job_dir / "schedule.json").read_text())
    assert {r["ring_size"] for r in schedule["documents"]} == {1}
    resumed = _logprobs(gather(job_dir, tmp_path / "resumed").out)
    assert len(resumed) == N_DOCS

    clean = tmp_path / "clean"  # one uninterrupted ring of the whole job
    assert main(["run", "longdoc", f"job_dir={clean}", *_common(docs)]) == 0
    reference = _logprobs(gather(clean, tmp_path / "clean-out").out)
    for doc, lp in reference.items():
        assert rel_err(resumed[doc], lp) < 1e-5, doc


def test_preemption_signal_finishes_each_rings_document_and_resume_continues(tmp_path, capsys):
    docs = _documents(tmp_path)
    job_dir = tmp_path / "job"
    argv = ["submit", "longdoc", f"job_dir={job_dir}", "ring.size=2", *_common(docs)]
    assert main(argv) == 0
    wait_for(lambda: _complete(job_dir) >= 1, 180, "a document to finish")
    for info in local_state(job_dir)["ranks"].values():  # what Slurm's --signal does, to every rank
        os.kill(info["pid"], signal.SIGUSR1)
    final = wait_for(
        lambda: local_state(job_dir).get("ended_at") and local_state(job_dir), 90, "the end"
    )
    assert final["state"] == "FAILED", final  # not done, and not reported done
    assert "stopped on request before the end" in final["reason"]
    stopped_with = _complete(job_dir)
    assert 1 <= stopped_with < N_DOCS
    for d in (job_dir / "out" / "longdoc" / "shards").iterdir():  # nothing half-written
        entries = list(d.glob("rank-*.json"))
        size = json.loads(entries[0].read_text())["world_size"] if entries else 0
        assert len(entries) in (0, size), d.name
    capsys.readouterr()
    assert main(["resume", str(job_dir), "--follow"]) == 0
    assert f"complete already: {stopped_with}" in capsys.readouterr().out
    assert len(gather(job_dir, tmp_path / "out").rows) == N_DOCS
