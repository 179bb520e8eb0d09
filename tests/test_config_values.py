"""A job's values mean what was written (from a read-only review of config loading and
rendering; each case below rendered or ran something else before, exit 0).

* YAML 1.1's guesses: ``slurm.time: 1:30:00`` reached sbatch as ``--time=5400`` (base 60:
  3.75 days), ``account: 0123`` as 83 (octal), ``partition: yes`` as True, ``name: 0x1F`` as 31
  (ringctl/job_yaml.py: YAML 1.2's core scalars).
* text fields given a boolean, float or list: ``export X=False``, ``'[0, 1]'``, ``1000.0``.
* an escaped ``\\${...}`` was resolved again by render (a traceback) and on the nodes.
* env.vars naming the batch script's own variables (JOB_DIR: another directory's config ran).
* 30,000 nested brackets crashed the process (libyaml's C recursion), ``status`` with it.
* more ranks a node than GPUs planned as fitting; a million-squared world hung ``divisors``;
  a 1e-7 s timeout became 0 ms; ``env.python: ~/venv/bin/python`` was quoted with its ``~``.
* ``ringctl plan`` printed negative GiB and NaN times with exit 0 for negative or NaN flags.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from ringctl.cli import main
from ringctl.config import MAX_RANKS, SCRIPT_NAMES, load_job, to_yaml
from ringctl.errors import UserError
from ringctl.render import render_script
from ringctl.rings import divisors

REPO = Path(__file__).resolve().parents[1]
SMOKE = REPO / "jobs" / "smoke.yaml"
TEMPLATE = REPO / "templates" / "slurm.sh.j2"


def _job(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text("name: t\n" + text)
    return path


def _header(cfg) -> dict[str, str]:
    lines = render_script(cfg).splitlines()
    return dict(m.groups() for m in map(re.compile(r"#SBATCH --([a-z-]+)=(.*)").match, lines) if m)


def test_yaml_1_1_guesses_are_text_as_written(tmp_path):
    text = "slurm:\n  time: 1:30:00\n  account: 0123\n  partition: yes\n  qos: off\n"
    cfg = load_job(_job(tmp_path, text), ["backend=slurm"])
    header = _header(cfg)
    assert (header["time"], header["account"]) == ("1:30:00", "0123")
    assert (header["partition"], header["qos"]) == ("yes", "off")
    over = load_job(SMOKE, ["slurm.time=30:00", "name=0x1F", "slurm.account=2026-12-04"])
    assert (over.slurm.time, over.name, over.slurm.account) == ("30:00", "0x1F", "2026-12-04")
    with pytest.raises(UserError, match="nodes"):
        load_job(SMOKE, ["nodes=0x10"])  # not 16
    back = tmp_path / "back.yaml"  # a job directory's config.yaml reads back the same
    back.write_text(to_yaml(cfg))
    assert load_job(back) == cfg


@pytest.mark.parametrize(
    "override, shown",
    [
        ("env.vars.TOKENIZERS_PARALLELISM=false", "boolean False"),
        ("env.vars.CUDA_VISIBLE_DEVICES=[0,1]", "list [0, 1]"),
        ("env.vars.X=1e3", "number 1000.0"),
        ("slurm.partition=true", "boolean True"),
        ("env.modules=[[a,b]]", "list ['a', 'b']"),
    ],
)
def test_text_given_as_another_yaml_type_is_refused(override, shown):
    with pytest.raises(UserError, match=re.escape(f"expected text, got the YAML {shown}")):
        load_job(SMOKE, [override])


def test_an_integer_means_its_digits():
    assert load_job(SMOKE, ["env.vars.PORT=8080"]).env.vars.PORT == "8080"
    assert load_job(SMOKE, ["slurm.time=90"]).slurm.time == "90"


def test_an_escaped_interpolation_is_refused(tmp_path):
    path = _job(tmp_path, 'env:\n  vars:\n    P: "/opt/lib:\\\\${LD_LIBRARY_PATH}"\n')
    with pytest.raises(UserError, match=r"env.vars.P: holds '\$\{' after interpolation"):
        load_job(path)


@pytest.mark.parametrize("name", ["JOB_DIR", "SLURM_JOB_NODELIST", "MASTER_PORT", "RANK"])
def test_the_scripts_own_variables_cannot_be_given(name):
    with pytest.raises(UserError, match=f"env.vars.{name}: is set or read by the job's batch"):
        load_job(SMOKE, [f"env.vars.{name}=x"])


def test_every_variable_the_template_assigns_is_reserved():
    assigned = set(re.findall(r"^\s*(?:export\s+)?([A-Z_][A-Z0-9_]*)=", TEMPLATE.read_text(), re.M))
    assigned |= set(re.findall(r"mapfile -t ([A-Z_]+)", TEMPLATE.read_text()))
    assert assigned - {"NCCL_DEBUG"} <= SCRIPT_NAMES, assigned - SCRIPT_NAMES


def test_deep_nesting_is_one_line_not_a_crash(tmp_path):
    deep = "[" * 30_000 + "]" * 30_000
    with pytest.raises(UserError, match="nested more than 64 levels deep"):
        load_job(_job(tmp_path, f"env:\n  modules: {deep}\n"))
    with pytest.raises(UserError, match="not a valid value: nested more than"):
        load_job(SMOKE, [f"env.modules={deep}"])


def test_counts_that_cannot_run_as_planned_are_refused():
    with pytest.raises(UserError, match=r"tasks_per_node: 8 ranks a node share 1 GPUs"):
        load_job(SMOKE, ["tasks_per_node=8", "gpus_per_node=1"])
    with pytest.raises(UserError, match=f"more than {MAX_RANKS:,} ranks"):
        load_job(SMOKE, ["nodes=999983", "tasks_per_node=999979"])
    with pytest.raises(UserError, match="rendezvous_timeout: must be a number of seconds from 1"):
        load_job(SMOKE, ["rendezvous_timeout=1e-7"])
    for n in (1, 2, 12, 97, 360, 1 << 20, 999983):
        assert divisors(n) == [d for d in range(1, n + 1) if n % d == 0]


def test_paths_the_nodes_read(tmp_path):
    script = render_script(load_job(SMOKE, ["backend=slurm", "env.python=~/venv/bin/python"]))
    assert 'PY="$HOME"/venv/bin/python' in script
    with pytest.raises(UserError, match="output_dir: holds ',' or ':', which pyxis reads"):
        load_job(SMOKE, ["env.container_image=img", "output_dir=/scratch/a,b"])


@pytest.mark.parametrize(
    "flags, said",
    [
        ("--seq -1024 --ranks 8", "argument --seq: must be from 1"),
        ("--seq 8192 --ranks -8", "argument --ranks: must be from 1"),
        ("--seq 8192 --ranks 8 --ulysses 0", "argument --ulysses: must be from 1"),
        ("--seq 8192 --ranks 8 --heads 0", "argument --heads: must be from 1"),
        ("--seq 8192 --ranks 8 --link-gbit nan", "argument --link-gbit: must be a finite"),
        ("--seq 8192 --ranks 8 --link-latency-us -1", "--link-latency-us: must be a finite"),
        ("--seq 8192 --ranks 8 --nodes 100", "--nodes 100 is more than --ranks 8"),
        ("--model llama3-8b --ranks 8 --corpus lognormal:1000000000:1:2", "at most 100,000"),
    ],
)
def test_plan_refuses_numbers_it_cannot_price(flags, said, capsys):
    try:
        code = main(["plan", *flags.split()])
    except SystemExit as exit_:  # argparse's refusals
        code = exit_.code
    assert code == 2
    assert said in capsys.readouterr().err


def test_the_probe_s_minutes_and_srun_s_cpus_are_refused_where_the_script_cannot_take_them():
    """(re-reading) env.vars.RINGCTL_PROBE_MINUTES reaches srun's --time: 0 is no bound,
    "5m" no time srun takes (the job then failed naming every node). SRUN_CPUS_PER_TASK is
    what the script exports from slurm.cpus_per_task: the refusal names that key."""
    from ringctl.config import load_job
    from ringctl.errors import UserError

    assert load_job(SMOKE, ["env.vars.RINGCTL_PROBE_MINUTES=12"]).env.vars.RINGCTL_PROBE_MINUTES
    for bad in ("0", "5m", "-1", "1441", "'٣'"):
        with pytest.raises(UserError, match="RINGCTL_PROBE_MINUTES: must be a whole number"):
            load_job(SMOKE, [f"env.vars.RINGCTL_PROBE_MINUTES={bad}"])
    with pytest.raises(UserError, match="SRUN_CPUS_PER_TASK: is what the batch script exports"):
        load_job(SMOKE, ["env.vars.SRUN_CPUS_PER_TASK=4"])


def test_the_engine_s_switches_are_checked_before_anything_is_written(
    tmp_path, capsys, monkeypatch
):
    """(newcomer review) env.vars.RINGATTN_KERNEL=flsh passed submit (only 'flash' was looked
    at, for its package): every rank of the job then failed with a traceback, after the queue
    wait on Slurm. The engine's switches are read by one rule (ringattn.switches), at load
    for env.vars and at submit for the shell's value the ranks inherit; nothing is written."""
    from ringattn import kernels, switches

    assert tuple(sorted(kernels._FORCED)) == switches.CHOICES[switches.KERNEL]
    for name, bad in (("RINGATTN_KERNEL", "flsh"), ("RINGATTN_TRANSPORT", "tcp")):
        with pytest.raises(UserError, match=rf"env.vars.{name}: must be one of .*'{bad}'"):
            load_job(SMOKE, [f"env.vars.{name}={bad}"])
    assert load_job(SMOKE, ["env.vars.RINGATTN_KERNEL=Chunked"])  # as the engine reads it
    monkeypatch.setenv("RINGATTN_KERNEL", "flsh")
    assert main(["run", str(SMOKE), f"output_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert "this shell's environment: RINGATTN_KERNEL='flsh': expected one of" in err, err
    assert err.count("\n") == 1 and not list(tmp_path.iterdir())
    # (second reading) the shell's transport too, and with env.python naming the ranks'
    # interpreter (its packages are not looked at here; the environment still passes on)
    monkeypatch.setenv("RINGATTN_KERNEL", "torch")
    monkeypatch.setenv("RINGATTN_TRANSPORT", "shmm")
    for more in ([], [f"env.python={sys.executable}"]):
        assert main(["run", str(SMOKE), f"output_dir={tmp_path}", *more]) == 2
        assert "RINGATTN_TRANSPORT='shmm': expected one of" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_a_forced_kernel_for_another_device_is_refused_where_the_config_decides_it(
    tmp_path, capsys, monkeypatch
):
    """(hybrid review) env.vars.RINGATTN_KERNEL=torch-cuda on a job of CPU ranks passed
    submit, then every rank failed with a 19-frame traceback from the efficient-attention
    op. Refused at load where the config decides the ranks' device (a cluster job's
    gpus_per_node, ring.dist_backend=gloo); a local job's ranks take the machine's, and the
    engine refuses there in one line (tests/test_kernels.py)."""
    cuda = "env.vars.RINGATTN_KERNEL=torch-cuda"
    with pytest.raises(UserError, match=r"RINGATTN_KERNEL=torch-cuda runs on cuda only, and the"):
        load_job(SMOKE, [cuda, "backend=slurm", "gpus_per_node=0"])
    with pytest.raises(UserError, match=r"RINGATTN_KERNEL=torch-cpu runs on cpu only, and the"):
        load_job(SMOKE, ["env.vars.RINGATTN_KERNEL=torch-cpu", "backend=slurm", "gpus_per_node=4"])
    with pytest.raises(UserError, match="runs on cuda only"):
        load_job(SMOKE, [cuda, "ring.dist_backend=gloo"])
    assert load_job(SMOKE, [cuda])  # local: the machine decides
    assert load_job(SMOKE, [cuda, "backend=slurm", "gpus_per_node=4"])
    monkeypatch.setenv("RINGATTN_KERNEL", "flash")  # the shell's, which the ranks inherit
    assert main(["run", str(SMOKE), f"output_dir={tmp_path}", "ring.dist_backend=gloo"]) == 2
    assert "this shell's environment: RINGATTN_KERNEL=flash runs on cuda only" in (
        capsys.readouterr().err
    )
    assert not list(tmp_path.iterdir())


def test_a_refusal_names_what_the_user_typed(tmp_path):
    """(newcomer review) `nodes=3` made the bundled file's task.seq_len unsplittable and the
    error named the bundled file (a site-packages path after a wheel install), not the
    override; `task=5` said OmegaConf's "Merge error: int is not a subclass of Params";
    `ring..size=2` said "unknown key ring (did you mean ring?)"."""
    said = {}
    for item in ("nodes=3", "task=5", "ring..size=2"):
        with pytest.raises(UserError) as err:
            load_job(SMOKE, [item])
        said[item] = str(err.value)
    assert said["nodes=3"].startswith("override 'nodes=3': task.seq_len: 256 cannot be split")
    assert said["task=5"] == (
        "override 'task=5': a single value where a section of keys goes: give its keys (under "
        "it in a file, SECTION.KEY=VALUE on the command line)"
    )
    assert said["ring..size=2"] == (
        "override 'ring..size=2': ring..size is not a key (a name is empty between its dots)"
    )
    with pytest.raises(UserError, match=r"override 'task.seq_len=100': task.seq_len: 100"):
        load_job(SMOKE, ["task.seq_len=100"])
    # a file's own values it cannot split are the file's; a layout typed after them is named
    # (second reading: task.layout, which the task reads first, was not among the keys)
    own = tmp_path / "own.yaml"
    own.write_text(SMOKE.read_text().replace("seq_len: 256", "seq_len: 260"))
    assert "seq_len: 260" in own.read_text()
    with pytest.raises(UserError, match=rf"^{re.escape(str(own))}: task.seq_len: 260"):
        load_job(own, [])
    assert SMOKE.read_text().count("layout: zigzag") == 1
    own.write_text(own.read_text().replace("layout: zigzag", "layout: contiguous"))
    assert load_job(own, [])  # 260 over 4 contiguous ranks
    with pytest.raises(UserError, match=r"^override 'task.layout=zigzag': task.seq_len: 260"):
        load_job(own, ["task.layout=zigzag"])
    # the other checks that read keys beside theirs (second reading)
    for items, said in (
        (["task.heads=3", "ring.ulysses=1"], "override 'task.heads=3': task.kv_heads"),
        (["nodes=3", "ring.ulysses=2"], "override 'ring.ulysses=2': ring.ulysses: 2 does not"),
        (["ring.ulysses=2", "nodes=3"], "override 'nodes=3': ring.ulysses: 2 does not"),
    ):
        with pytest.raises(UserError, match=re.escape(said)):
            load_job(SMOKE, items)
