"""The test cluster itself (scripts/test-cluster): four emulated nodes under two leaf switches,
and a gloo all_reduce across them through srun. Plain sbatch/squeue here, no ringctl code, so a
failure points at the cluster rather than at the backends."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slurm

FINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")


def run(*argv: str) -> str:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, f"{argv} failed: {proc.stderr}"
    return proc.stdout


def sbatch_and_wait(script: Path, timeout: float = 120) -> tuple[str, str]:
    """Submit; wait until squeue shows a final state. Returns (job id, state)."""
    job_id = run("sbatch", "--parsable", f"--chdir={script.parent}", str(script)).strip()
    job_id = job_id.split(";")[0]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = run("squeue", "-h", "-t", "all", "-j", job_id, "-o", "%T").strip()
        if state in FINAL:
            return job_id, state
        time.sleep(0.5)
    subprocess.run(["scancel", job_id], check=False)
    pytest.fail(f"job {job_id} did not finish within {timeout}s")


def test_nodes_and_switch_topology(slurm_cluster):
    nodes = run("sinfo", "-h", "-N", "-o", "%N %t").split("\n")
    assert sorted(ln.split()[0] for ln in nodes if ln) == ["n1", "n2", "n3", "n4"]
    topo = run("scontrol", "show", "topology")
    assert "SwitchName=leaf1" in topo and "Nodes=n[1-2]" in topo
    assert "SwitchName=leaf2" in topo and "Nodes=n[3-4]" in topo
    assert "SwitchName=spine" in topo and "Switches=leaf[1-2]" in topo


def test_four_node_job_sees_nodes_and_topology(slurm_cluster, tmp_path):
    script = tmp_path / "job.sh"
    script.write_text(
        "#!/bin/bash\n"
        "#SBATCH --nodes=4 --ntasks-per-node=1 --time=2 --output=batch.out\n"
        'echo "NODELIST=$SLURM_JOB_NODELIST"\n'
        'scontrol show hostnames "$SLURM_JOB_NODELIST" | sed "s/^/HOST=/"\n'
        "srun bash -c 'echo TASK=$SLURM_PROCID:$SLURMD_NODENAME:$SLURM_TOPOLOGY_ADDR'\n"
    )
    _, state = sbatch_and_wait(script)
    out = (tmp_path / "batch.out").read_text()
    assert state == "COMPLETED", out
    assert "NODELIST=n[1-4]" in out
    assert [ln[5:] for ln in out.splitlines() if ln.startswith("HOST=")] == [
        "n1",
        "n2",
        "n3",
        "n4",
    ]
    tasks = sorted(ln[5:].split(":") for ln in out.splitlines() if ln.startswith("TASK="))
    assert tasks == [
        ["0", "n1", "spine.leaf1.n1"],
        ["1", "n2", "spine.leaf1.n2"],
        ["2", "n3", "spine.leaf2.n3"],
        ["3", "n4", "spine.leaf2.n4"],
    ]


ALLREDUCE = """
import datetime, json, os, sys
import torch
import torch.distributed as dist
from submitit.helpers import TorchDistributedEnvironment

master_env = os.environ["MASTER_ADDR"]  # what the batch script chose
env = TorchDistributedEnvironment().export(set_cuda_visible_devices=False, overwrite=True)
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
t = torch.tensor([float(env.rank + 1)])
dist.all_reduce(t)
with open(os.path.join(sys.argv[1], f"rank-{env.rank}.json"), "w") as f:
    json.dump({
        "rank": env.rank, "world": env.world_size, "sum": t.item(),
        "node": os.environ["SLURMD_NODENAME"], "master": env.master_addr,
        "master_env": master_env, "port": env.master_port,
        "topology": os.environ.get("SLURM_TOPOLOGY_ADDR"),
    }, f)
dist.destroy_process_group()
"""


def test_gloo_all_reduce_across_four_nodes(slurm_cluster, tmp_path):
    (tmp_path / "allreduce.py").write_text(ALLREDUCE)
    (tmp_path / "out").mkdir()
    script = tmp_path / "job.sh"
    script.write_text(
        "#!/bin/bash\n"
        "#SBATCH --nodes=4 --ntasks-per-node=1 --time=3 --output=batch.out\n"
        "set -euo pipefail\n"
        # rendezvous from the allocation: the first node, and a port derived from the job id
        'export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)\n'
        "export MASTER_PORT=$((20000 + SLURM_JOB_ID % 20000))\n"
        # submitit's TorchDistributedEnvironment reads Slurm's variables once told it is Slurm
        "export OMP_NUM_THREADS=1 SUBMITIT_EXECUTOR=slurm\n"
        f"srun --kill-on-bad-exit=1 {sys.executable} allreduce.py out\n"
    )
    job_id, state = sbatch_and_wait(script, timeout=240)
    assert state == "COMPLETED", (tmp_path / "batch.out").read_text()
    results = [json.loads(p.read_text()) for p in sorted((tmp_path / "out").glob("rank-*.json"))]
    assert [r["rank"] for r in results] == [0, 1, 2, 3]
    assert all(r["sum"] == 10.0 and r["world"] == 4 for r in results)
    assert [r["node"] for r in results] == ["n1", "n2", "n3", "n4"]
    assert {r["master"] for r in results} == {"n1"} == {r["master_env"] for r in results}
    assert {r["port"] for r in results} == {20000 + int(job_id) % 20000}
    assert results[2]["topology"] == "spine.leaf2.n3"
