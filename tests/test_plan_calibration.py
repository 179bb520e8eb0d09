"""A calibrated CPU entry (``ringctl plan --calibrate``): block tables by head dim, measured
matmul rates by width, and the device file that stores them (its one owner, planner/devices.py: written by
``save_user_device``, read by ``load_devices``).

Why by head dim: the CPU kernel's FLOP rate depends on it (heads of 16 ran at 37.5 GFLOP/s
against 60 for heads of 64, measured side by side), and a table at one head dim scaled by FLOPs
priced the 16-wide test model 1.6x short. The hand figures below are built so that the two
tables disagree about the rate, which a FLOP scaling of one table cannot reproduce.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from ringctl.errors import UserError
from ringctl.planner.calibrate import calibrate
from ringctl.planner.cost import Workload, estimate, nominal_link
from ringctl.planner.devices import Device, get_device, save_user_device
from ringctl.planner.model import ModelShape, elementwise_bytes_per_token
from ringctl.planner.timing import linear_flops_per_token

KINDS = ("full", "diag", "half")


def _table(seconds_at_1024: float) -> dict:
    """A table whose seconds grow as n^2 from ``seconds_at_1024`` (forward; backward 2x)."""
    return {
        k: {
            n: (seconds_at_1024 * (n / 1024) ** 2, 2 * seconds_at_1024 * (n / 1024) ** 2)
            for n in (1024, 4096)
        }
        for k in KINDS
    }


def _device(**kw) -> Device:
    # heads of 16 take 0.5 s where FLOP scaling of the 64 table would say 0.25: half the rate
    base = dict(
        name="cpu-test",
        mem_gib=64.0,
        tflops={"float32": 0.1},
        matmul_efficiency=1.0,
        block_seconds={16: _table(0.5), 64: _table(1.0)},
        calib_heads=8,
        cores=4,
    )
    return Device(**(base | kw))


def _time(device, head_dim, n=1024, heads=8, ranks_on_host=1):
    shape = dict(dtype="float32", batch=1, heads=heads, head_dim=head_dim)
    return device.block_time("full", n, ranks_on_host=ranks_on_host, **shape)


def test_each_head_dim_is_priced_from_its_own_table():
    d = _device()
    assert _time(d, 16) == pytest.approx((0.5, 1.0))
    assert _time(d, 64) == pytest.approx((1.0, 2.0))
    # one table scaled by FLOPs (the old rule) would price heads of 16 at 0.25 s
    assert _time(Device(**{**_device().__dict__, "block_seconds": {64: _table(1.0)}}), 16)[
        0
    ] == pytest.approx(0.25)


def test_between_two_head_dims_the_price_is_log_interpolated():
    """At 32 (halfway in log between 16 and 64): each table scaled to 32 by FLOPs (1.0 s and
    0.5 s), then their geometric mean."""
    f, b = _time(_device(), 32)
    assert f == pytest.approx(math.sqrt(1.0 * 0.5)) and b == pytest.approx(2 * f)


def test_beyond_the_measured_head_dims_the_nearest_table_scales_by_flops():
    assert _time(_device(), 128)[0] == pytest.approx(2.0)
    assert _time(_device(), 8)[0] == pytest.approx(0.25)


def test_heads_sizes_and_ranks_beyond_the_cores_scale_the_time():
    d = _device()
    assert _time(d, 64, heads=16)[0] == pytest.approx(2.0)
    assert _time(d, 64, n=2048)[0] == pytest.approx(4.0)  # between measured sizes: n^2 here
    assert _time(d, 64, ranks_on_host=8)[0] == pytest.approx(2.0)  # 8 ranks on 4 cores


def test_the_device_file_round_trips_tables_by_head_dim(tmp_path):
    path = tmp_path / "devices.json"
    written = _device()
    save_user_device(written, path)
    read = get_device("cpu-test", path)
    assert read.block_seconds == written.block_seconds
    assert (read.calib_heads, read.tflops, read.matmul_efficiency) == (8, {"float32": 0.1}, 1.0)
    assert set(json.loads(path.read_text())["cpu-test"]["block_seconds"]) == {"16", "64"}


def test_an_entry_calibrated_at_one_head_dim_reads_as_before(tmp_path):
    """Files written before head dims were measured: one table of kinds at calib_shape."""
    blocks = {k: {"1024": [0.01, 0.02], "4096": [0.16, 0.32]} for k in KINDS}
    entry = {"mem_gib": 64, "block_seconds": blocks, "cores": 4, "calib_shape": [1, 8, 64]}
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"cpu-old": entry}))
    d = get_device("cpu-old", path)
    assert set(d.block_seconds) == {64} and d.calib_heads == 8
    assert _time(d, 64) == pytest.approx((0.01, 0.02))
    assert _time(d, 16) == pytest.approx((0.0025, 0.005))  # FLOP scaling, as before


def _tiny_score(seq_len=8192) -> Workload:
    """The tiny Mistral of benchmarks/longdoc_scaling, scoring ``seq_len`` tokens."""
    m = ModelShape(
        layers=2, hidden=64, intermediate=128, vocab=256, heads=4, kv_heads=2, head_dim=16
    )
    return Workload(
        seq_len=seq_len,
        heads=4,
        kv_heads=2,
        head_dim=16,
        dtype="float32",
        model=m,
        mode="score",
        backward=False,
    )


def test_a_calibrated_cpu_prices_the_whole_model_with_its_matmul_rate():
    """Projections and MLP at the measured rate (tflops at efficiency 1), shared by the ranks
    beyond the cores like the attention blocks."""
    w = _tiny_score()
    m = w.model
    d = _device()
    est = estimate(w, 2, d, nominal_link(d), ranks_on_host=2, overlap_threshold=False)
    tokens = 8192 / 2
    want = tokens * linear_flops_per_token(m, 4, 2, 16) / 0.1e12
    assert est.model_s["projections + MLP (forward)"] == pytest.approx(want)
    crowded = estimate(w, 2, d, nominal_link(d), ranks_on_host=8, overlap_threshold=False)
    assert crowded.model_s["projections + MLP (forward)"] == pytest.approx(2 * want)


def test_a_rate_by_width_prices_each_matmul_at_its_own_width():
    """The tiny model (hidden 64, MLP 128, q 64, k/v 32, vocab 256) with 50 GFLOP/s measured 64
    wide and 200 at 1024: every matmul summing over 64 at 50, the MLP's down projection (over
    128, a quarter of the way from 64 to 1024 in log) at 50 x 4^0.25. Backward: the input's
    gradient at the rate of the out width (32 is below the table: 50), the weight's at 200."""
    w = _tiny_score()
    d = _device(matmul_tflops_by_width={64: 0.05, 1024: 0.2})
    est = estimate(w, 2, d, nominal_link(d), ranks_on_host=2, overlap_threshold=False)
    tokens, slow, down = 4096, 0.05e12, 0.05e12 * 4**0.25
    per_layer = {(64, 64): 2, (64, 32): 2, (64, 128): 2, (128, 64): 1}  # (in, out): how many
    fwd = sum(
        c * 2 * tokens * k * n / (down if k == 128 else slow) for (k, n), c in per_layer.items()
    )
    assert est.model_s["projections + MLP (forward)"] == pytest.approx(2 * fwd)
    assert est.model_s["lm_head (forward)"] == pytest.approx(2 * tokens * 64 * 256 / slow)
    trains = estimate(
        replace(w, mode="train", backward=True),
        2,
        d,
        nominal_link(d),
        ranks_on_host=2,
        overlap_threshold=False,
    )
    flops = {shape: c * 2 * tokens * shape[0] * shape[1] for shape, c in per_layer.items()}
    bwd = sum(f / (down if n == 128 else slow) + f / 0.2e12 for (k, n), f in flops.items())
    assert trains.model_s["projections + MLP (backward)"] == pytest.approx(2 * bwd)
    # an entry without the table: every matmul at tflops, the backward twice the forward
    plain = estimate(
        replace(w, mode="train", backward=True),
        2,
        _device(),
        nominal_link(d),
        ranks_on_host=2,
        overlap_threshold=False,
    )
    f, b = (plain.model_s[f"projections + MLP ({p})"] for p in ("forward", "backward"))
    assert b == pytest.approx(2 * f)


