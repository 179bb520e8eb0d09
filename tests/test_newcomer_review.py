"""A newcomer's walk through the README (a read-only review): what tripped them, each fixed.

A mistyped `device=` switched submit's plan check off in silence; `resume` moved a gather's
output to attempts/N without a word; `plan | head` exited 1 (its "does not fit") instead of
141; a CPU job was priced on an H100 in silence; an override's unknown key got no "did you
mean"; resume's refusal listed keys the job does not have; the attention task's median of
two steps was the slower one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from ringctl.backends import local
from ringctl.cli import main
from ringctl.submission import resume_job
from ringctl.tasks.attention import rank_record
from ringctl.terminal import console
from tests.test_cli_review import _job_dir


def test_an_unknown_device_is_refused_at_submit(tmp_path: Path, capsys) -> None:
    """`plan` refused device=H100 by name; submit took it as "no device", skipped the plan
    check and submitted a job of 200M tokens per rank that failed on its ranks."""
    big = ["task.seq_len=200000000", "task.heads=64", "task.kv_heads=64", "task.head_dim=128"]
    assert main(["submit", "smoke", "device=H100", f"output_dir={tmp_path}", *big]) == 2
    err = capsys.readouterr().err
    assert "device: unknown device 'H100'; known: " in err and "H100-SXM" in err, err
    assert not any(tmp_path.iterdir())  # nothing submitted


def test_resume_says_what_of_the_last_attempt_it_moved(tmp_path: Path, capsys) -> None:
    """`resume` moves everything of an attempt (a gather's output too) to attempts/N; it did
    so without a word, and the user's gathered/ was gone."""
    job = _job_dir(tmp_path, "smoke", {"state": "FAILED", "reason": "x"})
    (job / "gathered").mkdir()
    resume_job(job)
    try:
        err = capsys.readouterr().err
        assert f"the last attempt's files moved to {job / 'attempts' / '1'}: " in err, err
        assert "gathered/" in err and "state.json" in err
        assert (job / "attempts" / "1" / "gathered").is_dir()
    finally:
        local.LocalBackend().wait(job, timeout=120)


def test_a_closed_reader_ends_a_rich_table_as_it_ends_print(tmp_path: Path) -> None:
    """rich's own broken-pipe handler exited 1 (`plan | head`: plan's "does not fit"); the
    CLI's rule is 141 for a reader gone away. The console raises BrokenPipeError as print
    does; `ringctl plan` with its reader gone exits 141."""
    read, write = os.pipe()
    os.close(read)
    f = open(write, "w")  # noqa: SIM115 - closed below, its own EPIPE ignored
    try:
        with pytest.raises(BrokenPipeError):
            console(file=f).print("x" * 100)
    finally:
        try:
            f.close()
        except BrokenPipeError:
            pass
    proc = subprocess.Popen(
        [sys.executable, "-m", "ringctl", "plan", "train"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    proc.stdout.close()  # gone before it writes a word
    assert proc.wait(timeout=120) == 141


def test_a_cpu_job_planned_without_a_device_says_which_it_priced(capsys) -> None:
    assert main(["plan", "smoke"]) == 0
    err = capsys.readouterr().err
    assert "runs on CPUs (gpus_per_node: 0) and sets no device: priced on H100-SXM" in err


@pytest.mark.parametrize(
    "override, meant",
    [("task.seqlen=5", "task.seq_len"), ("max_steps=4", "task.max_steps"), ("nodez=2", "nodes")],
)
def test_an_unknown_override_key_gets_a_suggestion(override, meant, capsys) -> None:
    """The same key in a job file got OmegaConf's "did you mean"; on the command line none."""
    assert main(["config", "train", override]) == 2
    assert f"(did you mean {meant}?)" in capsys.readouterr().err


def test_resume_names_only_keys_the_job_has(tmp_path: Path, capsys) -> None:
    job = _job_dir(tmp_path, "smoke", {"state": "FAILED"})
    assert main(["resume", str(job), "task.seq_len=512"]) == 2
    err = capsys.readouterr().err
    assert "a resume may change how the job runs (nodes, " in err
    assert "on_changed_input" not in err  # a long-document job's key alone


def test_the_medians_leave_the_warm_up_step_out() -> None:
    """The first step warms up (the smoke job's: 1.73 s, the next 0.044 s): its medians of
    two steps, their mean, read 20 times the steady step. Of three steps after it, the
    median proper (of two, their mean); one step alone is its own."""
    ctx = type("Ctx", (), {"rank": 0, "world_size": 1, "node": "n"})()
    warm = {"forward_s": 9.0, "backward_s": 9.0}
    steps = [warm, {"forward_s": 1.0, "backward_s": 4.0}, {"forward_s": 3.0, "backward_s": 2.0}]
    got = rank_record(ctx, "zigzag", 8, steps)
    assert (got["forward_median_s"], got["backward_median_s"]) == (2.0, 3.0)
    assert got["median_of"] == "steps after the first" and json.dumps(got)
    alone = rank_record(ctx, "zigzag", 8, [warm])
    assert (alone["forward_median_s"], alone["median_of"]) == (9.0, "the one step")


def _progress_within(rank: int, world: int, base: str, budget: int | None = None) -> list:
    """run_longdoc over the inputs with the progress said at every layer (``budget``: the
    documents packed under it): rank 0's records, (done, extra) each."""
    import ringctl.longdoc.run as run
    from ringctl.longdoc.schedule import RingOptions

    run.WITHIN_S = 0.0  # every call (30 s in a job)
    said: list = []
    inputs = Path(base) / "in"
    params = {"mode": "score", "inputs": [str(inputs)], "chunk_size": 64}
    options = run.LongDocOptions(
        progress=lambda done, total, **extra: said.append(extra | {"done": done}),
        rings=RingOptions(size=world, max_tokens_per_rank=budget),
    )
    run.run_longdoc(params, rank, world, None, Path(base) / f"out{rank}", lambda m: None, options)
    return said


def test_progress_is_there_from_the_start_and_inside_a_pack(tmp_path: Path) -> None:
    """A job showed no progress until its first document ended (a blank status cell, not
    0/2), and a pack of documents (under a budget) said nothing while its forward ran."""
    from ringctl.longdoc.model.load import attention_layers, load_model
    from tests.distributed import run_distributed

    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.txt").write_bytes(b"the tide goes out " * 10)
    (tmp_path / "in" / "doc.txt").write_bytes(b"the tide comes in " * 20)
    said = run_distributed(_progress_within, 2, str(tmp_path), 4096)
    first, *rest = said[0]
    assert first["done"] == 0 and "current" not in first, first
    layers = attention_layers(load_model(None))
    currents = [r["current"] for r in rest if "current" in r]
    pack = "doc.txt and 1 more, packed"  # the longer first
    assert currents == [f"{pack}: layer {i} of {layers}" for i in range(1, layers + 1)]


def test_a_long_documents_forward_says_its_layer(tmp_path: Path, capsys) -> None:
    """The newcomer's 1M-token document (35 min) showed nothing until it ended: the ring's
    lead now says, every WITHIN_S, which layer of the model the forward is in, and status
    shows it beside the count while the job runs."""
    from ringctl.commands.jobs import progress_text
    from ringctl.longdoc.model.load import attention_layers, load_model
    from tests.distributed import run_distributed

    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.txt").write_bytes(b"the tide goes out " * 10)
    (tmp_path / "in" / "doc.txt").write_bytes(b"the tide comes in " * 20)
    said = run_distributed(_progress_within, 2, str(tmp_path))
    layers = attention_layers(load_model(None))
    currents = [r["current"] for r in said[0] if "current" in r]
    assert currents[layers:] == [f"doc.txt: layer {i} of {layers}" for i in range(1, layers + 1)]
    assert said[0][0]["done"] == 0 and "current" not in said[0][0]  # the count from the start
    # a record is replaced whole: the last document's rate goes with the layer
    assert all("tokens_per_s" in r for r in said[0] if r.get("current", "").startswith("doc"))
    assert said[1] == []  # rank 0 reports the job's progress
    record = {"done": 0, "total": 1, "unit": "documents", "current": currents[-1]}
    assert progress_text(record, "RUNNING").endswith(f"; now doc.txt: layer {layers} of {layers}")


def test_a_training_resume_asking_for_more_steps_says_how_to_train_further(
    tmp_path: Path, capsys
) -> None:
    job = _job_dir(tmp_path, "train", {"state": "COMPLETED"})
    assert main(["resume", "--force", str(job), "task.max_steps=6"]) == 2
    err = capsys.readouterr().err
    assert "not task.max_steps" in err and "task.model_path=JOBDIR/gathered/model" in err


def test_progress_inside_a_document_is_advisory_and_summed_over_rings() -> None:
    """A progress write that fails (a full disk) inside the forward must not stop the ring's
    lead mid-layer; with several rings, status shows where each ring inside a document is."""
    from ringctl.commands.jobs import progress_text, ring_summary
    from ringctl.longdoc.run import DocumentProgress

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    shown = DocumentProgress([], 2, 0, full_disk)
    shown.said_within = -1e9
    shown.within(SimpleNamespace(id="big.txt"), 3, 30)  # no raise
    rings = [
        {"done": 1, "total": 2, "current": "big.txt: layer 12 of 30"},
        {"done": 2, "total": 2, "current": "stale"},
    ]
    text = progress_text(ring_summary(rings), "RUNNING")
    assert text.endswith("; now big.txt: layer 12 of 30"), text


def test_an_unknown_device_with_force_is_submitted_unplanned(tmp_path: Path, capsys) -> None:
    """A device the cluster's side knows (a devices file there) and this table does not:
    --force submits it, said, unplanned."""
    assert main(["submit", "--force", "smoke", "device=MYGPU", f"output_dir={tmp_path}"]) == 0
    err = capsys.readouterr().err
    assert "warning: submitting unplanned (--force): device: unknown device 'MYGPU'" in err
    (job,) = tmp_path.iterdir()
    local.LocalBackend().wait(job, timeout=120)


def test_an_unknown_key_beside_an_unresolvable_interpolation_is_one_line(
    tmp_path: Path, capsys, monkeypatch
) -> None:
    """The suggestion looked at every section, resolving ${oc.env:...} on the way: an unset
    variable made the refusal a traceback."""
    monkeypatch.delenv("NOPE_RINGCTL_VAR", raising=False)
    job = tmp_path / "job.yaml"
    job.write_text("output_dir: ${oc.env:NOPE_RINGCTL_VAR}\ntask: {name: train}\n")
    assert main(["config", str(job), "max_stepz=3"]) == 2
    assert "unknown key max_stepz" in capsys.readouterr().err


def test_plan_with_an_explicit_device_says_nothing_of_a_default(capsys) -> None:
    assert main(["plan", "smoke", "--device", "H100-SXM"]) == 0
    assert "sets no device" not in capsys.readouterr().err


def test_rank_logs_hold_no_progress_bars(tmp_path: Path, capsys) -> None:
    """transformers' "Loading weights" bars went into every rank's log (a file) as lines of
    carriage returns; the model tasks' start environment turns them off."""
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.txt").write_text("a short document to score " * 4)
    job = tmp_path / "job"
    argv = ["run", "longdoc", f"job_dir={job}", f"task.inputs=[{tmp_path / 'in'}]"]
    assert main([*argv, "task.model_path=bundled:demo-byte-llama"]) == 0, capsys.readouterr().err
    logs = "".join(p.read_text() for p in (job / "logs").glob("rank-*.err"))
    assert "Loading weights" not in logs and "\r" not in logs, logs[:300]


def test_a_document_s_line_is_not_followed_at_once_by_a_layer_line() -> None:
    """A document longer than WITHIN_S whose last layers ended inside it was followed, at the
    next document's first layer, by a second progress line ("layer 1 of 30"): the document's
    own line is the news, and the next in-document line comes WITHIN_S after it."""
    from ringctl.longdoc.compute.scoring import ShardResult
    from ringctl.longdoc.run import DocumentProgress

    said: list = []
    shown = DocumentProgress([], 2, 0, lambda done, total, **extra: said.append(extra))
    shown.said_within = -1e9  # the first document took longer than WITHIN_S
    shown.document(
        SimpleNamespace(id="a.txt", nbytes=9), 8, ShardResult({}, {}, 40.0), 1, lambda m: None
    )
    shown.within(SimpleNamespace(id="b.txt"), 1, 30)
    assert [r for r in said if "current" in r] == []


def test_rings_of_a_resumed_job_count_the_documents_done_before() -> None:
    """Each ring's record counts the documents given to it this attempt: a resumed job of
    14 documents, 6 done before, read "8/8 documents on 2 rings" at its end. The leads now
    record the job's documents done before (``before``), which the summary adds once."""
    from ringctl.commands.jobs import ring_summary

    rings = [{"done": 4, "total": 4, "before": 6}, {"done": 3, "total": 4, "before": 6}]
    summary = ring_summary(rings)
    assert (summary["done"], summary["total"], summary["rings_done"]) == (13, 14, 1)
    assert ring_summary([{"done": 1, "total": 2}, {"done": 2, "total": 2}])["total"] == 4


def test_an_ssh_job_s_outputs_are_not_judged_by_the_last_fetch(tmp_path: Path) -> None:
    """status judged a COMPLETED ssh job's outputs by the copy its last fetch left: a job
    resumed since read "3/14 documents, outputs incomplete, which gather refuses" while
    gather, fetching first, wrote all 14. The login node's count stands, said unchecked."""
    from ringctl.commands.jobs import vouch_outputs

    root = tmp_path / "out" / "longdoc"
    root.mkdir(parents=True)
    (root / "run.json").write_text("{}")
    row, notes = {"progress": {"done": 14, "total": 14}, "reason": ""}, []
    vouch_outputs(tmp_path, row, notes, remote=True)
    assert row == {"progress": {"done": 14, "total": 14}, "reason": ""}
    assert notes == ["outputs not checked here (on the login node): gather fetches, verifies"]
    vouch_outputs(tmp_path, row, notes, remote=False)  # here: judged (a bad run.json: said)
    assert row["progress"]["done"] == 0 and "gather refuses" in row["reason"], row
