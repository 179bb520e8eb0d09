"""``task.model_overrides`` are model-config fields only, and a directory's own code never runs.

The overrides once reached ``AutoConfig.from_pretrained`` as keyword arguments: with
``{trust_remote_code: true}`` a model directory whose config.json has an ``auto_map`` ran its
``configuration_evil.py`` on every rank, and a key that is no field (YAML's
``{sliding_window:null}``) was dropped in silence. Here a real directory with such code (it
writes a marker file when imported) is submitted and loaded the way the ranks load it, in a
separate process with its own transformers module cache; the marker must never appear.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ringctl.config import load_job
from ringctl.errors import UserError
from tests.longdoc_reference import TINY

ROOT = Path(__file__).resolve().parents[1]
EVIL = """from pathlib import Path
Path({marker!r}).write_text("the directory's own code ran")
from transformers import LlamaConfig, PreTrainedTokenizerFast
class EvilConfig(LlamaConfig):
    pass
class EvilTokenizer(PreTrainedTokenizerFast):
    pass
"""


def _load(*overrides: str):
    return load_job(ROOT / "jobs" / "longdoc.yaml", list(overrides))


@pytest.fixture(scope="module")
def evil(tmp_path_factory) -> tuple[Path, Path]:
    """(a saved tiny Llama whose config.json and tokenizer name their own code, its marker)."""
    import torch
    from tokenizers import Tokenizer, models
    from transformers import AutoConfig, PreTrainedTokenizerFast

    from ringctl.longdoc.model.load import build_random

    root = tmp_path_factory.mktemp("evil")
    d, marker = root / "evil", root / "MARKER"
    config = AutoConfig.for_model("llama", **TINY)
    build_random(config, seed=0, dtype=torch.float32, attn_implementation="eager").save_pretrained(
        d
    )
    vocab = {chr(32 + i): i for i in range(64)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=" "))
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token=" ").save_pretrained(d)
    for name in ("configuration_evil.py", "tokenization_evil.py"):
        (d / name).write_text(EVIL.format(marker=str(marker)))
    _add_auto_map(d / "config.json", {"AutoConfig": "configuration_evil.EvilConfig"})
    _add_auto_map(
        d / "tokenizer_config.json", {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]}
    )
    return d, marker


def _add_auto_map(file: Path, auto_map: dict) -> None:
    data = json.loads(file.read_text())
    file.write_text(json.dumps({**data, "auto_map": auto_map}))


LOAD_AS_THE_RANKS_DO = """
import sys
from ringctl.longdoc.model.load import load_model
from ringctl.longdoc.model.tokenize import load_tokenizer
path = sys.argv[1]
try:
    load_model(path, overrides={"trust_remote_code": True})
    print("loaded with trust_remote_code")
except ValueError as err:
    print("refused:", err)
