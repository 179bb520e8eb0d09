"""The planner's model: its own invariants, and its command line."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from ringctl.cli import main
from ringctl.planner.cost import (
    GIB,
    Link,
    ModelShape,
    Workload,
    estimate,
    fewest_ranks,
    longest_sequence,
    memory_per_rank,
    min_tokens_for_overlap,
    usable_gib,
)
from ringctl.planner.devices import get_device, load_devices

WORK = Workload(seq_len=1 << 20, heads=32, kv_heads=8, head_dim=128, dtype="bfloat16")


def test_shipped_devices_all_load_with_sources():
    devices = load_devices()
    for name in ("A100-40GB", "A100-80GB", "H100-SXM", "H100-PCIe", "H200", "B200", "L40S"):
        assert devices[name].source and devices[name].tflops["bfloat16"] > 0


def test_attention_memory_is_linear_in_tokens_per_rank():
    a = sum(memory_per_rank(WORK, 8).values())
    b = sum(memory_per_rank(WORK, 16).values())
    assert a == pytest.approx(2 * b, rel=0.02)  # halving N/P halves it (buffers scale with N/P)


@pytest.mark.parametrize("phase", ["forward", "backward"])
@pytest.mark.parametrize("link_gbit", [25.0, 400.0, 3600.0])
def test_min_tokens_for_overlap_is_the_threshold(phase, link_gbit):
    device, link = get_device("H100-SXM"), Link("x", link_gbit)
    n = min_tokens_for_overlap(WORK, device, link, phase)
    at = estimate(replace(WORK, seq_len=4 * n), 4, device, link)
    below = estimate(replace(WORK, seq_len=4 * (n - 2)), 4, device, link)
    assert at.overlapped[phase] and not below.overlapped[phase]


def test_longest_sequence_fits_and_the_next_does_not():
    device = get_device("A100-40GB")
    work = replace(WORK, model=ModelShape(layers=8, hidden=2048, vocab=32000))
    n = longest_sequence(work, 8, device)
    assert n % 16 == 0
    cap = usable_gib(device) * GIB
    assert sum(memory_per_rank(replace(work, seq_len=n), 8).values()) <= cap
    assert sum(memory_per_rank(replace(work, seq_len=n + 16), 8).values()) > cap


def test_fewest_ranks_is_minimal():
    device = get_device("H100-SXM")
    p = fewest_ranks(WORK, device)
    cap = usable_gib(device) * GIB
    assert sum(memory_per_rank(WORK, p).values()) <= cap
    assert p == 1 or sum(memory_per_rank(WORK, p - 1).values()) > cap


def test_plan_cli_json_and_warnings(capsys):
    code = main(
        [
            "plan",
            "--seq",
            "1048576",
            "--ranks",
            "64",
            "--nodes",
            "8",
            "--device",
            "H100-SXM",
            "--heads",
            "32",
            "--kv-heads",
            "8",
            "--layers",
            "32",
            "--hidden",
            "4096",
            "--json",
        ]
    )
    report = json.loads(capsys.readouterr().out)
    assert report["tokens_per_rank"] == 16384 and report["link"]["gbit_s"] == 400.0
    assert not report["fits"] and code == 1
    assert any("does not fit" in w for w in report["warnings"])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["plan", "--ranks", "4"], "--seq is required"),
        (["plan", "--seq", "1001", "--ranks", "4"], "must be a multiple of 8"),
        (["plan", "--seq", "4096", "--ranks", "4", "--device", "TPU"], "unknown device 'TPU'"),
        (
            ["plan", "--seq", "4096", "--ranks", "4", "--heads", "6", "--kv-heads", "4"],
            "multiple of --kv-heads",
        ),
    ],
)
def test_plan_cli_errors_are_one_line(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and err.count("\n") == 1


def test_submit_refuses_a_job_that_cannot_fit(tmp_path, capsys):
    # 4 H100 ranks cannot hold 64M tokens of 32 heads; nothing may be created or submitted.
    argv = ["submit", "jobs/smoke.yaml", f"output_dir={tmp_path}", "device=H100-SXM",
            "task.seq_len=67108864", "task.heads=32", "task.kv_heads=8", "task.head_dim=128",
            "task.dtype=bfloat16"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "ringctl plan (H100-SXM): does not fit" in err and "--force" in err
    assert list(tmp_path.iterdir()) == []


def test_plan_sizes_a_job_config(capsys):
    argv = ["plan", "jobs/attention.yaml", "nodes=8", "tasks_per_node=8", "device=H100-SXM",
            "task.seq_len=1048576", "task.dtype=bfloat16", "--json"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ranks"] == 64 and report["device"] == "H100-SXM"
    assert report["workload"]["seq_len"] == 1048576 and report["link"]["name"].startswith("NET")
