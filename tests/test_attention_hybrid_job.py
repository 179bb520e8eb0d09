"""A job with a Ulysses degree: the worker builds both process groups on every rank and the
attention task runs hybrid_attention; its out/dq/dk/dv equal float64 attention over the
whole sequence, like the flat ring's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ringctl.cli import main
from ringctl.config import load_resolved
from ringctl.tasks.attention import load_results, reference

ROOT = Path(__file__).resolve().parents[1]
SMOKE = str(ROOT / "jobs" / "smoke.yaml")


@pytest.mark.parametrize("ulysses", ["2", "auto"])
def test_hybrid_job_matches_float64(ulysses, tmp_path, capsys):
    job_dir = tmp_path / "job"
    # auto: one node's ranks that the heads allow; 4 ranks on one node, 4 heads / 2 kv heads
    shape = ["nodes=1", "tasks_per_node=4"] if ulysses == "auto" else []
    argv = ["run", SMOKE, f"job_dir={job_dir}", f"ring.ulysses={ulysses}", "timeout=120", *shape]
    assert main(argv) == 0, capsys.readouterr().err
    log = (job_dir / "logs" / "rank-0.out").read_text()
    want_degree = 2 if ulysses == "2" else 4
    assert f"Ulysses degree {want_degree} x ring of {4 // want_degree}" in log
    cfg = load_resolved(job_dir / "config.yaml")
    want, got = reference(cfg), load_results(job_dir / "out")
    for name in ("out", "dq", "dk", "dv"):
        scale = want[name].abs().max()
        torch.testing.assert_close(got[name].double(), want[name], rtol=1e-5, atol=1e-5 * scale)


def test_a_degree_that_does_not_divide_the_heads_is_refused(capsys):
    assert main(["config", SMOKE, "ring.ulysses=4", "task.heads=6", "task.kv_heads=2"]) == 2
    assert "ring.ulysses: 4 must divide the heads (6)" in capsys.readouterr().err
