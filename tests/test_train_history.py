"""A training checkpoint's own files beside the DCP shards, and the history gather reports.

checksums.json covered the DCP files and config.json: train_state.json (the data cursor a
resume continues from) and metrics.jsonl (gather's loss) could change on disk unseen. A
cursor's offset moved by one resumed on other tokens, exit 0; one digit of the saved history
changed the loss gather reported. And gather took whichever history copy had more lines and
reported its last line's loss: one line appended twice to the run's log, or lines reordered,
gave another step's loss as the checkpoint's, exit 0. The truth here is the run's own
records as it wrote them (its log, step by step), read before anything is changed.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from ringctl.cli import main
from tests.test_train_job import write_state


def _run_args(job: Path, corpus: Path, model_path: str) -> list[str]:
    """A 4-step run, one rank, checkpoints at steps 2 and 4."""
    return [
        "jobs/train.yaml",
        f"job_dir={job}",
        f"task.inputs=[{corpus}]",
        f"task.model_path={model_path}",
        "task.seq_len=64",
        "task.batch_sequences=2",
        "task.max_steps=4",
        "task.warmup_steps=1",
        "task.checkpoint_every=2",
        "tasks_per_node=1",
        "timeout=60",
    ]


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> tuple[Path, list[dict]]:
    """(job directory, its step records) of a finished 4-step run, one rank, checkpoints at
    steps 2 and 4."""
    root = tmp_path_factory.mktemp("history")
    corpus = root / "corpus"
    corpus.mkdir()
    for i in range(6):
        (corpus / f"doc{i}.txt").write_text(f"document {i}: " + "the tide goes out. " * (9 + i))
    job = root / "job"
    assert main(["run", *_run_args(job, corpus, "null")]) == 0
    lines = (job / "logs" / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert len({r["loss"] for r in records}) == 4  # each step's loss tells which it is
    return job, records


def _copy(finished, tmp_path: Path) -> tuple[Path, list[dict]]:
    job, records = finished
    shutil.copytree(job, tmp_path / "job", symlinks=True)
    return tmp_path / "job", records


def _summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


def test_a_line_repeated_in_the_run_s_log_does_not_change_the_reported_loss(
    finished, tmp_path, capsys
):
    job, records = _copy(finished, tmp_path)
    log = job / "logs" / "metrics.jsonl"
    log.write_text(log.read_text() + log.read_text().splitlines()[0] + "\n")  # step 1 again
    out = tmp_path / "out"
    assert main(["gather", str(job), "-o", str(out)]) == 0
    assert f"step 4, loss {records[-1]['loss']:.4f}" in capsys.readouterr().out
    assert _summary(out)["loss"] == records[-1]["loss"]
    written = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert written == records


def test_no_whole_history_reports_no_loss_and_says_why(finished, tmp_path, capsys):
    """A checkpoint saved without its copy of the history (covered as such) and a log cut
    to its first two steps: the history is written as found and no loss is reported."""
    job, records = _copy(finished, tmp_path)
    folder = job / "checkpoints" / "step-0000004"
    (folder / "metrics.jsonl").unlink()
    sums = json.loads((folder / "checksums.json").read_text())
    del sums["metrics.jsonl"]
    (folder / "checksums.json").write_text(json.dumps(sums))
    log = job / "logs" / "metrics.jsonl"
    log.write_text("".join(line + "\n" for line in log.read_text().splitlines()[:2]))
    out = tmp_path / "out"
    assert main(["gather", str(job), "-o", str(out)]) == 0
    said = " ".join(capsys.readouterr().out.split())
    assert "step 4, loss not reported" in said
    assert "no copy holds steps 1 to 4 once each in order; loss not reported" in said
    assert _summary(out)["loss"] is None
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 2


@pytest.mark.parametrize("name", ["train_state.json", "train_state.json:run", "metrics.jsonl"])
def test_a_checkpoint_s_own_file_changed_on_disk_is_a_damaged_checkpoint(
    finished, tmp_path, capsys, name
):
    """Checked before any of it is believed: the run's record changed (here: as if it had
    trained on a tokenizer) was refused as a tokenizer not found now (exit 2)."""
    job, records = _copy(finished, tmp_path)
    name, _, part = name.partition(":")
    path = job / "checkpoints" / "step-0000004" / name
    text = path.read_text()
    if name == "train_state.json":
        state = json.loads(text)
        if part == "run":
            state["run"]["byte_tokens"] = False
        else:
            state["cursor"]["offset"] += 1
        path.write_text(json.dumps(state))
    else:
        path.write_text(text.replace(f'"loss": {records[-1]["loss"]}', '"loss": 0.5'))
    assert path.read_text() != text
    capsys.readouterr()
    assert main(["gather", str(job), "-o", str(tmp_path / "out")]) == 3
    assert f"{path}: its sha256 is not the one checksums.json recorded" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_checksums_of_earlier_releases_still_verify(tmp_path):
    """checksums.json covered the DCP files alone, then config.json too, now the run's
    train_state.json and metrics.jsonl too: a checkpoint written by each earlier release
    (a job running across the upgrade) verifies, and still catches its covered files."""
    from ringctl.train.checkpoint import Checkpoint, file_sha256, verify

    names = (".metadata", "__0_0.distcp", "config.json", "train_state.json", "metrics.jsonl")
    for name in names:
        (tmp_path / name).write_bytes(name.encode())
    found = Checkpoint(tmp_path, 1, {"run": {"byte_tokens": True}})
    for covered in (names[:2], names[:3], names):
        sums = {n: file_sha256(tmp_path / n) for n in covered}
        (tmp_path / "checksums.json").write_text(json.dumps(sums))
        assert verify(found) == "", covered
    (tmp_path / "__0_0.distcp").write_bytes(b"changed")
    assert "__0_0.distcp: its sha256 is not the one" in verify(found)


def test_checkpoints_pruned_faster_than_gather_reads_them_is_said_not_damage(
    finished, tmp_path, monkeypatch, capsys
):
    """A running job saving every step with keep_checkpoints=1 pruned each checkpoint gather
    took while it read it: exit 3 ("checksums.json: missing", "cannot be read") as if the
    checkpoint were damaged. gather takes the newest again while the one it read is pruned,
    then says what happened (exit 1). An error while the checkpoint stays (``latest`` moved
    on or not) is the truth (exit 3), not a race."""
    from ringctl.longdoc.output.gather import GatherError
    from ringctl.train import export

    job, _ = _copy(finished, tmp_path)
    root = job / "checkpoints"
    for step in (6, 8, 10, 12):  # the running job's next saves, as complete folders
        folder = root / f"step-{step:07d}"
        shutil.copytree(root / "step-0000004", folder)
        state = json.loads((folder / "train_state.json").read_text())
        (folder / "train_state.json").write_text(json.dumps(state | {"step": step}))
    tries = []

    def pruned_under_it(tmp, job_dir, found, *args):
        tries.append(found.step)
        (root / "latest").write_text(f"step-{found.step + 2:07d}\n")
        shutil.rmtree(found.path)  # what prune does to the folder being read
        raise GatherError([f"{found.path}/checksums.json: missing"])

    monkeypatch.setattr(export, "_write", pruned_under_it)
    assert main(["gather", str(job), "-o", str(tmp_path / "out"), "--partial"]) == 1
    err = " ".join(capsys.readouterr().err.split())
    assert "the running job saved and pruned checkpoints faster than gather read one" in err
    assert tries == [4, 6, 8, 10] and "not all written yet" not in err

    def moved_on_but_kept(tmp, job_dir, found, *args):
        (root / "latest").write_text("step-0000012\n")
        raise GatherError([f"{found.path}/__0_0.distcp: its sha256 is not the one"])

    monkeypatch.setattr(export, "_write", moved_on_but_kept)
    (root / "latest").write_text("step-0000002\n")
    assert main(["gather", str(job), "-o", str(tmp_path / "out"), "--partial"]) == 3
    assert "step-0000002/__0_0.distcp: its sha256" in capsys.readouterr().err


def test_status_names_the_checkpoint_a_resume_starts_from(finished):
    """After a cancel at step 33 with checkpoints every 10, status said "33/60 steps" where
    gather --partial and the resume take step 30: the steps done again were not said."""
    from ringctl.commands.jobs import progress_text
    from ringctl.progress import read_record

    job, _ = finished
    notes: list[str] = []
    record = read_record(job / "logs" / "progress.json", notes)
    assert record["checkpoint"] == 4 and not notes  # the job's own record, after its save
    assert progress_text(record, "COMPLETED").startswith("4/4 steps, loss ")
    assert "checkpoint" not in progress_text(record, "COMPLETED")
    stopped = record | {"done": 33, "total": 60, "checkpoint": 30}
    said = progress_text(stopped, "CANCELLED")
    assert said.endswith(", checkpoint at step 30 (the next run does steps 31-33 again)")
    assert ", checkpoint at step 30, ETA" in progress_text(stopped, "RUNNING")
    assert progress_text(stopped, "UNKNOWN").endswith(", checkpoint at step 30")
    early = record | {"done": 5, "total": 60, "checkpoint": None}
    assert progress_text(early, "PENDING").endswith(
        ", no checkpoint yet (the next run does steps 1-5 again)"
    )
    assert progress_text(record | {"done": 31, "checkpoint": 30}, "FAILED").endswith(
        "(the next run does step 31 again)"
    )


def test_a_history_a_rerun_started_again_gives_its_last_run(finished, tmp_path, capsys):
    """A Slurm requeue before the first checkpoint left steps 1-2 then 1-4 in one history
    (an earlier release): its last run is the history, and its last loss the checkpoint's."""
    job, records = _copy(finished, tmp_path)
    folder = job / "checkpoints" / "step-0000004"
    (folder / "metrics.jsonl").unlink()  # saved without its copy: the log is read
    sums = json.loads((folder / "checksums.json").read_text())
    del sums["metrics.jsonl"]
    (folder / "checksums.json").write_text(json.dumps(sums))
    log = job / "logs" / "metrics.jsonl"
    lines = log.read_text().splitlines()
    log.write_text("".join(line + "\n" for line in lines[:2] + lines))
    out = tmp_path / "out"
    assert main(["gather", str(job), "-o", str(out)]) == 0
    assert f"step 4, loss {records[-1]['loss']:.4f}" in capsys.readouterr().out
    written = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert written == records


