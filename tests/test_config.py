"""Job configs: loading, overrides, and the errors a user sees (through the CLI too)."""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from omegaconf.errors import ReadonlyConfigError

from ringctl import tasks
from ringctl.cli import main
from ringctl.config import BackendName, Layout, load_job, to_yaml, world_size
from ringctl.errors import UserError

REPO = Path(__file__).resolve().parents[1]
SMOKE = REPO / "jobs" / "smoke.yaml"
ATTENTION = REPO / "jobs" / "attention.yaml"


def write(tmp_path: Path, text: str, name: str = "job.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_shipped_jobs_load():
    smoke = load_job(SMOKE)
    assert smoke.name == "smoke" and smoke.output_dir == "runs"
    assert world_size(smoke) == 4
    assert smoke.task.name == "attention" and smoke.ring.layout == Layout.zigzag
    attention = load_job(ATTENTION)
    assert attention.backend == BackendName.slurm and attention.task.dtype == "bfloat16"


def test_overrides_merge_over_the_file():
    cfg = load_job(SMOKE, ["nodes=2", "slurm.partition=gpu", "env.modules=[cuda/12,nccl]"])
    assert cfg.nodes == 2 and cfg.slurm.partition == "gpu"
    assert list(cfg.env.modules) == ["cuda/12", "nccl"]
    assert cfg.tasks_per_node == 1  # untouched keys keep the file's values
    with pytest.raises(ReadonlyConfigError):
        cfg.nodes = 3


def test_resolved_yaml_round_trips(tmp_path):
    cfg = load_job(SMOKE, ["name=again", "ring.layout=contiguous"])
    again = load_job(write(tmp_path, to_yaml(cfg)))
    assert to_yaml(again) == to_yaml(cfg)


def test_unknown_key_names_full_path_and_file(tmp_path):
    path = write(tmp_path, "name: a\nslurm:\n  partiton: gpu\n")
    with pytest.raises(UserError) as err:
        load_job(path)
    msg = str(err.value)
    assert str(path) in msg and "slurm.partiton" in msg and "slurm.partition" in msg


def test_unknown_key_in_an_override():
    with pytest.raises(UserError, match=r"override 'task\.seqlen=8'.*task\.seqlen"):
        load_job(SMOKE, ["task.seqlen=8"])


def test_wrong_type(tmp_path):
    path = write(tmp_path, "name: a\nnodes: four\n")
    with pytest.raises(UserError, match=r"job\.yaml: nodes: .*'four'"):
        load_job(path)
    with pytest.raises(UserError, match=r"slurm\.exclusive"):
        load_job(SMOKE, ["slurm.exclusive=maybe"])
    with pytest.raises(UserError, match=r"backend: .*expected one of \[local, slurm, ssh\]"):
        load_job(SMOKE, ["backend=kubernetes"])


def test_missing_mandatory(tmp_path):
    path = write(tmp_path, "nodes: 1\n")
    with pytest.raises(UserError, match=r"job\.yaml: missing mandatory value: name"):
        load_job(path)


def test_a_value_marked_to_be_given_is_not_replaced_by_the_default(tmp_path):
    """`???` in a job file or an override (a shared file's "fill these in") kept the schema's
    default under OmegaConf's merge: `inputs: ???` scored the bundled samples, `model_path:
    ???` with the random tiny model, `nodes=???` ran on 4 nodes, exit 0."""
    text = "name: a\ntask:\n  name: longdoc\n  inputs: ???\n  model_path: ???\n  chunk_size: ???\n"
    path = write(tmp_path, text)
    (tmp_path / "a.txt").write_text("a document")
    with pytest.raises(
        UserError, match=r"job\.yaml: missing mandatory values: task\.chunk_size, task\.inputs, "
    ):
        load_job(path)
    with pytest.raises(UserError, match=r"missing mandatory value: task\.model_path"):
        load_job(path, [f"task.inputs={tmp_path}", "task.chunk_size=64"])
    with pytest.raises(UserError, match=r"override 'nodes=\?\?\?': missing mandatory value: nodes"):
        load_job(SMOKE, ["nodes=???"])
    cfg = load_job(path, [f"task.inputs={tmp_path}", "task.chunk_size=64", "task.model_path=null"])
    assert (cfg.task.chunk_size, cfg.task.model_path) == (64, None)  # given later: taken
    assert load_job(SMOKE, ["nodes=???", "nodes=2"]).nodes == 2
    with pytest.raises(UserError, match=r"task\.inputs \(marked in .*job\.yaml\)"):
        load_job(path, ["task={}", "nodes=???", "task.chunk_size=1", "task.model_path=null"])
    with pytest.raises(UserError, match=r"job\.yaml: missing mandatory value: task\.inputs"):
        load_job(path, ["task={}", "task.chunk_size=1", "task.model_path=null"])  # {}: nothing
    # a mapping marked ??? is given by a mapping, or by a key under it
    mapping = write(tmp_path, "name: a\ntask:\n  name: longdoc\n  model_overrides: ???\n")
    assert load_job(mapping, ["task.model_overrides={}"]).task.model_overrides == {}
    given = load_job(mapping, ["task.model_overrides={num_hidden_layers: 1}"])
    assert given.task.model_overrides == {"num_hidden_layers": 1}
    assert load_job(mapping, ["task.model_overrides.num_hidden_layers=1"]).task.model_overrides
    with pytest.raises(UserError, match=r"missing mandatory value: task\.model_overrides"):
        load_job(mapping)


def test_impossible_values_are_refused_before_anything_runs(tmp_path):
    with pytest.raises(UserError, match=r"task\.seq_len: 250 cannot be split over 4 ranks"):
        load_job(SMOKE, ["task.seq_len=250"])
    with pytest.raises(UserError, match=r"ssh\.host: is required with backend=ssh"):
        load_job(SMOKE, ["backend=ssh"])
    with pytest.raises(UserError, match=r"nodes: must be at least 1"):
        load_job(SMOKE, ["nodes=0"])
    with pytest.raises(UserError, match=r"task\.kv_heads"):
        load_job(SMOKE, ["task.kv_heads=3"])
    with pytest.raises(UserError, match=r"unknown task 'nope'"):
        load_job(SMOKE, ["task.name=nope"])
    with pytest.raises(UserError, match=r"env\.vars\.A-B"):
        load_job(write(tmp_path, "name: a\nenv:\n  vars:\n    A-B: '1'\n"))
    with pytest.raises(UserError, match=r"name: must be a single line"):
        load_job(write(tmp_path, 'name: "a\\nrm -rf ~"\n', "nl.yaml"))


def test_bad_files_and_override_syntax(tmp_path):
    with pytest.raises(UserError, match="not found"):
        load_job(tmp_path / "absent.yaml")
    with pytest.raises(UserError, match="not valid YAML"):
        load_job(write(tmp_path, "name: [unclosed\n"))
    with pytest.raises(UserError, match="must be a YAML mapping"):
        load_job(write(tmp_path, "- a\n- b\n", "list.yaml"))
    with pytest.raises(UserError, match="not of the form key=value"):
        load_job(SMOKE, ["nodes"])
    with pytest.raises(UserError, match=r"override 'env.modules=\[`id`\]': not a valid value"):
        load_job(SMOKE, ["env.modules=[`id`]"])


def test_a_task_brings_its_own_schema(monkeypatch, tmp_path):
    """How the long-document task plugs in: its params, an extra top-level section, a check."""

    @dataclass
    class ModelConfig:
        path: str | None = None
        dtype: str = "float32"

    @dataclass
    class Params(tasks.TaskParams):
        name: str = "demo"
        mode: str = "score"
        inputs: list[str] = field(default_factory=list)

    class DemoTask(tasks.Task):
        name, params, sections = "demo", Params, {"model": ModelConfig}

        def check(self, cfg, bad):
            if cfg.task.mode not in ("score", "embed", "grad"):
                raise bad("task.mode", "expected score, embed or grad")

        def run(self, cfg, ctx):
            return None

    module = types.ModuleType("ringctl_test_demo_task")
    module.DemoTask = DemoTask
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setitem(tasks.TASKS, "demo", f"{module.__name__}:DemoTask")

    # Switching the task over a file of another task's parameters is refused, naming them
    # (tests/test_config_review_s51.py); over a file with none, the new task's keys apply.
    with pytest.raises(UserError, match=r"task\.name=demo over the attention task of .*smoke"):
        load_job(SMOKE, ["task.name=demo"])
    plain = write(tmp_path, "name: plain\n")
    cfg = load_job(plain, ["task.name=demo", "model.path=/models/x", "task.mode=embed"])
    assert cfg.task.mode == "embed" and cfg.model.path == "/models/x"
    assert "seq_len" not in cfg.task
    with pytest.raises(UserError, match=r"unknown key task\.seq_len"):
        load_job(plain, ["task.name=demo", "task.seq_len=8"])
    with pytest.raises(UserError, match=r"task\.mode: expected"):
        load_job(plain, ["task={name: demo, mode: train}"])


# --- the same errors through the command line: one line on stderr, exit status 2 --------------


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_config_prints_resolved_yaml(capsys):
    code, out, _ = run_cli(capsys, "config", str(SMOKE), "nodes=2", "slurm.partition=gpu")
    assert code == 0
    assert "nodes: 2\n" in out and "partition: gpu" in out and "name: smoke" in out


@pytest.mark.parametrize(
    "text, overrides, expected",
    [
        ("name: a\nslurm:\n  partiton: gpu\n", [], "unknown key slurm.partiton"),
        ("name: a\nnodes: four\n", [], "nodes: Value 'four'"),
        ("nodes: 2\n", [], "missing mandatory value: name"),
        ("name: a\n", ["ring.layout=spiral"], "ring.layout: Invalid value 'spiral'"),
    ],
)
def test_cli_errors_are_one_line(tmp_path, capsys, text, overrides, expected):
    path = write(tmp_path, text)
    for verb in ("config", "render", "submit"):
        code, out, err = run_cli(capsys, verb, str(path), *overrides)
        assert code == 2, (verb, err)
        assert out == ""
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"ringctl {verb}: error: "), err
        assert expected in lines[0]
        if not overrides:
            assert str(path) in lines[0]
    assert not (tmp_path / "runs").exists()  # nothing was created, nothing submitted


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        ("90", 5400),
        ("1:30", 90),
        ("1:30:00", 5400),
        ("2-00", 172800),
        ("1-2:3", 93780),
        ("1-0:0:5", 86405),
        ("soon", None),
    ],
)
def test_slurm_time_formats(value, seconds):
    from ringctl.config import slurm_time_seconds

    assert slurm_time_seconds(value) == seconds


