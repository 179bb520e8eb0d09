"""logs/metrics.jsonl (ringctl/train/metrics.py): written by its owner, read back by it as
hostile input, cut back on resume."""

from __future__ import annotations

import json

from ringctl.train import metrics
from ringctl.train.metrics import StepMetrics


def _m(step: int) -> StepMetrics:
    return StepMetrics(step, 5.0 - step / 10, 1000 + step, 1e-3, 0.5, 2000.0, 0.5)


def test_round_trip_and_resume_from_a_checkpoints_copy(tmp_path):
    path = tmp_path / "logs" / "metrics.jsonl"
    saved = tmp_path / "step-0000003" / "metrics.jsonl"
    for s in range(1, 6):
        metrics.append(path, _m(s))
        if s == 3:  # what a checkpoint at step 3 keeps
            saved.parent.mkdir()
            saved.write_bytes(path.read_bytes())
    got, bad = metrics.read(path)
    assert got == [_m(s) for s in range(1, 6)] and bad == 0
    metrics.restore(path, saved)
    for s in range(4, 7):  # the resumed run writes steps 4.. again
        metrics.append(path, _m(s))
    got, _ = metrics.read(path)
    assert [r.step for r in got] == [1, 2, 3, 4, 5, 6]


def test_hostile_lines_are_skipped_and_counted(tmp_path):
    path = tmp_path / "metrics.jsonl"
    good = json.dumps(_m(1).__dict__)
    lines = [
        good,
        "[" * 100_000,  # deep nesting
        json.dumps({**_m(2).__dict__, "loss": "NaN"}),
        '{"step": 3, "loss": NaN, "tokens": 1, "lr": 1, "grad_norm": 1, "tokens_per_s": 1, "seconds": 1}',
        json.dumps({**_m(4).__dict__, "extra": 1}),
        json.dumps({**_m(5).__dict__, "step": -5}),
        "x" * 10_000,
        "",
    ]
    path.write_text("\n".join(lines) + "\n")
    got, bad = metrics.read(path)
    assert got == [_m(1)] and bad == 6
