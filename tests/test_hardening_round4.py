"""Issue 26's low findings that need no cluster, each through the real verb (in this process, or
as `python -m ringctl`) on a real job directory or a real local job:

* `task.max_docs=0` was COMPLETED with 0 documents: refused like other empty inputs;
* `ringctl example smoke FILE` and `example smoke /proc/self/` gave tracebacks: one line;
* `ringctl resume JOB --force KEY=VALUE` was "unrecognized arguments": options go anywhere;
* deep nesting in `logs/progress.json` or `logs/rings/*.json` crashed `ringctl status` with a
  RecursionError, for every job of a listing: null with a note, and each job's row guarded;
* `status` said COMPLETED 4/4 while a shard was missing, which gather refuses: one definition;
* a killed `gather` left `.OUT.tmp-*` and `.OUT.replaced-*` (and no OUT): the next one cleans
  up or puts the earlier output back;
* a SIGKILLed rank's reason was its last stderr line, a progress bar: the signal, no bar.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from ringctl.atomic import atomic_write_json
from ringctl.cli import main
from ringctl.config import load_job, to_yaml
from ringctl.jobdir import JobDir
from ringctl.longdoc.inputs.documents import doc_key
from ringctl.longdoc.output.names import FORMAT
from ringctl.longdoc.output.store import ShardStore
from ringctl.output_dir import new_output_dir

ROOT = Path(__file__).resolve().parents[1]
SMOKE = str(ROOT / "jobs" / "smoke.yaml")
LONGDOC = str(ROOT / "jobs" / "longdoc.yaml")
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONDONTWRITEBYTECODE": "1"}
DEEP = "[" * 100_000 + "]" * 100_000  # beyond any JSON parser's nesting limit
DOCS = ["d0", "d1", "d2", "d3"]


def _ringctl(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ringctl", *args],
        env=ENV,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _one_line(err: str) -> None:
    assert err.count("\n") == 1 and "Traceback" not in err, err


def _finished_job(base: Path, name: str = "job", job_file: str = SMOKE) -> Path:
    """A finished local job's directory, as `ringctl submit` and the supervisor leave it."""
    config = to_yaml(load_job(job_file, ["task.model_path=null"] if job_file == LONGDOC else []))
    files = {"config.yaml": config, "job.json": '{"backend": "local"}'}
    job = JobDir.create(files, target=base / name, base=base, stem=name)
    atomic_write_json(job.state_file, {"state": "COMPLETED", "started_at": 1.0, "ended_at": 3.5})
    return job.path


def _scored(out: Path, ids: list[str], n: int = 5) -> ShardStore:
    """A long-document score output of these documents on a ring of 2 (contiguous)."""
    store = ShardStore(out)
    run = {"format": FORMAT, "world_size": 2, "task": "score", "layout": "contiguous"}
    atomic_write_json(store.run_file, run)
    docs = [{"id": i, "key": doc_key(i), "source": "in.txt"} for i in ids]
    atomic_write_json(store.documents_file, {"documents": docs, "missing_inputs": []})
    half = (n + 1) // 2
    for doc in docs:
        for rank, positions in enumerate((torch.arange(half), torch.arange(half, n))):
            store.write_shard(
                doc=doc,
                rank=rank,
                world_size=2,
                layout="contiguous",
                task="score",
                n_tokens=n,
                padded_tokens=2 * half,
                stats={},
                seconds=0.1,
                tensors={
                    "positions": positions,
                    "input_ids": positions + 3,
                    "token_logprob": -(positions.float() + 1) / 10,
                },
            )
    return store


# ---- max_docs=0, example, options anywhere -----------------------------------------------------


def test_max_docs_zero_is_refused_like_other_empty_inputs(tmp_path, capsys) -> None:
    byte_model = "task.model_path=bundled:demo-byte-llama"  # the default needs a package
    assert main(["submit", LONGDOC, f"output_dir={tmp_path}", "task.max_docs=0", byte_model]) == 2
    err = capsys.readouterr().err
    _one_line(err)
    assert "task.max_docs: must be >= 1" in err and "no document to read" in err, err
    assert not list(tmp_path.iterdir())  # nothing submitted


@pytest.mark.parametrize("where", ["file", "proc"])
def test_example_into_what_cannot_hold_it_is_one_line(tmp_path, where) -> None:
    target = tmp_path / "a-file"
    target.write_text("not a directory\n")
    proc = _ringctl("example", "smoke", str(target) if where == "file" else "/proc/self/")
    assert proc.returncode == 2, proc.stderr
    _one_line(proc.stderr)
    assert ("is not a directory" if where == "file" else "/proc/self/smoke.yaml") in proc.stderr
    assert target.read_text() == "not a directory\n"


def test_resume_takes_its_options_anywhere(tmp_path, capsys) -> None:
    assert main(["run", SMOKE, f"output_dir={tmp_path}", "nodes=1", "tasks_per_node=2"]) == 0
    job = Path(capsys.readouterr().out.split("job directory: ")[1].strip())
    assert main(["resume", str(job), "--force", "nodes=2", "tasks_per_node=1", "--follow"]) == 0
    assert "COMPLETED" in capsys.readouterr().out
    resumed = load_job(job / "config.yaml", [])
    assert (resumed.nodes, resumed.tasks_per_node) == (2, 1)


# ---- status: hostile progress files, one definition of complete ----------------------------------


