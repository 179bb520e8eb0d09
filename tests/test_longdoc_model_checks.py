"""What submit checks of a model before any rank builds it (issue 26): its config's sizes, its
state against this host, a tokenizer's own code named in its config.json, loader options
hidden inside a nested override, and the device table's numbers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ringctl.config import load_job
from ringctl.errors import UserError
from ringctl.sizing import Sizing
from ringctl.tasks.longdoc import CorpusTask

ROOT = Path(__file__).resolve().parents[1]
TINY = json.loads((ROOT / "ringctl" / "longdoc" / "data" / "tiny-llama.json").read_text())


def _load(tmp_path: Path, *overrides: str):
    doc = tmp_path / "doc.txt"
    doc.write_text("a short document")
    return load_job(ROOT / "jobs" / "longdoc.yaml", [f"task.inputs=[{doc}]", *overrides])


def _model(tmp_path: Path, **fields) -> Path:
    """A random-initialised model's config (vocabulary 256: the byte tokenizer fits it)."""
    path = tmp_path / "model.json"
    path.write_text(json.dumps({**TINY, **fields}))
    return path


@pytest.mark.parametrize(
    "fields, said",
    [
        ({"num_hidden_layers": 1e12}, "num_hidden_layers = 1000000000000.0"),
        ({"num_attention_heads": 0}, "num_attention_heads = 0"),
        ({"num_key_value_heads": -2}, "num_key_value_heads = -2"),
        ({"vocab_size": "256"}, "vocab_size = '256'"),
        ({"hidden_size": float("nan")}, "hidden_size = nan"),
        ({"text_config": {"model_type": "llama", "head_dim": -1}}, "head_dim = -1"),
    ],
)
def test_a_config_size_that_is_no_positive_integer_is_refused_at_submit(tmp_path, fields, said):
    """Before: submitted (without a device nothing read them), and every rank failed on them."""
    with pytest.raises(UserError) as err:
        _load(tmp_path, f"task.model_path={_model(tmp_path, **fields)}")
    assert f"task.model_path: model config field {said} (config.json or task.model_overrides)" in (
        str(err.value)
    )
    assert str(err.value).endswith("a size of the model must be a positive integer")


def test_an_override_size_is_checked_as_the_file_is(tmp_path):
    with pytest.raises(UserError, match=r"hidden_size = -64 \(config.json or task.model_overr"):
        _load(tmp_path, "task.model_path=null", "task.model_overrides={hidden_size: -64}")


def test_a_model_state_no_machine_or_this_host_holds_is_refused_at_submit(tmp_path, capsys):
    """num_hidden_layers: 10**12 (an integer) passes the size check: its state is what no
    machine holds; 10**8 layers is 27 TiB, more than this host (local ranks) has. Before:
    submitted, and the ranks ran out of memory building it. --force submits anyway."""
    from ringctl.submission import check_model_state

    huge = _load(
        tmp_path, "task.model_path=null", "task.model_overrides={num_hidden_layers: 1000000000000}"
    )
    with pytest.raises(UserError, match=r"the model has 3\.7e\+16 parameters \(its config's s"):
        check_model_state(Sizing(huge))
    big = _load(
        tmp_path, "task.model_path=null", "task.model_overrides={num_hidden_layers: 100000000}"
    )
    with pytest.raises(UserError) as err:
        check_model_state(Sizing(big))
    said = str(err.value)
    assert said.startswith("the model's state (3,699,200,032,832 parameters) needs 13,780.6 GiB")
    assert "GiB for the 2 ranks on this host, which has" in said and said.endswith(
        "--force to submit anyway"
    )
    check_model_state(Sizing(big), force=True)
    assert "warning: submitting despite it (--force): the model's state" in capsys.readouterr().err
    check_model_state(Sizing(_load(tmp_path, "task.model_path=null")))  # the tiny one fits


def test_a_nested_override_cannot_carry_a_loader_option(tmp_path):
    """Before: {rope_parameters: {trust_remote_code: true}} passed (only the top level and
    sub-configs were checked)."""
    with pytest.raises(UserError) as err:
        _load(
            tmp_path,
            "task.model_path=null",
            "task.model_overrides={rope_parameters: {rope_type: default, trust_remote_code: true}}",
        )
    assert (
        "task.model_overrides.rope_parameters.trust_remote_code: not a model-config field: "
        "ringctl never runs a model directory's own code" in str(err.value)
    )
    ok = _load(
        tmp_path,
        "task.model_path=null",
        "task.model_overrides={rope_parameters: {rope_type: default}}",
    )
    assert ok.task.model_overrides == {"rope_parameters": {"rope_type": "default"}}