def test_signal_lead_longer_than_the_time_limit_is_refused(tmp_path):
    from ringctl.config import load_job
    from ringctl.errors import UserError

    with pytest.raises(UserError, match=r"slurm.signal: USR1@60 would fire 60s before a 00:01:00"):
        load_job("jobs/smoke.yaml", ["slurm.time=00:01:00"])
    load_job("jobs/smoke.yaml", ["slurm.time=00:01:00", "slurm.signal=null"])


# --- values refused at load, naming the key and where it came from -----------------------------


@pytest.mark.parametrize(
    ("override", "key", "why"),
    [
        ("timeout=.nan", "timeout", "number of seconds from 1"),
        ("rendezvous_timeout=.inf", "rendezvous_timeout", "number of seconds from 1"),
        ("ssh.port=99999", "ssh.port", "1 to 65535"),
        ("ssh.port=-1", "ssh.port", "1 to 65535"),
        ("ssh.connect_timeout=-1", "ssh.connect_timeout", "number of seconds from 1"),
        ("ssh.command_timeout=0", "ssh.command_timeout", "number of seconds from 1"),
        ("slurm.cpus_per_task=-3", "slurm.cpus_per_task", "at least 1"),
        ("slurm.signal=KILL", "slurm.signal", "cannot be caught"),
        ("slurm.signal=USR1@0", "slurm.signal", "1 to 65535 seconds"),
        ("slurm.signal=USR1@70000", "slurm.signal", "1 to 65535 seconds"),
        ("slurm.signal=FOO@60", "slurm.signal", "not a signal name Slurm knows"),
        ("slurm.time=12345678901234567890", "slurm.time", "not a Slurm time"),
        ("slurm.time=400-00:00:00", "slurm.time", "more than 365 days"),
        ("slurm.mem=lots", "slurm.mem", "not a memory size"),
        ("output_dir=a\\b", "output_dir", "backslash"),
        ("slurm.extra_sbatch=[--export=ALL]", "slurm.extra_sbatch[0]", "--export cannot be given"),
        ('slurm.extra_sbatch=["--comment=\\"a b"]', "slurm.extra_sbatch[0]", "unbalanced quote"),
        ("env.vars=[1]", "env.vars", "expected a mapping"),
        ("name=${missing.key}", "name", "Interpolation key 'missing.key' not found"),
    ],
)
def test_bad_values_are_refused_naming_the_override(capsys, override, key, why):
    """One line on stderr, exit 2, the override (not the job file) and the key named."""
    code, out, err = run_cli(capsys, "render", str(SMOKE), override)
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"ringctl render: error: override {override!r}: {key}: "), err
    assert why in lines[0]