def test_the_rate_by_width_round_trips_and_a_bad_one_is_refused(tmp_path):
    path = tmp_path / "devices.json"
    save_user_device(_device(matmul_tflops_by_width={64: 0.05, 1024: 0.2}), path)
    assert get_device("cpu-test", path).matmul_tflops_by_width == {64: 0.05, 1024: 0.2}
    for bad in ({"64": 0}, {"0": 0.1}, {"64": None}, [0.1]):
        entry = json.loads(path.read_text())
        entry["cpu-test"]["matmul_tflops_by_width"] = bad
        path.write_text(json.dumps(entry))
        with pytest.raises(UserError, match="cpu-test.*bad or missing field"):
            get_device("cpu-test", path)


def test_elementwise_bytes_are_counted_from_the_layer_by_hand():
    """2 layers x (2 norms x 3 x 64 + RoPE 5 x (64 + 32) + 2 residuals x 64 + 2 x 128) =
    2 x 1248 values, then the final norm (3 x 64) and the log-softmax (256): float32."""
    m = _tiny_score().model
    assert elementwise_bytes_per_token(m, 4, 2, 16, 4) == 4 * (2 * 1248 + 192 + 256)


def test_a_measured_elementwise_rate_prices_norms_rope_and_activations():
    """Tokens x bytes per token at the measured rate, shared beyond the cores; the backward
    twice the forward. An entry without the rate (datasheet GPUs) prices none, as before."""
    w = _tiny_score()
    d = _device(elementwise_gbytes_s=2.0)
    est = estimate(w, 2, d, nominal_link(d), ranks_on_host=2, overlap_threshold=False)
    want = 4096 * 11776 / 2e9
    assert est.model_s["norms, RoPE, activations (forward)"] == pytest.approx(want)
    plain = estimate(w, 2, _device(), nominal_link(d), ranks_on_host=2, overlap_threshold=False)
    assert not any("norms" in part for part in plain.model_s)
    assert est.model_total_s == pytest.approx(plain.model_total_s + want)
    crowded = estimate(w, 2, d, nominal_link(d), ranks_on_host=8, overlap_threshold=False)
    assert crowded.model_s["norms, RoPE, activations (forward)"] == pytest.approx(2 * want)
    trains = estimate(
        replace(w, mode="train", backward=True),
        2,
        d,
        nominal_link(d),
        ranks_on_host=2,
        overlap_threshold=False,
    )
    assert trains.model_s["norms, RoPE, activations (backward)"] == pytest.approx(2 * want)