model = load_model(path)
print("plain:", type(model).__name__, type(model.config).__name__)
print("tokenizer:", type(load_tokenizer(path).tok).__name__)
"""


def test_remote_code_through_overrides_is_refused_and_never_runs(evil, tmp_path) -> None:
    d, marker = evil
    with pytest.raises(UserError) as err:
        _load(f"task.model_path={d}", "task.model_overrides={trust_remote_code: true}")
    said = str(err.value)
    assert "task.model_overrides.trust_remote_code: not a model-config field" in said, said
    assert "\n" not in said
    assert not marker.exists()
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "HF_HUB_OFFLINE": "1",
        "HF_MODULES_CACHE": str(tmp_path / "modules"),
    }
    ran = subprocess.run(
        [sys.executable, "-c", LOAD_AS_THE_RANKS_DO, str(d)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert ran.returncode == 0, ran.stderr[-3000:]
    lines = ran.stdout.splitlines()
    assert lines[0].startswith("refused: task.model_overrides.trust_remote_code"), lines
    assert lines[1] == "plain: LlamaForCausalLM LlamaConfig", lines  # built-in classes
    assert lines[2].startswith("tokenizer: ") and "Evil" not in lines[2], lines
    assert not marker.exists(), marker.read_text()


def test_custom_code_is_said_at_submit(evil, capsys) -> None:
    d, marker = evil
    _load(f"task.model_path={d}")
    said = capsys.readouterr().err
    assert "configuration_evil.EvilConfig), which ringctl does not run: transformers' " in said
    assert "built-in LlamaConfig / LlamaForCausalLM (model type 'llama') scores it" in said
    assert "tokenization_evil.EvilTokenizer), which ringctl does not run: " in said, said
    assert not marker.exists()


def test_a_model_type_transformers_lacks_is_refused_at_submit(tmp_path) -> None:
    d = tmp_path / "own"
    d.mkdir()
    auto = {"AutoConfig": "configuration_own.OwnConfig"}
    (d / "config.json").write_text(json.dumps({"model_type": "own", **TINY, "auto_map": auto}))
    with pytest.raises(
        UserError,
        match=r"task.model_path: .*configuration_own.OwnConfig\), "
        r"which ringctl does not run, and transformers .* no causal LM of model "
        r"type 'own'",
    ):
        _load(f"task.model_path={d}", "task.tokenizer_path=bytes")


@pytest.mark.parametrize("use", [True, False])
def test_an_override_decides_what_the_config_derives_from_it(tmp_path, use) -> None:
    """Qwen2 decides sliding_window and layer_types from use_sliding_window while its config
    is built (as Qwen2.5's config.json has it: a window, use_sliding_window false). Set on
    the built config, the override left them as they were: `true` ran full attention while
    the submit checks and the planner, reading the merged config.json, saw the window; `false`
    kept the window. Fails before: layer_types stayed the file's."""
    from ringctl.longdoc.model.compat import model_shape
    from ringctl.longdoc.model.load import load_config

    qwen = {"model_type": "qwen2", "sliding_window": 8, "max_window_layers": 0, **TINY}
    cfg = tmp_path / "qwen2.json"
    cfg.write_text(json.dumps({**qwen, "use_sliding_window": not use}))
    for path in (cfg, _saved_without_derived_fields(tmp_path, qwen, not use)):
        config, _ = load_config(path, {"use_sliding_window": use})
        want = "sliding_attention" if use else "full_attention"
        assert config.layer_types == [want] * config.num_hidden_layers, path
        assert config.sliding_window == (8 if use else None), path
        shape = model_shape(path, {"use_sliding_window": use})
        assert shape.window == (8 if use else None), path  # what the planner prices


def test_a_switch_the_file_has_decided_already_is_refused_by_name(tmp_path) -> None:
    """A Qwen2 config.json that lists layer_types (transformers 5 saves them): overriding
    use_sliding_window alone would change nothing the model runs (exit 0, the window not
    where the user put it), so it is refused, naming what to override as well; with
    layer_types overridden too, both take effect."""
    from ringctl.longdoc.model.load import load_config
    from ringctl.longdoc.model.overrides import refusal

    layers = TINY["num_hidden_layers"]
    qwen = {"model_type": "qwen2", "sliding_window": 8, "max_window_layers": 0, **TINY}
    saved = {**qwen, "use_sliding_window": False, "layer_types": ["full_attention"] * layers}
    why = refusal(saved, {"use_sliding_window": True})
    assert why.startswith("task.model_overrides.use_sliding_window: this config.json lists "), why
    assert "override layer_types as well" in why
    cfg = tmp_path / "qwen2.json"
    cfg.write_text(json.dumps(saved))
    with pytest.raises(ValueError, match="override layer_types as well"):
        load_config(cfg, {"use_sliding_window": True})
    both = {"use_sliding_window": True, "layer_types": ["sliding_attention"] * layers}
    config, _ = load_config(cfg, both)
    assert config.layer_types == both["layer_types"] and config.sliding_window == 8
    assert refusal(qwen, {"use_sliding_window": True}) is None  # the file decides nothing


def _saved_without_derived_fields(tmp_path: Path, fields: dict, use: bool) -> Path:
    """A model directory whose config.json is the file alone (no layer_types saved)."""
    d = tmp_path / f"qwen2-dir-{use}"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({**fields, "use_sliding_window": use}))
    return d


def _mistral(tmp_path: Path) -> Path:
    cfg = tmp_path / "mistral.json"
    cfg.write_text(json.dumps({"model_type": "mistral", "sliding_window": 64, **TINY}))
    return cfg


