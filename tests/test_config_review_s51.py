"""Review s51 (W27) of job configs: values every rank would refuse, or that mean something
other than what was written, are refused at load, naming the file or override and the key.

1. task.softmax_scale by the engine's own rule (``ringattn.checks.check_scale``).
2. slurm.time / signal / switches / --time-min: ASCII digits, nothing stripped.
3. Integer fields bounded (a seed torch takes, sizes torch can shape, 64-bit everywhere).
4. A numeric task.inputs (a folder named 2024) is that path at submit too.
6. Explicit YAML tags (YAML 1.1's constructors) refused with their line.
7. task.name switched over a file's task section: kept when the new task has its keys,
   else refused naming them (they were dropped without a word).
8. ring.plan (deprecated) and ring.placement both given and different: refused.
10. env.modules entries that `module load` would read as options.
11. env.python / venv / conda as ~user (the batch script and the local backend differed).
12. Booleans take true/false, numbers ASCII digits; +5 and -0 stay text in text fields.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ringctl import job_yaml, sbatch, tasks
from ringctl.config import load_job
from ringctl.errors import UserError

REPO = Path(__file__).resolve().parents[1]
SMOKE = REPO / "jobs" / "smoke.yaml"


def refused(job, overrides, pattern: str) -> str:
    with pytest.raises(UserError, match=pattern) as info:
        load_job(job, overrides)
    message = str(info.value)
    assert "\n" not in message
    return message


# --- 1 -------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [".nan", ".inf", "-.inf", "0", "-1"])
def test_softmax_scale_is_checked_at_load_by_the_engines_rule(value):
    refused(
        SMOKE,
        [f"task.softmax_scale={value}"],
        rf"^override 'task.softmax_scale={value}': task\.softmax_scale: ring_attention: "
        r"softmax_scale must be a finite number > 0 or None",
    )


def test_a_softmax_scale_the_engine_takes_loads():
    assert load_job(SMOKE, ["task.softmax_scale=0.125"]).task.softmax_scale == 0.125


# --- 2 -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("slurm.time=٣٠", "slurm.time"),
        ("slurm.time=' 90'", "slurm.time"),
        ('slurm.time="90\\u2003"', "slurm.time"),
        ("slurm.signal=USR1@١٢٠", "slurm.signal"),
        ("slurm.switches=1@٣٠", "slurm.switches"),
        ("slurm.extra_sbatch=['--time-min= 20']", r"slurm.extra_sbatch\[0\]"),
        ("slurm.extra_sbatch=['--time-min=٢٠']", r"slurm.extra_sbatch\[0\]"),
        ("slurm.extra_sbatch=['--licenses=fs:٣']", r"slurm.extra_sbatch\[0\]"),
        ("slurm.extra_sbatch=['--mail-type=ſTAGE_OUT']", r"slurm.extra_sbatch\[0\]"),
    ],
)
def test_header_values_take_ascii_only_and_nothing_is_stripped(override, key):
    refused(SMOKE, [override], rf"^override .*: {key}: ")


def test_slurm_time_reads_ascii_digits_as_written():
    assert sbatch.slurm_time_seconds("1:30:00") == 5400
    for text in ("٣٠", " 90", "90\u2003", "1:٣٠"):
        assert sbatch.slurm_time_seconds(text) is None, text
    assert sbatch.signal_lead("USR1@١٢٠") is None


# --- 3 -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("override", "key", "why"),
    [
        ("task.seed=18446744073709551616", "task.seed", "out of range"),
        ("task.seed=9223372036854775808", "task.seed", "out of range"),
        ("task.seed=-1", "task.seed", "must be from 0 to"),
        ("task.batch=9223372036854775808", "task.batch", "out of range"),
        ("task.head_dim=2147483648", "task.head_dim", "must be from 1 to 2,147,483,647"),
        ("task.heads=2147483648", "task.heads", "must be from 1 to 2,147,483,647"),
        ("task.fault_step=100000000000000000000", "task.fault_step", "out of range"),
    ],
)
def test_attention_integers_are_bounded(override, key, why):
    refused(SMOKE, [override], rf"^override '{override}': {key}: .*{why}")


def test_attention_inputs_must_have_a_size_torch_can_make():
    """Each size under 2**31, but 2**60 float64 elements: 2**63 bytes."""
    sizes = ["task.seq_len=1073741824", "task.batch=1048576", "task.heads=1024"]
    refused(SMOKE, [*sizes, "task.kv_heads=1", "task.head_dim=1024"], r"task\.seq_len: .* elements")
    top = (1 << 63) - 1
    assert load_job(SMOKE, [f"task.seed={top}"]).task.seed == top


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("task.seq_len=100000000000000000000000", "task.seq_len"),
        ("task.seq_len=2147483648", "task.seq_len"),
        ("task.batch_sequences=100000000000000000000000", "task.batch_sequences"),
        ("task.batch_sequences=2147483648", "task.batch_sequences"),
        ("task.seed=9223372036854775808", "task.seed"),
        ("task.chunk_size=2147483648", "task.chunk_size"),
    ],
)
def test_training_integers_are_bounded(override, key):
    refused("train", [override], rf"^override '{override}': {key}: ")


# --- 4 -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("job", "inputs", "extra"),
    [
        ("longdoc", "2024", ["task.model_path=bundled:demo-byte-llama"]),
        ("train", "[2024]", []),
    ],
)
def test_a_numeric_input_is_the_folder_of_that_name_at_submit(
    tmp_path, monkeypatch, job, inputs, extra
):
    (tmp_path / "2024").mkdir()
    (tmp_path / "2024" / "a.txt").write_text("hello world\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = load_job(job, [f"task.inputs={inputs}", *extra])
    prepared = tasks.get_task(cfg.task.name).prepare(cfg)  # a TypeError before
    assert prepared["task"]["inputs"] == [str(tmp_path / "2024")]


# --- 6 -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    [
        "!!int 1:30:00",
        "!!int 0123",
        "!!float 1:30",
        "!!bool yes",
        "!!timestamp 2026-01-01",
        "!!binary aGk=",
        "!!set {a}",
        "!!omap [a: 1]",
        "!foo x",
    ],
)
def test_explicit_tags_are_refused_with_their_line(tmp_path, value):
    path = tmp_path / "tags.yaml"
    path.write_text(f"name: smoke\nslurm:\n  account: {value}\n")
    message = refused(path, [], rf"^{path}: not valid YAML: line 3, column 12: the tag ")
    assert "YAML 1.2" in message
    refused(SMOKE, [f"slurm.account={value}"], r"^override .*: not a valid value: line 1, column 1")


def test_tags_that_read_a_value_as_it_is_are_kept():
    assert load_job(SMOKE, ["slurm.account=!!str 0123"]).slurm.account == "0123"
    assert job_yaml.load_text("!!seq [a]\n", "x") == ["a"]


# --- 7 -------------------------------------------------------------------------------------


def _longdoc_file(tmp_path: Path, extra: str = "") -> Path:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text("a document\n")
    path = tmp_path / "mylong.yaml"
    path.write_text(
        "name: mine\ntask:\n  name: longdoc\n"
        f"  inputs: {tmp_path}/docs\n  model_path: bundled:demo-byte-llama\n"
        f"  dtype: bfloat16\n{extra}"
    )
    return path


def test_switching_the_task_keeps_the_keys_the_new_task_has(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = load_job(_longdoc_file(tmp_path), ["task.name=train"])
    assert cfg.task.name == "train"
    assert cfg.task.inputs == f"{tmp_path}/docs"
    assert cfg.task.model_path == "bundled:demo-byte-llama" and cfg.task.dtype == "bfloat16"


def test_switching_the_task_over_keys_it_has_not_is_refused_naming_them(tmp_path):
    path = _longdoc_file(tmp_path, "  mode: embed\n  write_grads: false\n")
    refused(
        path,
        ["task.name=train"],
        rf"^override 'task.name=train': task.name=train over the longdoc task of {path}, "
        r"whose task\.mode, task\.write_grads are not train's",
    )


# --- 8 -------------------------------------------------------------------------------------


def test_a_deprecated_plan_beside_a_different_placement_is_refused(tmp_path):
    path = tmp_path / "both.yaml"
    path.write_text("name: smoke\nring:\n  plan: skip\n  placement: required\n")
    refused(path, [], rf"^{path}: ring\.plan \(deprecated\) is 'skip' and ring\.placement is")
    path.write_text("name: smoke\nring:\n  plan: skip\n  placement: skip\n")
    assert load_job(path).ring.placement == "skip"
    # (second reading) an interpolation there was a traceback, then read as the plan's value
    path.write_text("name: smoke\nring:\n  plan: skip\n  placement: ${nowhere.x}\n")
    refused(path, [], r"ring\.plan \(deprecated\) is 'skip' and ring\.placement is '\$\{nowhere")


# --- 9, 10, 11 -----------------------------------------------------------------------------


@pytest.mark.parametrize("module", ["-f", "--ignore_cache"])
def test_a_module_name_cannot_be_an_option(module):
    refused(SMOKE, [f"env.modules=[gcc/12, '{module}']"], r"env\.modules\[1\]: .* begins with '-'")


def test_a_missing_list_entry_names_an_override_that_works():
    message = refused(SMOKE, ["env.modules=['???']"], r"missing mandatory value: env\.modules")
    assert "e.g. env.modules=..." in message


@pytest.mark.parametrize("key", ["python", "venv", "conda"])
def test_a_home_of_another_user_is_refused(key):
    refused(
        SMOKE, [f"env.{key}=~root/venv"], rf"env\.{key}: '~root/venv': ~user is kept as written"
    )
    assert load_job(SMOKE, [f"env.{key}=~/venv"]).env[key] == "~/venv"


# --- 12 ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("override", "key", "why"),
    [
        ("slurm.requeue=0123", "slurm.requeue", "expected true or false, got the text '0123'"),
        ("task.causal=-1", "task.causal", "expected true or false, got -1"),
        ("task.causal=1", "task.causal", "expected true or false, got 1"),
        ("task.causal='٣'", "task.causal", "expected true or false"),
        ("task.causal=yes", "task.causal", "expected true or false"),
        ("nodes='٤'", "nodes", "expected an integer, got the text '٤'"),
        ("nodes=' 4'", "nodes", "expected an integer"),
        ("task.seed='1_0'", "task.seed", "expected an integer"),
        ("timeout='1_0'", "timeout", "expected a number, got the text '1_0'"),
        ("timeout=nan", "timeout", "expected a number"),
    ],
)
def test_booleans_and_numbers_take_their_own_type_or_its_yaml_text(override, key, why):
    refused(SMOKE, [override], rf"^override .*: {key}: {why}")


def test_booleans_and_numbers_as_text_in_their_yaml_form_load(monkeypatch):
    monkeypatch.setenv("RINGCTL_TEST_NODES", "2")
    monkeypatch.setenv("RINGCTL_TEST_ARABIC", "٢")
    cfg = load_job(
        SMOKE, ["task.causal='false'", "nodes=${oc.env:RINGCTL_TEST_NODES}", "timeout=+9"]
    )
    assert cfg.task.causal is False and cfg.nodes == 2 and cfg.timeout == 9.0
    refused(SMOKE, ["nodes=${oc.env:RINGCTL_TEST_ARABIC}"], r"nodes: expected an integer")


def test_signed_integers_stay_text_as_written():
    assert job_yaml.load_text("+5", "x") == "+5" and job_yaml.load_text("-0", "x") == "-0"
    assert job_yaml.load_text("-5", "x") == -5
    cfg = load_job(SMOKE, ["env.vars={X: +5, Y: -0}"])
    assert dict(cfg.env.vars) == {"X": "+5", "Y": "-0"}
    refused(SMOKE, ["slurm.mem=-0"], r"slurm\.mem: '-0' is not a memory size")