def test_the_elementwise_rate_round_trips_and_a_bad_one_is_refused(tmp_path):
    path = tmp_path / "devices.json"
    save_user_device(_device(elementwise_gbytes_s=1.5), path)
    assert get_device("cpu-test", path).elementwise_gbytes_s == 1.5
    entry = json.loads(path.read_text())
    entry["cpu-test"]["elementwise_gbytes_s"] = -1
    path.write_text(json.dumps(entry))
    with pytest.raises(UserError, match="cpu-test.*elementwise_gbytes_s"):
        get_device("cpu-test", path)


def test_calibration_measures_every_head_dim_and_the_matmul_rate():
    """A real (small) calibration of this machine: the engine's own ring on LocalRing."""
    logged = []
    d = calibrate(
        sizes=(64, 128), head_dims=(16, 32), repeats=1, matmul_widths=(64, 256), log=logged.append
    )
    assert set(d.block_seconds) == {16, 32}
    for table in d.block_seconds.values():
        assert set(table) == set(KINDS)
        assert all(f > 0 and b > 0 for sizes in table.values() for f, b in sizes.values())
    assert d.tflops["float32"] > 0 and d.matmul_efficiency == 1.0
    assert set(d.matmul_tflops_by_width) == {64, 256}
    assert max(d.matmul_tflops_by_width.values()) == d.tflops["float32"]
    assert d.elementwise_gbytes_s > 0
    assert any("d= 32 n=  128" in line for line in logged), logged