def test_a_yaml_key_without_its_space_is_refused_by_name(tmp_path) -> None:
    """{sliding_window:null} is the key 'sliding_window:null': once dropped in silence (the
    window stayed on and the job completed with other numbers), now refused at submit."""
    cfg = _mistral(tmp_path)
    with pytest.raises(UserError) as err:
        _load(f"task.model_path={cfg}", "task.model_overrides={sliding_window:null}")
    said = str(err.value)
    assert (
        "task.model_overrides.sliding_window:null: 'sliding_window:null' is not a field of "
        "MistralConfig; nearest fields: sliding_window" in said
    ), said
    assert "write {a: b}" in said
    ok = _load(f"task.model_path={cfg}", "task.model_overrides={sliding_window: null}")
    assert ok.task.model_overrides == {"sliding_window": None}


@pytest.mark.parametrize(
    "key, phrase",
    [
        ("attn_implementation", "ringctl sets it itself"),
        ("_attn_implementation", "ringctl sets it itself"),
        ("torch_dtype", "set task.dtype"),
        ("dtype", "set task.dtype"),
        ("revision", "loader"),
        ("use_safetensors", "loader"),
        ("device_map", "loader"),
        ("local_files_only", "loader"),
        ("auto_map", "cannot be overridden"),
    ],
)
def test_loader_options_are_refused(tmp_path, key, phrase) -> None:
    cfg = _mistral(tmp_path)
    with pytest.raises(UserError, match=f"task.model_overrides.{key}: not a model-config field"):
        _load(f"task.model_path={cfg}", f"task.model_overrides={{{key}: x}}")
    from ringctl.longdoc.model.overrides import refusal

    assert phrase in refusal({"model_type": "mistral"}, {key: "x"})


def test_unknown_fields_name_the_nearest_and_sub_configs_are_checked() -> None:
    from ringctl.longdoc.model.overrides import refusal

    said = refusal({"model_type": "llama"}, {"num_hiden_layers": 4})
    assert said == (
        "task.model_overrides.num_hiden_layers: 'num_hiden_layers' is not a field of "
        "LlamaConfig; nearest fields: num_hidden_layers"
    )
    assert refusal({"model_type": "llama", "sliding_window": 32}, {"sliding_window": None}) is None
    gemma3 = {"model_type": "gemma3", "text_config": {"model_type": "gemma3_text"}}
    inner = refusal(gemma3, {"text_config": {"sliding_windw": 8}})
    assert inner.startswith("task.model_overrides.text_config.sliding_windw: 'sliding_windw' is")
    assert "Gemma3TextConfig; nearest fields: sliding_window" in inner
    assert refusal(gemma3, {"text_config": {"sliding_window": 8}}) is None


def test_overrides_are_set_on_the_loaded_config(tmp_path) -> None:
    """Random weights from a .json and a saved directory get the same: the config built from
    its config.json with the overrides merged in, sub-configs included; the planner sizes the
    overridden model."""
    from ringctl.longdoc.model.load import load_config
    from ringctl.tasks.longdoc import LongDocTask

    cfg = _mistral(tmp_path)
    config, seed = load_config(cfg, {"sliding_window": None, "num_hidden_layers": 3})
    assert (config.sliding_window, config.num_hidden_layers, seed) == (None, 3, 0)
    config.save_pretrained(tmp_path / "saved")
    again, seed = load_config(tmp_path / "saved", {"sliding_window": 16})
    assert (again.sliding_window, seed) == (16, None)
    gemma3_json = tmp_path / "gemma3.json"
    gemma3_json.write_text(
        json.dumps({"model_type": "gemma3", "text_config": {"model_type": "gemma3_text"}})
    )
    gemma3, _ = load_config(gemma3_json, {"text_config": {"sliding_window": 8}})
    assert gemma3.text_config.sliding_window == 8 and type(gemma3.text_config).__name__.endswith(
        "TextConfig"
    )
    job = _load(f"task.model_path={cfg}", "task.model_overrides={num_hidden_layers: 5}")
    assert LongDocTask.model_shape(job.task).layers == 5
