"""The Slurm batch script: its lines, quoting of config values, and a run under a fake srun."""

from __future__ import annotations

import json
import os
import random
import re
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from ringctl.backends import slurm_states as ss
from ringctl.cli import main
from ringctl.config import load_job
from ringctl.errors import UserError
from ringctl.render import quote, render_script
from ringctl.sbatch import header_words

REPO = Path(__file__).resolve().parents[1]
SMOKE = REPO / "jobs" / "smoke.yaml"
LONGDOC = REPO / "jobs" / "longdoc.yaml"
EVIL = "x; rm -rf ~"


def sbatch_options(script: str) -> list[list[str]]:
    """The #SBATCH lines as sbatch reads them (by its own rules: `ringctl.sbatch.header_words`,
    checked against the real sbatch in test_sbatch_injection)."""
    return [header_words(line) for line in script.splitlines() if line.startswith("#SBATCH")]


def bash_n(script: str, tmp_path: Path) -> None:
    path = tmp_path / "job.sh"
    path.write_text(script)
    proc = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_smoke_script(tmp_path):
    script = render_script(load_job(SMOKE, ["backend=slurm"]))
    bash_n(script, tmp_path)
    opts = [o[0] for o in sbatch_options(script)]
    for want in (
        "--job-name=smoke",
        "--nodes=4",
        "--ntasks-per-node=1",
        "--time=00:05:00",
        "--signal=USR1@60",
        "--output=logs/batch-%j.out",
    ):
        assert want in opts
    assert not any(o.startswith("--gpus") for o in opts)
    # all #SBATCH lines come before the first command, or sbatch ignores them
    first_cmd = next(
        i
        for i, ln in enumerate(script.splitlines()[1:], 1)
        if ln.strip() and not ln.startswith("#")
    )
    assert all(
        i < first_cmd for i, ln in enumerate(script.splitlines()) if ln.startswith("#SBATCH")
    )
    assert 'ringctl topo probe -o "probes/$SLURMD_NODENAME.json"' in script
    assert "--slurm-topology" in script and "--ranks-per-node 1 -o placement.json" in script
    assert 'scontrol show hostnames "$SLURM_JOB_NODELIST"' in script
    assert "MASTER_PORT=$((20000 + SLURM_JOB_ID % 12000))" in script
    srun = script[script.index("srun --kill-on-bad-exit=1") :]
    assert "--output=logs/rank-%t.out --error=logs/rank-%t.err" in srun
    assert '-m ringctl.worker "$JOB_DIR"' in srun
    assert script.count("srun --kill-on-bad-exit") == 1
    assert "NCCL" not in script.replace("NCCL operations", "")


def test_gpu_container_and_environment(tmp_path):
    cfg = load_job(
        SMOKE,
        [
            "gpus_per_node=8",
            "tasks_per_node=8",
            "task.seq_len=4096",
            "slurm.partition=gpu",
            "slurm.account=proj",
            "slurm.exclusive=true",
            "slurm.switches=1@00:10:00",
            "env.modules=[cuda/12.4,nccl]",
            "env.venv=~/venvs/ring",
            "env.vars={NCCL_IB_HCA: mlx5}",
            "env.container_image=nvcr.io#nvidia/pytorch:24.05-py3",
            "ring.placement=required",
            "slurm.extra_sbatch=[--mail-type END,--comment=hello]",
        ],
    )
    script = render_script(cfg, job_dir="/scratch/me/job 1")
    bash_n(script, tmp_path)
    opts = sbatch_options(script)
    flat = [o[0] for o in opts]
    for want in (
        "--gpus-per-node=8",
        "--partition=gpu",
        "--account=proj",
        "--exclusive",
        "--switches=1@00:10:00",
        "--chdir=/scratch/me/job 1",
        "--output=/scratch/me/job 1/logs/batch-%j.out",
        "--comment=hello",
    ):
        assert want in flat, want
    assert "--mail-type=END" in flat  # `--mail-type END` written as one word
    assert "module load cuda/12.4\nmodule load nccl\n" in script
    assert 'source "$HOME"/venvs/ring/bin/activate' in script
    assert "export NCCL_IB_HCA=mlx5" in script
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING=1" in script
    assert "--container-image='nvcr.io#nvidia/pytorch:24.05-py3'" in script
    assert "JOB_DIR='/scratch/me/job 1'" in script
    assert "PY=python3" in script  # a venv/container brings its own interpreter
    assert "ring.placement=required" in script and "exit 1" in script


