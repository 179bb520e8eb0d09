"""ring.size=auto's per-rank token budget: the job's own, or the planner's for its device
(written into the submitted config and said), or a one-line refusal at submit."""

from __future__ import annotations

from ringctl.cli import main
from ringctl.config import load_job, load_resolved
from ringctl.planner.devices import load_devices
from ringctl.planner.pricing import max_tokens_per_rank

BYTE_MODEL = "task.model_path=bundled:demo-byte-llama"  # the job's default needs a package


def test_without_budget_or_device_auto_is_refused_at_submit(tmp_path, capsys):
    argv = ["submit", "longdoc", "ring.size=auto", f"output_dir={tmp_path}", BYTE_MODEL]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "ring.max_tokens_per_rank: ring.size=auto needs a per-rank token budget" in err
    assert err.count("\n") == 1 and not list(tmp_path.iterdir())


def test_the_planner_derives_the_budget_from_the_device(tmp_path, capsys):
    from ringctl.sizing import job_workload

    job = tmp_path / "job"
    argv = [
        "submit",
        "longdoc",
        "ring.size=auto",
        "device=H100-SXM",
        "nodes=1",
        "tasks_per_node=2",
        f"job_dir={job}",
        BYTE_MODEL,
    ]
    assert main(argv) == 0, capsys.readouterr().err
    budget = load_resolved(job / "config.yaml").ring.max_tokens_per_rank
    assert f"ring.max_tokens_per_rank={budget} (from the planner: H100-SXM)" in (
        capsys.readouterr().err
    )
    # the budget is what one rank of the smallest ring (the whole model on it) can hold
    cfg = load_job("longdoc", ["device=H100-SXM", "nodes=1", "tasks_per_node=2", BYTE_MODEL])
    one = max_tokens_per_rank(job_workload(cfg, None), load_devices()["H100-SXM"], 1)
    assert 0 < budget <= one
    main(["cancel", str(job)])


def test_an_explicit_budget_is_kept(tmp_path, capsys):
    from ringctl.sizing import Sizing
    from ringctl.submission import with_ring_budget

    cfg = load_job("longdoc", ["ring.size=auto", "ring.max_tokens_per_rank=512", BYTE_MODEL])
    assert with_ring_budget(Sizing(cfg), "x").cfg is cfg


def test_a_document_the_device_cannot_hold_is_refused_and_a_long_one_warned(tmp_path, capsys):
    """The issue's 40 MB document: refused at submit when no ring of the job holds it on its
    device, warned about when it fits but would outlast slurm.time; nothing is created."""
    huge = tmp_path / "huge.txt"
    huge.write_bytes(b"x" * 40_000_000)
    # the random tiny Llama (model_path null): the rank counts below are its plan's
    base = [
        "submit",
        "longdoc",
        f"task.inputs={huge}",
        "nodes=1",
        "tasks_per_node=2",
        "task.model_path=null",
        f"output_dir={tmp_path / 'runs'}",
    ]
    assert main([*base, "device=A100-40GB"]) == 2
    err = capsys.readouterr().err
    assert "document 'huge.txt' has 40,000,000 tokens: no ring of this job holds it" in err
    assert not (tmp_path / "runs").exists()
    strict = [
        *base,
        "device=H100-SXM",
        "slurm.time=00:01:00",
        "slurm.signal=null",
        "ring.placement=required",
    ]
    assert main(strict) == 2  # under ring.placement=required the time limit refuses too
    assert "over slurm.time=00:01:00" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()