def test_deep_nesting_in_progress_files_is_a_note_not_a_crash(tmp_path, capsys) -> None:
    hostile = _finished_job(tmp_path, "hostile")
    (hostile / "logs" / "progress.json").write_text(DEEP)
    (hostile / "logs" / "rings").mkdir()
    members = "[" * 980 + "]" * 980  # parses, then too deep for the checks
    (hostile / "logs" / "rings" / "r.json").write_text(f'{{"done": 1, "total": 2, "x": {members}}}')
    (hostile / "logs" / "rings" / "s.json").write_text(DEEP)
    plain = _finished_job(tmp_path, "plain")
    assert main(["status", str(hostile), "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["state"] == "COMPLETED" and row["progress"] is None and row["rings"] == []
    logs = hostile / "logs"
    assert row["notes"] == [
        f"{logs}/rings/r.json: nested too deeply to read; ignored",
        f"{logs}/rings/s.json: nested too deeply to read; ignored",
        f"{logs}/progress.json: nested too deeply to read; ignored",
    ]
    assert main(["status", "--root", str(tmp_path), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert sorted(r["job_dir"] for r in rows) == sorted([str(hostile), str(plain)])


def test_one_broken_job_directory_does_not_hide_the_others(tmp_path, capsys) -> None:
    """A job whose status fails for a reason nobody foresaw (here: a state.json nested too deeply
    for json, which the local backend reads) is one UNKNOWN row; the others are listed."""
    broken = _finished_job(tmp_path, "broken")
    (broken / "state.json").write_text(DEEP)
    plain = _finished_job(tmp_path, "plain")
    code = main(["status", "--root", str(tmp_path), "--json"])
    rows = {r["job_dir"]: r for r in json.loads(capsys.readouterr().out)}
    assert code == 1  # an UNKNOWN row, as before for any job status cannot read
    assert rows[str(plain)]["state"] == "COMPLETED"
    assert rows[str(broken)]["state"] == "UNKNOWN" and rows[str(broken)]["reason"], rows


def test_status_counts_complete_documents_as_gather_does(tmp_path, capsys) -> None:
    job = _finished_job(tmp_path, job_file=LONGDOC)
    store = _scored(job / "out", DOCS)
    atomic_write_json(job / "logs" / "progress.json", {"done": 4, "total": 4, "unit": "documents"})
    assert main(["status", str(job), "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["progress"] == {"done": 4, "total": 4, "unit": "documents"} and not row["reason"]

    store.data_path(doc_key("d2"), 1).unlink()  # a shard goes missing
    assert main(["status", str(job), "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["progress"] == {"done": 3, "total": 4, "unit": "documents"}, row
    assert row["reason"].startswith(
        "outputs incomplete: 1 of 4 documents not complete, which gather refuses: "
        "document 'd2': rank 1's shard "
    ), row
    assert main(["gather", str(job)]) == 3  # the same verdict
    assert "document 'd2': rank 1's shard" in capsys.readouterr().err


# ---- a killed gather's leftovers -----------------------------------------------------------------


def _killed_between_renames(out: Path) -> tuple[Path, Path]:
    """What a gather --force killed between its two renames leaves: its unfinished output, and
    the earlier output moved aside, with no OUT (the same calls `_put_in_place` makes)."""
    tmp = new_output_dir(out)
    (tmp / "docs").mkdir()
    old = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.replaced-"))
    os.rename(out, old)
    return tmp, old


def _beside(out: Path) -> list[str]:
    return sorted(p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}."))


def test_a_killed_gather_is_cleaned_up_or_undone(tmp_path, capsys) -> None:
    job = _finished_job(tmp_path, job_file=LONGDOC)
    _scored(job / "out", DOCS)
    out = tmp_path / "results"
    assert main(["gather", str(job), "-o", str(out)]) == 0
    before = (out / "summary.json").read_text()
    _killed_between_renames(out)
    assert not out.exists() and len(_beside(out)) == 2

    capsys.readouterr()
    assert main(["gather", str(job), "-o", str(out)]) == 2  # the earlier output is back
    err = capsys.readouterr().err
    assert "exists already; remove it or pass --force" in err, err
    assert (out / "summary.json").read_text() == before and _beside(out) == []

    # killed after the swap, before removing the earlier output (a copy of OUT, as it was)
    aside = tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.replaced-")
    shutil.copytree(out, aside, dirs_exist_ok=True)
    assert main(["gather", str(job), "-o", str(out), "--force"]) == 0
    assert _beside(out) == [] and (out / "summary.json").is_file()
    assert "removed (left by a gather that was killed)" in capsys.readouterr().out


# ---- a rank killed by a signal -------------------------------------------------------------------

PROGRESS_THEN_KILL = """#!/bin/bash
printf 'Loading weights: 100%%|##########| 2/2 [00:00<00:00, 3.10it/s]\\r\\n' >&2
kill -9 $$
"""


def _killing_python(base: Path) -> Path:
    script = base / "python-that-dies"
    script.write_text(PROGRESS_THEN_KILL)
    script.chmod(0o755)
    return script


def test_a_sigkilled_rank_is_said_so_without_its_progress_bar(tmp_path, capsys) -> None:
    python = _killing_python(tmp_path)
    args = [SMOKE, f"output_dir={tmp_path}", "nodes=1", "tasks_per_node=2", f"env.python={python}"]
    assert main(["run", *args]) == 1
    err = capsys.readouterr().err
    line = next(ln for ln in err.splitlines() if " FAILED" in ln)
    assert "killed by signal 9 (SIGKILL)" in line, line
    assert "Loading weights" not in line and "100%" not in line, line