def test_plan_off_skips_the_probe(tmp_path):
    script = render_script(load_job(SMOKE, ["ring.placement=skip"]))
    bash_n(script, tmp_path)
    assert (
        "topo probe" not in script
        and "placement.json" not in script.split("ring.placement=skip")[1]
    )


def test_hostile_values_stay_words(tmp_path):
    """In the script's body, a value like `x; rm -rf ~` is data: every occurrence is quoted."""
    cfg = load_job(
        SMOKE,
        [
            f"env.container_image={EVIL}",
            "env.modules=['`id`', \"a'b\"]",
            "env.vars={X: '$(reboot)'}",
        ],
    )
    script = render_script(cfg, job_dir="/tmp/a dir; echo hi")
    bash_n(script, tmp_path)
    body = script[script.index("set -eo pipefail") :]
    for value in (EVIL, "/tmp/a dir; echo hi", "$(reboot)"):
        starts = [m.start() for m in re.finditer(re.escape(value), body)]
        assert starts, value
        for i in starts:  # wrapped in single quotes: the shell sees it as data
            rest_of_line = body[i + len(value) :].split("\n")[0]
            assert body[i - 1] == "'" and "'" in rest_of_line, body[i - 30 : i + 60]
    assert ["--chdir=/tmp/a dir; echo hi"] in sbatch_options(script)
    assert "module load '`id`'" in script and "module load 'a'\"'\"'b'" in script


@pytest.mark.parametrize(
    "override",
    [f"name={EVIL}", "slurm.partition=$(touch pwned)", "slurm.extra_sbatch=[--comment=a\\'b]"],
)
def test_hostile_header_values_are_refused(override):
    """In the header (read by sbatch, not bash) they are refused, naming the key; the corpus on
    the real sbatch is in test_sbatch_injection."""
    key = override.split("=")[0]
    with pytest.raises(UserError, match=rf"override .*: {re.escape(key)}(\[0\])?: "):
        load_job(SMOKE, [override])


def test_quote_refuses_newlines():
    with pytest.raises(ValueError):
        quote("a\nb")
    assert quote(None) == "''" and quote(True) == "true" and quote(3) == "3"