def test_a_resume_after_the_install_moved_the_bundled_model_continues(finished, tmp_path, capsys):
    """A bundled or packaged model (bundled:..., package:...) is recorded as the path it
    resolves to in the install; a new environment (venv, prefix, Python) moves it, and the
    job could not be resumed at all (the path may not be overridden). The files' identity,
    recorded on both sides, vouches for an installed model moved; not for a changed one,
    nor for a user's own path (its identity hashes fewer tokenizer files than a tokenizer
    may read)."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "doc.txt").write_text("the tide goes out. " * 40)
    job = tmp_path / "job"
    assert main(["run", *_run_args(job, corpus, "bundled:demo-byte-llama")]) == 0

    def losses() -> list[float]:
        lines = (job / "logs" / "metrics.jsonl").read_text().splitlines()
        return [json.loads(line)["loss"] for line in lines]

    records = losses()
    state_path = job / "checkpoints" / "step-0000002" / "train_state.json"
    state = json.loads(state_path.read_text())
    assert state["run"]["model"] and state["run"]["model_path"].endswith("demo-byte-llama")
    moved = state | {"run": state["run"] | {"model_path": "/old/venv/ringctl/demo-byte-llama"}}
    write_state(state_path, moved)
    (job / "checkpoints" / "latest").write_text("step-0000002\n")
    assert main(["resume", str(job), "--force", "--follow"]) == 0
    assert losses() == records and len(records) == 4
    changed = moved | {"run": moved["run"] | {"model": "0" * 32}}
    write_state(state_path, changed)
    (job / "checkpoints" / "latest").write_text("step-0000002\n")
    capsys.readouterr()
    assert main(["resume", str(job), "--force", "--follow"]) == 1
    assert "task.model_path" in capsys.readouterr().err
    # a user's own path moved: refused, as before (the fixture's model_path is its own)
    own, _ = _copy(finished, tmp_path / "own")
    own_state = own / "checkpoints" / "step-0000002" / "train_state.json"
    record = json.loads(own_state.read_text())
    write_state(own_state, record | {"run": record["run"] | {"model_path": "/elsewhere/m"}})
    (own / "checkpoints" / "latest").write_text("step-0000002\n")
    assert main(["resume", str(own), "--force", "--follow"]) == 1


def test_a_scoring_run_s_paths_are_judged_by_the_identity_of_their_files(tmp_path):
    """run.json's model_path of a bundled model moved with the install: a resume was refused
    as "a different run". Equal identities excuse an installed model's paths (a tokenizer in
    its own folder with it); other identities, or a user's own path, do not; ranks without
    the identity (all but rank 0) leave paths and files to rank 0."""
    from ringctl.longdoc.model.names import resolve_model_path
    from ringctl.longdoc.output.manifest import other_run, run_record, write_run

    root = tmp_path / "longdoc"
    root.mkdir()
    here = resolve_model_path("bundled:demo-byte-llama")
    old = "/old/venv/demo-byte-llama"
    write_run(
        root,
        run_record(
            2, {"task": "score", "model_path": old, "tokenizer_path": old, "model": "a" * 32}
        ),
    )
    now = {"task": "score", "model_path": here, "tokenizer_path": here}
    assert other_run(root, now | {"model": "a" * 32}, installed=True) == ""
    said = other_run(root, now | {"model": "b" * 32}, installed=True)
    assert f"model_path: '{old}' there, '{here}' now" in said
    assert "tokenizer_path" in other_run(root, now | {"model": "a" * 32}, installed=False)
    assert other_run(root, now) == ""  # a rank but 0: rank 0 judges the files and paths
    assert "task" in other_run(root, now | {"task": "embed"})