def test_rings_of_a_job_share_their_hosts_memory_and_cores(tmp_path, capsys, monkeypatch):
    """The ranks on a calibrated CPU host share its RAM and cores whatever the ring size:
    priced by the ring's ranks, 4 rings of 1 rank on a 23.5 GiB host were each given 22.5 GiB
    (66 GiB in all), "fits", exit 0, by `ringctl plan` and by submit's preflight alike."""
    import ringctl.planner.devices as devices
    from ringctl.cli import main
    from ringctl.config import load_job
    from ringctl.sizing import Sizing

    blocks = {k: {"1024": [0.01, 0.02], "4096": [0.16, 0.32]} for k in KINDS}
    entry = {"mem_gib": 23.5, "reserve_gib": 1.0, "block_seconds": blocks, "cores": 2}
    path = tmp_path / "devices.json"
    path.write_text(json.dumps({"cpu-host": entry | {"calib_shape": [1, 8, 64]}}))
    monkeypatch.setattr(devices, "USER_DEVICES", path)
    train = "jobs/train.yaml"
    for size in ("1", "2", "null"):
        shape = ["tasks_per_node=4", f"ring.size={size}"]
        assert main(["plan", train, *shape, "--device", "cpu-host", "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["memory_capacity_gib"] == 22.5 / 4, size
        cfg = load_job(train, [*shape, "device=cpu-host"])
        assert Sizing(cfg).preflight().estimate.memory_capacity_gib == 22.5 / 4, size


def test_a_jobs_makespan_shares_its_hosts_cores(tmp_path, capsys, monkeypatch):
    """The makespan `ringctl plan JOB` predicts (and submit's slurm.time warning) priced each
    ring as if alone on its host: 4 rings of 1 rank on one 2-core host at the speed of 4
    rings on 4 hosts (1.26 s for 2.51)."""
    import re

    import ringctl.planner.devices as devices
    from ringctl.cli import main

    blocks = {k: {"1024": [0.01, 0.02], "4096": [0.16, 0.32]} for k in KINDS}
    entry = {"mem_gib": 23.5, "reserve_gib": 1.0, "block_seconds": blocks, "cores": 2}
    path = tmp_path / "devices.json"
    path.write_text(json.dumps({"cpu-host": entry | {"calib_shape": [1, 8, 64]}}))
    monkeypatch.setattr(devices, "USER_DEVICES", path)
    spans = {}
    shapes = (
        "nodes=1 tasks_per_node=4",
        "nodes=4 tasks_per_node=1",
        "backend=local nodes=4 tasks_per_node=1",
    )
    for shape in shapes:
        job = ["jobs/longdoc.yaml", "backend=slurm", *shape.split(), "ring.size=1"]
        job += ["task.model_path=bundled:demo-byte-llama", "--device", "cpu-host"]
        assert main(["plan", *job]) == 0
        said = re.search(r"the job's \(ring.size=1\): ([0-9.]+) s", capsys.readouterr().out)
        spans[shape] = float(said.group(1))
    shared, alone, local = spans.values()
    assert shared == pytest.approx(2 * alone, rel=0.01), spans  # 4 ranks' threads on 2 cores
    assert local == shared, spans  # the local backend: every rank on this host