def test_cli_render(capsys):
    assert main(["render", str(SMOKE), "backend=slurm", "slurm.partition=debug"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("#!/bin/bash\n") and "#SBATCH --partition=debug\n" in out


# --- the script run for real, with a fake srun/scontrol -----------------------------------------

FAKE_SRUN = r'''#!/usr/bin/env python3
"""A tiny srun: runs the command once per task with Slurm's variables; %t and %N in paths."""
import os, subprocess, sys, time
args, opts = sys.argv[1:], {}
while args and args[0].startswith("--"):
    key, _, value = args.pop(0)[2:].partition("=")
    opts[key] = value
nodes = os.environ["FAKE_NODES"].split()[: int(opts.get("nodes", len(os.environ["FAKE_NODES"].split())))]
per_node = int(opts.get("ntasks-per-node", "1"))
ntasks = int(opts.get("ntasks", len(nodes) * per_node))
if os.environ.get("FAKE_FAIL") and os.environ["FAKE_FAIL"] in " ".join(args):
    print("srun: error: fake failure", file=sys.stderr)
    sys.exit(1)
procs = []
for t in range(ntasks):
    node = nodes[t // per_node]
    if os.environ.get("FAKE_FAIL_NODE") == node and "topo probe" in " ".join(args):
        procs.append(subprocess.Popen(["false"]))  # this node's probe fails, the others run
        continue
    env = dict(os.environ, SLURM_PROCID=str(t), SLURM_LOCALID=str(t % per_node),
               SLURMD_NODENAME=node, SLURM_NTASKS=str(ntasks), SLURM_STEP_ID="0")
    def path(p):
        return p.replace("%t", str(t)).replace("%N", node) if p else None
    out = open(path(opts.get("output")), "ab") if opts.get("output") else None
    err = open(path(opts.get("error")), "ab") if opts.get("error") else out
    procs.append(subprocess.Popen(args, env=env, stdout=out, stderr=err))
codes = {}
while len(codes) < len(procs):
    for i, p in enumerate(procs):
        if i not in codes and p.poll() is not None:
            codes[i] = p.returncode
            if p.returncode and "kill-on-bad-exit" in opts:
                for q in procs:
                    if q.poll() is None:
                        q.kill()
    time.sleep(0.05)
bad = [c for c in codes.values() if c]
sys.exit(bad[0] if bad else 0)
'''

FAKE_SCONTROL = """#!/bin/sh
if [ "$1 $2" = "show hostnames" ]; then for n in $FAKE_NODES; do echo "$n"; done; exit 0; fi
exit 1
"""


def _free_port(low: int, high: int) -> int:
    """A port in [low, high) nothing holds now."""
    for port in random.sample(range(low, high), 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise AssertionError(f"no free port in {low}..{high}")


def _fake_slurm(tmp_path: Path) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text.replace("#!/usr/bin/env python3", f"#!{sys.executable}"))
        (bin_dir / name).chmod(0o755 | stat.S_IXUSR)
    port = _free_port(20000, 32000)  # the script derives the port as 20000 + job id % 12000
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
    env.update(
        PATH=f"{bin_dir}{os.pathsep}{env['PATH']}",
        SLURM_JOB_ID=str(port - 20000),
        SLURM_JOB_NODELIST="fake[1-2]",
        FAKE_NODES="127.0.0.1 127.0.0.2",
        OMP_NUM_THREADS="1",
        HOME=str(tmp_path / "home"),
    )
    (tmp_path / "home").mkdir()
    return env


def _job_dir(tmp_path: Path, overrides: list[str]) -> Path:
    from ringctl.config import to_yaml

    cfg = load_job(
        SMOKE,
        ["backend=slurm", "nodes=2", "timeout=30", "task.seq_len=64", "task.steps=1", *overrides],
    )
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    (job_dir / "config.yaml").write_text(to_yaml(cfg))
    (job_dir / "job.sh").write_text(render_script(cfg))
    return job_dir


def _run_script(job_dir: Path, env: dict, timeout: float = 240) -> subprocess.CompletedProcess:
    """The rendered job.sh, run by bash in its directory under the fake Slurm tools."""
    return subprocess.run(
        ["bash", "job.sh"], cwd=job_dir, env=env, capture_output=True, text=True, timeout=timeout
    )


def test_script_runs_the_ring_under_a_fake_srun(tmp_path):
    """The rendered script, executed: probe fails (optional plan), then 2 ranks run the task.
    An exported variable is hostile; nothing it says gets executed."""
    hostile = "x; touch PWNED; $(touch PWNED2) ~"
    job_dir = _job_dir(
        tmp_path, ["name=a b", f"env.vars={{X: '{hostile}'}}", "ring.placement=optional"]
    )
    env = _fake_slurm(tmp_path)
    env["FAKE_FAIL"] = "topo probe"
    proc = _run_script(job_dir, env)
    assert proc.returncode == 0, (
        proc.stdout
        + proc.stderr
        + "".join(p.read_text() for p in (job_dir / "logs").glob("rank-*.err"))
    )
    assert "no placement (ring.placement=optional)" in proc.stdout
    assert "all 2 ranks finished" in proc.stdout
    assert ss.ranks_part(proc.stdout) is not None  # the line status reads srun's lines after
    assert sorted(p.name for p in (job_dir / "out").glob("*.safetensors")) == [
        "rank-0.safetensors",
        "rank-1.safetensors",
    ]
    assert (
        "on 127.0.0.2 (local rank 0) -> ring rank 1 of 2"
        in (job_dir / "logs" / "rank-1.out").read_text()
    )
    assert not list(tmp_path.rglob("PWNED*"))


def test_a_one_rank_script_says_rank_and_status_still_finds_its_srun_lines(tmp_path):
    """The script said "starting 1 ranks"; status reads srun's lines after that line, so the
    script's words and its pattern change together (both wordings are read)."""
    job_dir = _job_dir(tmp_path, ["nodes=1", "tasks_per_node=1", "ring.placement=skip"])
    proc = _run_script(job_dir, _fake_slurm(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "starting 1 rank;" in proc.stdout and "all 1 rank finished" in proc.stdout
    assert ss.ranks_part(proc.stdout) is not None
    assert ss.ranks_part("00:00:00 ringctl-job: starting 2 ranks; rendezvous") is not None


def test_script_fails_clearly_without_a_required_plan(tmp_path):
    job_dir = _job_dir(tmp_path, ["ring.placement=required"])
    env = _fake_slurm(tmp_path)
    env["FAKE_FAIL"] = "topo probe"
    # (hostile-input review) a submitting shell's RINGCTL_PROBE_MINUTES reached the script
    # (sbatch exports the environment) unchecked: 0 made the probe step unbounded
    env["RINGCTL_PROBE_MINUTES"] = "0"
    proc = _run_script(job_dir, env, timeout=60)
    assert proc.returncode == 1
    assert (
        "FAILED: no placement, so no rank was started (ring.placement=required): the node "
        "probe failed or did not end within 5 min on 127.0.0.1 127.0.0.2 (see "
        "logs/probe-*.out). Fix it" in proc.stderr
    )
    assert ss.ranks_part(proc.stdout + proc.stderr) is None
    assert not list((job_dir / "logs").glob("rank-*"))


def test_a_64_node_job_s_script_bounds_its_probe_and_asks_what_slurm_does_not_pass_on():
    """(scale review) The probe step had no bound: one node whose nvidia-smi hangs held all
    512 GPUs idle until the job's time limit (reproduced on the test cluster: TIMEOUT, no
    node named). srun does not inherit sbatch's --cpus-per-task since Slurm 22.05
    (sbatch(1)): the ranks ran on one CPU each where 16 were asked. --exclusive gives a job
    all its nodes' CPUs and GPUs but only the memory it asks for (sbatch(1): "use --mem=0")."""
    from ringctl.config import load_job
    from ringctl.render import render_script

    shape = ["nodes=64", "gpus_per_node=8", "tasks_per_node=8"]
    script = render_script(load_job("jobs/attention.yaml", [*shape, "slurm.cpus_per_task=16"]))
    assert '--time="$PROBE_MINUTES" --output=logs/probe-%n.out' in script
    assert "\nPROBE_MINUTES=5\n" in script
    given = load_job("jobs/attention.yaml", [*shape, "env.vars.RINGCTL_PROBE_MINUTES=12"])
    assert "\nPROBE_MINUTES=12\n" in render_script(given)
    assert "export SRUN_CPUS_PER_TASK=16\n" in script
    assert "#SBATCH --exclusive\n#SBATCH --mem=0\n" in script  # attention.yaml: exclusive
    given = render_script(load_job("jobs/attention.yaml", [*shape, "slurm.mem=200G"]))
    assert "#SBATCH --mem=200G\n" in given and "--mem=0" not in given
    # (re-reading) sbatch refuses --mem beside --mem-per-gpu/--mem-per-cpu ("mutually
    # exclusive"): a job asking memory so gets no --mem=0
    for option in ("--mem-per-gpu=80G", "--mem-per-cpu=4G"):
        extra = render_script(
            load_job("jobs/attention.yaml", [*shape, f"slurm.extra_sbatch=[{option}]"])
        )
        assert f"#SBATCH {option}\n" in extra and "--mem=0" not in extra, option
    image = ["env.container_image=nvcr.io#nvidia/pytorch:24.05-py3"]
    boxed = render_script(load_job("jobs/attention.yaml", [*shape, *image]))
    assert "\nPROBE_MINUTES=20\n" in boxed  # an image to import first
    plain = render_script(load_job("jobs/smoke.yaml", [*shape, "task.seq_len=1024"]))
    assert "SRUN_CPUS_PER_TASK" not in plain and "--mem" not in plain


def test_a_failed_probe_names_the_nodes_it_did_not_finish_on(tmp_path):
    """(re-reading) The failure named every node of the job whose probes/<node>.json is
    missing; an earlier attempt's file for the failing node would have hidden it. The
    earlier files go first, and the node named is the one that failed."""
    job_dir = _job_dir(tmp_path, ["ring.placement=required"])
    (job_dir / "probes").mkdir(exist_ok=True)
    (job_dir / "probes" / "127.0.0.2.json").write_text("{}")  # an earlier attempt's
    env = _fake_slurm(tmp_path)
    env["FAKE_FAIL_NODE"] = "127.0.0.2"
    proc = _run_script(job_dir, env, timeout=60)
    assert proc.returncode == 1
    (line,) = [ln for ln in proc.stderr.splitlines() if "FAILED: no placement" in ln]
    assert "did not end within 5 min on 127.0.0.2 (see logs/probe-*.out)" in line, line
    assert (job_dir / "probes" / "127.0.0.1.json").is_file()


def test_a_failed_placement_says_why_on_the_failed_line(tmp_path):
    """status shows the batch script's FAILED line: it said "Fix the cause above", with the
    cause in logs/placement.log, which status does not show."""
    job_dir = _job_dir(tmp_path, ["ring.placement=required", "ring.nvlink_blocks=true"])
    proc = _run_script(job_dir, _fake_slurm(tmp_path), timeout=60)
    assert proc.returncode == 1
    (line,) = [ln for ln in proc.stderr.splitlines() if "FAILED: no placement" in ln]
    assert "the placement failed: ringctl topo: error: --nvlink-blocks needs a " in line, line


def test_script_places_the_ring_with_ringctl_topo(tmp_path):
    """The whole script with the real `ringctl topo probe` + `ringctl topo`: 2 nodes x 2 ranks,
    each rank taking its ring position from placement.json."""
    job_dir = _job_dir(tmp_path, ["ring.placement=required", "tasks_per_node=2"])
    env = _fake_slurm(tmp_path)
    proc = _run_script(job_dir, env)
    logs = "".join(p.read_text() for p in sorted((job_dir / "logs").glob("*")) if p.is_file())
    assert proc.returncode == 0, proc.stdout + proc.stderr + logs
    assert "placement written to placement.json" in proc.stdout
    plan = json.loads((job_dir / "placement.json").read_text())
    assert sorted((e["node"], e["local_rank"]) for e in plan["ring"]) == [
        ("127.0.0.1", 0),
        ("127.0.0.1", 1),
        ("127.0.0.2", 0),
        ("127.0.0.2", 1),
    ]
    for entry in plan["ring"]:
        task = (0 if entry["node"] == "127.0.0.1" else 2) + entry["local_rank"]
        out = (job_dir / "logs" / f"rank-{task}.out").read_text()
        assert f"-> ring rank {entry['rank']} of 4 (from placement.json)" in out
    assert len(list((job_dir / "out").glob("rank-*.safetensors"))) == 4


def test_ring_keys_reach_the_placement_step():
    """ring.size, ring.nvlink_blocks and ring.network_gbps become `ringctl topo` flags; a size
    that does not divide the job is refused at load, naming the key. (A long-document job:
    the attention task refuses ring.size, which it does not read.)"""
    longdoc = ["task.model_path=null", "tasks_per_node=4"]
    script = render_script(
        load_job(
            LONGDOC, [*longdoc, "ring.size=2", "ring.nvlink_blocks=true", "ring.network_gbps=200"]
        )
    )
    assert "--ring-size 2 \\" in script and "--nvlink-blocks \\" in script
    assert "--bandwidth NET=200.0 \\" in script
    auto = [*longdoc, "ring.size=auto", "ring.max_tokens_per_rank=4096"]
    plain = render_script(load_job(LONGDOC, auto))
    assert "--ring-size" not in plain and "--nvlink-blocks" not in plain
    with pytest.raises(UserError, match="ring.size: 3 does not divide the job's 4 ranks"):
        load_job(SMOKE, ["ring.size=3"])


def test_a_cpu_job_places_cpu_ranks():
    """A job asking no GPU (gpus_per_node: 0, the bundled jobs) or ring.dist_backend=gloo
    runs every rank on its CPU: the placement step is told so (`ringctl topo --cpu`), else a
    GPU node beside a CPU-only one refused the job."""
    gpus = ["gpus_per_node=1", "tasks_per_node=1"]
    assert "      --cpu \\\n" in render_script(load_job(SMOKE, [*gpus, "ring.dist_backend=gloo"]))
    assert "      --cpu \\\n" in render_script(load_job(SMOKE, []))  # gpus_per_node: 0
    for other in ("auto", "nccl"):
        script = render_script(load_job(SMOKE, [*gpus, f"ring.dist_backend={other}"]))
        assert "--cpu" not in script


def test_ulysses_reaches_the_placement_step():
    script = render_script(load_job(SMOKE, ["ring.ulysses=auto"]))
    assert "--ulysses auto \\" in script and "--heads 4 --kv-heads 2 \\" in script
    assert "--ulysses" not in render_script(load_job(SMOKE, []))
    with pytest.raises(UserError, match="ring.ulysses: a Ulysses degree and a numeric ring.size"):
        load_job(SMOKE, ["ring.ulysses=2", "ring.size=2"])


def test_a_job_directory_with_a_comma_is_refused_where_pyxis_mounts_it(tmp_path):
    """pyxis splits --container-mounts at ',' (and a mount at ':'): a job directory with a
    comma mounted a second, user-named path into the container. config.py refuses the paths
    it knows (output_dir, job_dir, ssh.remote_dir); the directory sbatch ran in (a remote
    home, --chdir) is checked by the script before any srun."""
    image = "env.container_image=nvcr.io#nvidia/pytorch:24.05-py3"
    with pytest.raises(UserError, match="ssh.remote_dir: holds ',' or ':'"):
        load_job(SMOKE, ["backend=ssh", "ssh.host=h", "ssh.remote_dir=jobs,/etc", image])
    job_dir = _job_dir(tmp_path, [image])
    odd = job_dir.rename(tmp_path / "job,etc")
    proc = _run_script(odd, _fake_slurm(tmp_path), timeout=60)
    assert proc.returncode == 1
    assert "holds ',' or ':', which pyxis reads as --container-mounts separators" in proc.stderr
    assert "starting" not in proc.stdout
