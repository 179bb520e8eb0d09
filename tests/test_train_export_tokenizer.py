"""`ringctl gather` of a training job exports the tokenizer the run trained with, whole.

It copied three names (tokenizer.json, tokenizer_config.json, tokenizer.model) and no link:
a GPT-2-style tokenizer (vocab.json, merges.txt, added tokens) was exported as its
tokenizer_config.json alone, which transformers loads as a tokenizer of one id that encodes
text to nothing, and a model in a Hugging Face cache snapshot (every file a link into
../../blobs) was exported with no tokenizer at all; both exit 0. The reference is the run's
own tokenizer directory, loaded by transformers: the exported copy must give its ids.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest

from ringctl.cli import main

SAMPLES = Path(__file__).resolve().parent.parent / "ringctl" / "longdoc" / "data" / "samples"
TEXT = "The lighthouse keeper ZZQ counted 12 ships at dawn; naïve café 海辺 🌊."


def _legacy_gpt2_tokenizer(folder: Path) -> None:
    """vocab.json + merges.txt (a byte-level BPE trained on the bundled samples), added
    tokens and special tokens in their own files, as older hub repositories hold them."""
    from tokenizers import ByteLevelBPETokenizer

    texts = [p for p in sorted(SAMPLES.iterdir()) if p.suffix == ".txt" and "latin" not in p.name]
    bpe = ByteLevelBPETokenizer()
    bpe.train([str(p) for p in texts], vocab_size=400, min_frequency=2, show_progress=False)
    folder.mkdir(parents=True)
    bpe.save_model(str(folder))  # vocab.json, merges.txt
    size = bpe.get_vocab_size()
    (folder / "added_tokens.json").write_text(json.dumps({"ZZQ": size, "lighthouse": size + 1}))
    special = {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"}
    (folder / "special_tokens_map.json").write_text(json.dumps(special | {"unk_token": "!"}))
    config = {"tokenizer_class": "GPT2Tokenizer", "add_bos_token": False}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def _snapshot(root: Path, tokenizer: Path) -> Path:
    """A Hugging Face cache snapshot of a tiny random Llama with that tokenizer: every file
    of the snapshot a link to its blob, as huggingface_hub writes it."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    vocab = len(AutoTokenizer.from_pretrained(str(tokenizer)))
    made = root / "made"
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=4096,
    )
    LlamaForCausalLM(config).save_pretrained(made)
    repo = root / "hub" / "models--test--tiny"
    snapshot, blobs = repo / "snapshots" / "0123abcd", repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for i, source in enumerate(sorted([*made.iterdir(), *tokenizer.iterdir()])):
        blob = blobs / f"{i:04d}{random.Random(i).getrandbits(64):016x}"
        blob.write_bytes(source.read_bytes())
        (snapshot / source.name).symlink_to(os.path.relpath(blob, snapshot))
    return snapshot


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, Path, Path]:
    """(job directory, the tokenizer directory, the snapshot) of a finished 2-step run."""
    root = tmp_path_factory.mktemp("export-tokenizer")
    tokenizer = root / "tokenizer"
    _legacy_gpt2_tokenizer(tokenizer)
    snapshot = _snapshot(root, tokenizer)
    corpus = root / "corpus"
    corpus.mkdir()
    (corpus / "doc.txt").write_text((TEXT + " ") * 20)
    job = root / "job"
    args = [
        "jobs/train.yaml",
        f"job_dir={job}",
        f"task.inputs=[{corpus}]",
        f"task.model_path={snapshot}",
        "task.seq_len=64",
        "task.batch_sequences=2",
        "task.max_steps=2",
        "task.warmup_steps=1",
        "task.checkpoint_every=2",
        "tasks_per_node=1",
        "timeout=60",
    ]
    assert main(["run", *args]) == 0
    return job, tokenizer, snapshot


def _ids(folder: Path) -> tuple[int, list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    return len(tok), tok(TEXT)["input_ids"]


def test_a_snapshot_s_legacy_tokenizer_is_exported_giving_the_run_s_ids(trained, tmp_path):
    job, tokenizer, snapshot = trained
    out = tmp_path / "out"
    assert main(["gather", str(job), "-o", str(out)]) == 0
    exported = out / "model"
    names = {p.name for p in exported.iterdir()}
    assert {"vocab.json", "merges.txt", "added_tokens.json", "special_tokens_map.json"} <= names
    assert not any(p.is_symlink() for p in exported.iterdir())
    run = _ids(snapshot)
    assert run == _ids(tokenizer) and len(run[1]) > 10
    assert _ids(exported) == run


def test_a_copy_that_misses_a_file_the_tokenizer_reads_is_refused_by_name(trained, tmp_path):
    """The copy is held against the run's tokenizer: one without a file the tokenizer
    reads (here merges.txt, as if transformers read a name gather does not know) is
    refused, naming the exported folder and the source."""
    from ringctl.errors import UserError
    from ringctl.train.export import check_copied_tokenizer, copy_tokenizer

    _, _, snapshot = trained
    where = tmp_path / "model"
    where.mkdir()
    copy_tokenizer(snapshot, where)
    check_copied_tokenizer(snapshot, where)
    (where / "merges.txt").unlink()
    with pytest.raises(UserError) as err:
        check_copied_tokenizer(snapshot, where)
    said = " ".join(str(err.value).split())
    assert said.startswith(f"{where}: the tokenizer copied from {snapshot}")
    assert "does not give the run's ids" in said or "cannot be loaded" in said