EVIL = """from pathlib import Path
Path({marker!r}).write_text("the tokenizer's own code ran")
from transformers import PreTrainedTokenizerFast
class EvilTokenizer(PreTrainedTokenizerFast):
    pass
"""


def test_a_tokenizer_whose_config_names_its_own_code_is_said_at_submit(tmp_path, capsys):
    """A tokenizer directory's config.json auto_map.AutoTokenizer (read when its
    tokenizer_config.json names no class): before, submit said nothing; now it is treated as a
    model's auto_map is: said, with the built-in class that runs instead; the code never runs."""
    from tokenizers import Tokenizer, models

    tok, marker = tmp_path / "tok", tmp_path / "MARKER"
    tok.mkdir()
    Tokenizer(models.WordLevel({" ": 0, "a": 1}, unk_token=" ")).save(str(tok / "tokenizer.json"))
    (tok / "tokenization_evil.py").write_text(EVIL.format(marker=str(marker)))
    auto = {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]}
    (tok / "config.json").write_text(json.dumps({"model_type": "llama", "auto_map": auto}))
    _load(tmp_path, "task.model_path=null", f"task.tokenizer_path={tok}")
    said = capsys.readouterr().err
    assert (
        f"warning: {tok}/config.json names its own code (tokenization_evil.EvilTokenizer), "
        "which ringctl does not run: transformers' built-in " in said
    ), said
    assert "tokenizes instead" in said and not marker.exists()


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity"])
def test_a_device_number_that_is_not_finite_is_a_bad_field(tmp_path, value):
    """JSON's NaN and Infinity parse as floats: before, mem_gib NaN was taken (every plan
    then fits, or none does)."""
    from ringctl.planner.devices import load_devices

    path = tmp_path / "devices.json"
    path.write_text(f'{{"odd": {{"mem_gib": {value}, "tflops": {{"bfloat16": 100.0}}}}}}')
    with pytest.raises(UserError, match=rf"{path}: device 'odd': bad field mem_gib \("):
        load_devices(path)
    path.write_text(f'{{"odd": {{"mem_gib": 80, "tflops": {{"bfloat16": {value}}}}}}}')
    with pytest.raises(UserError, match=r"device 'odd': bad field tflops \("):
        load_devices(path)


@pytest.mark.parametrize(
    ("field", "absurd", "plausible"),
    [
        ("mem_gib", "1e308", "141"),
        ("tflops", '{"bfloat16": 1e-300}', '{"bfloat16": 0.05}'),
        ("net_latency_s", "1e-300", "0"),
        ("gpus_per_node", str(10**30), "72"),
        ("matmul_tflops_by_width", '{"64": 1e40}', '{"64": 900.0}'),
    ],
)
def test_a_device_number_past_any_device_is_a_bad_field(tmp_path, field, absurd, plausible):
    """Positive but absurd figures were taken: a mem_gib of 1e308 made every plan fit, a
    1e-300 TFLOP/s made every plan take longer than the universe, without a word."""
    from ringctl.planner.devices import load_devices

    path = tmp_path / "devices.json"

    def device(value: str) -> str:
        entry = {"mem_gib": "80", "tflops": '{"bfloat16": 100.0}', field: value}
        return '{"odd": {' + ", ".join(f'"{k}": {v}' for k, v in entry.items()) + "}}"

    path.write_text(device(absurd))
    with pytest.raises(UserError, match=rf"device 'odd': bad field {field} \(.*between"):
        load_devices(path)
    path.write_text(device(plausible))
    assert load_devices(path)["odd"].name == "odd"


@pytest.mark.parametrize("job", ["longdoc", "train"])
def test_a_json_config_transformers_refuses_is_refused_at_submit(tmp_path, job):
    """initializer_range 1e25 (transformers 5 checks it is within [0, 1] as it builds the
    config): before, submitted, and every rank failed with huggingface_hub's traceback
    (StrictDataclassFieldValidationError). Now the submit builds the config as the ranks do:
    one line naming the file and the field, no job directory."""
    from ringctl.submission import submit_job

    model = _model(tmp_path, initializer_range=1e25)
    doc = tmp_path / "doc.txt"
    doc.write_text("a short document")
    job_dir = tmp_path / "job"
    with pytest.raises(UserError) as err:
        submit_job(
            str(ROOT / "jobs" / f"{job}.yaml"),
            [f"task.model_path={model}", f"task.inputs=[{doc}]", f"job_dir={job_dir}"],
        )
    said = str(err.value)
    assert said.startswith(f"task.model_path: {model}: transformers refuses this model config: ")
    assert "'initializer_range'" in said and said.endswith("got 1e+25. Nothing was submitted")
    assert not job_dir.exists()
    # the same file with a value transformers takes is not refused by this check
    assert CorpusTask.check_built_config(_model(tmp_path, initializer_range=0.5), None) is None