def test_a_bad_value_in_the_file_names_the_file(tmp_path):
    path = write(tmp_path, "name: a\ntimeout: .nan\nslurm:\n  partition: ${nowhere}\n")
    with pytest.raises(UserError, match=rf"^{path}: slurm\.partition: Interpolation key"):
        load_job(path)
    with pytest.raises(UserError, match=rf"^{path}: timeout: must be a number of seconds from 1"):
        load_job(path, ["slurm.partition=debug"])
    load_job(path, ["slurm.partition=debug", "timeout=30"])  # the override mends it


def test_a_trailing_newline_is_not_one_line(tmp_path):
    """`$` matches before a final newline: the checks match the whole value."""
    with pytest.raises(UserError, match=r"job\.yaml: name: must be a single line"):
        load_job(write(tmp_path, 'name: "abc\\n"\n'))
    with pytest.raises(UserError) as err:
        load_job(write(tmp_path, 'name: a\nenv:\n  vars:\n    "X\\n": "1"\n', "vars.yaml"))
    assert str(err.value).endswith("env.vars.'X\\n': is not a valid environment variable name")
    assert "\n" not in str(err.value)


def test_percent_in_the_output_directory_is_accepted():
    """`%` reaches Slurm's --output pattern doubled (ringctl.sbatch.output_pattern, run on the
    cluster in test_sbatch_injection), so it is not refused."""
    cfg = load_job(SMOKE, ["output_dir=runs%j", "job_dir=/scratch/x%xy"])
    assert cfg.output_dir == "runs%j" and cfg.job_dir == "/scratch/x%xy"
